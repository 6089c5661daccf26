"""Hugging Face model directories and sizes, without jax: what `meshrun import-hf`/`export-hf` check
before any device is set up (a hub id or a bad size fails at once)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from meshrun.errors import ConfigError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMG]?B)?$", re.IGNORECASE)


def read_hf_dir(model_dir: str | Path, field: str = "MODEL_DIR") -> dict[str, Any]:
    """config.json of a local model directory; a hub id or a missing directory is a ConfigError."""
    d = Path(model_dir)
    if not d.is_dir():
        if _HUB_ID.match(str(model_dir)) and not d.exists():
            raise ConfigError(
                field,
                str(model_dir),
                "download it first (e.g. `huggingface-cli download ID --local-dir DIR`) and give that directory",
                "a hub id, not a local directory: meshrun reads local files only, never the network",
            )
        raise ConfigError(
            field, str(model_dir), "give a model directory holding config.json and *.safetensors", "no such directory"
        )
    try:
        return json.loads((d / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(
            field, str(model_dir), "give a transformers model directory", "no config.json in it"
        ) from None
    except ValueError as e:
        raise ConfigError(
            field, str(model_dir), "fix or replace config.json", f"config.json is not JSON ({e})"
        ) from None


def parse_size(text: str) -> int:
    """'5GB', '500MB', '1e9' -> bytes (decimal units, as transformers' max_shard_size)."""
    m = _SIZE.match(text.strip())
    if not m:
        try:
            return int(float(text))
        except ValueError:
            raise ConfigError("--max-shard-size", text, "use e.g. 5GB, 500MB or a byte count") from None
    unit = (m.group(2) or "B").upper()
    return int(float(m.group(1)) * {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}[unit])
