"""The gpt2 family's Hugging Face tables: transformers `GPT2LMHeadModel` config.json <-> ModelConfig and
tensor names <-> meshrun parameter paths (the adapter on `FAMILY.hf`; the generic reading, placement
and writing is meshrun/hf/).

Layout: GPT-2's Conv1D weights are stored [in, out] (no transpose); `attn.c_attn` fuses q, k, v along
its output axis ([D, 3D] weight, [3D] bias: three parts of one tensor); `lm_head` is tied to `wte`.
The `attn.bias` / `attn.masked_bias` buffers of older checkpoints are ignored; names with or without
the `transformer.` prefix are read (`canonical_name`).
"""

from __future__ import annotations

import re
from typing import Any

from meshrun_models.gpt2.config import Gpt2Config

from meshrun.config import ModelConfig
from meshrun.errors import ConfigError

ARCHITECTURES = ("GPT2LMHeadModel",)
MODEL_TYPES = ("gpt2",)
FIELD = "MODEL_DIR/config.json"
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # the tanh approximation, as the model computes


def family_of(hf: dict) -> str:
    return "gpt2"


def model_config(hf: dict, vocab_multiple: int = 128) -> ModelConfig:
    """ModelConfig of a GPT-2 config.json (vocab padded to a multiple of `vocab_multiple`)."""
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise ConfigError(f"{FIELD}: activation_function", act, f"meshrun's GPT-2 uses {ACTIVATIONS[0]}")
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
        if hf.get(key, ok) != ok:
            raise ConfigError(f"{FIELD}: {key}", hf[key], f"meshrun's GPT-2 needs {key}={ok}")
    if not hf.get("tie_word_embeddings", True):
        raise ConfigError(f"{FIELD}: tie_word_embeddings", False, "meshrun's GPT-2 ties lm_head to wte")
    d, n = hf["n_embd"], hf["n_head"]
    return Gpt2Config(
        vocab=-(-hf["vocab_size"] // vocab_multiple) * vocab_multiple,
        d_model=d,
        n_layers=hf["n_layer"],
        n_heads=n,
        n_kv_heads=n,
        head_dim=d // n,
        d_ff=hf.get("n_inner") or 4 * d,
        max_seq_len=hf.get("n_positions", 1024),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
    )


def hf_config(cfg: ModelConfig, vocab: int, dtype: str) -> dict[str, Any]:
    """A transformers GPT-2 config.json for a meshrun gpt2 model."""
    if cfg.n_heads * cfg.head_dim != cfg.d_model:
        raise ConfigError(
            "model.head_dim", cfg.head_dim, f"use d_model / n_heads = {cfg.d_model / cfg.n_heads:g}",
            "transformers' GPT-2 splits n_embd into its heads",
        )  # fmt: skip
    return {
        "architectures": list(ARCHITECTURES),
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.d_ff,
        "n_positions": cfg.max_seq_len,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.norm_eps,
        "tie_word_embeddings": True,
        "torch_dtype": dtype,
    }


def top_map(cfg: ModelConfig) -> dict[tuple[str, ...], tuple[str, str]]:
    """meshrun leaf path -> (hf name, kind) of the unstacked leaves (see meshrun/hf/convert.py)."""
    return {
        ("embed", "embedding"): ("transformer.wte.weight", "vocab"),
        ("pos", "embedding"): ("transformer.wpe.weight", "id"),
        ("final_norm", "scale"): ("transformer.ln_f.weight", "id"),
        ("final_norm", "bias"): ("transformer.ln_f.bias", "id"),
    }


def layer_map(cfg: ModelConfig) -> dict[tuple[str, ...], tuple]:
    """meshrun leaf path -> (hf name template with {l}, transform, heads[, part, parts])."""
    h, n = "transformer.h.{l}.", cfg.n_heads
    m: dict[tuple[str, ...], tuple] = {}
    for ln in ("ln_1", "ln_2"):
        m[("layers", ln, "scale")] = (h + ln + ".weight", "id", 0)
        m[("layers", ln, "bias")] = (h + ln + ".bias", "id", 0)
    for i, x in enumerate("qkv"):
        m[("layers", "attn", x)] = (h + "attn.c_attn.weight", "in_col", n, i, 3)
        m[("layers", "attn", x + "_bias")] = (h + "attn.c_attn.bias", "bias", n, i, 3)
    m[("layers", "attn", "o")] = (h + "attn.c_proj.weight", "in_row", n)
    m[("layers", "attn", "o_bias")] = (h + "attn.c_proj.bias", "id", 0)
    m[("layers", "mlp", "up")] = (h + "mlp.c_fc.weight", "id", 0)
    m[("layers", "mlp", "up_bias")] = (h + "mlp.c_fc.bias", "id", 0)
    m[("layers", "mlp", "down")] = (h + "mlp.c_proj.weight", "id", 0)
    m[("layers", "mlp", "down_bias")] = (h + "mlp.c_proj.bias", "id", 0)
    return m


def canonical_name(name: str) -> str:
    """`transformer.`-prefixed, as `GPT2LMHeadModel` saves; files saved from `GPT2Model` (and, as
    reported, the original GPT-2 checkpoints) store `h.0.attn...`, `wte.weight` without it."""
    return name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name


def ignored(cfg: ModelConfig, name: str) -> bool:
    """The tied lm_head copy and the causal-mask buffers of older checkpoints."""
    return name == "lm_head.weight" or re.search(r"\.h\.\d+\.attn\.(bias|masked_bias)$", name) is not None
