"""A small reader and writer of the safetensors format (no torch, no extra package).

Format (huggingface/safetensors): 8 bytes little-endian u64 N, N bytes of JSON {name: {"dtype",
"shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}, then the raw little-endian,
C-order tensor bytes (offsets relative to the end of the header). A sharded model lists
`weight_map` {name: file} in `model.safetensors.index.json`.

Reading memory-maps the files: `SafeTensors.get(name)` is a lazy numpy view, so slicing it reads
only that slice from disk (what placing each shard of a big model on its own device needs).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
NAMES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class FormatError(ValueError):
    """A file that is not valid safetensors (truncated, bad header, unknown dtype)."""


def read_header(path: Path) -> tuple[dict, int]:
    """(header dict, byte offset where the data starts)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise FormatError(f"{path}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise FormatError(f"{path}: header length {n} is not plausible")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise FormatError(f"{path}: header is not JSON ({e})") from None
    return header, 8 + n


def check_entry(path: Path, name: str, info, data_bytes: int) -> None:
    """FormatError naming `path` unless tensor `name`'s header entry has a supported dtype, a shape and
    offsets that fit its byte count and lie inside the file's `data_bytes` (checked when the file is
    opened: a truncated file fails here, not in the middle of placing the weights)."""
    if not isinstance(info, dict):
        raise FormatError(f"{path}: tensor {name} has no header entry")
    dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPES:
        hint = "; dequantize the fp8 checkpoint to BF16 first" if str(dtype).startswith("F8") else ""
        raise FormatError(f"{path}: tensor {name} has unsupported dtype {dtype} (meshrun reads weights stored as "
                          f"F64, F32, F16, BF16{hint})")  # fmt: skip
    ints = lambda v: isinstance(v, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in v)
    if not ints(shape) or not ints(offs) or len(offs) != 2:
        raise FormatError(f"{path}: tensor {name} has a malformed shape or data_offsets")
    b, e = offs
    if e - b != int(np.prod(shape, dtype=object)) * DTYPES[dtype].itemsize:
        raise FormatError(f"{path}: tensor {name} has {e - b} bytes for shape {tuple(shape)} {dtype}")
    if e > data_bytes:
        raise FormatError(f"{path}: truncated: tensor {name} ends at byte {e} of {max(data_bytes, 0)} data bytes")


class SafeTensors:
    """All tensors of one model directory (one file or an index of shards), memory-mapped."""

    def __init__(self, directory: str | Path):
        d = Path(directory)
        if (d / INDEX).is_file():
            try:
                files = sorted(set(json.loads((d / INDEX).read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise FormatError(f"{d / INDEX}: not a safetensors index ({type(e).__name__})") from None
            for name in files:
                if not isinstance(name, str) or not (d / name).is_file():
                    raise FormatError(f"{d / INDEX}: names {name!r}, which is not a file in {d}")
        elif (d / SINGLE).is_file():
            files = [SINGLE]
        else:
            files = sorted(p.name for p in d.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{d}: no *.safetensors file")
        self.entries: dict[str, tuple[Path, dict, int]] = {}
        for name in files:
            header, start = read_header(d / name)
            if not isinstance(header, dict):
                raise FormatError(f"{d / name}: header is not a JSON object")
            size = (d / name).stat().st_size
            for key, info in header.items():
                if key != "__metadata__":
                    check_entry(d / name, key, info, size - start)
                    self.entries[key] = (d / name, info, start)
        self._maps: dict[Path, np.memmap] = {}

    def keys(self) -> list[str]:
        return sorted(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def get(self, name: str) -> np.ndarray:
        """Lazy (memory-mapped) array of tensor `name`."""
        path, info, start = self.entries[name]
        if info["dtype"] not in DTYPES:
            raise FormatError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        dt = DTYPES[info["dtype"]]
        b, e = info["data_offsets"]
        shape = tuple(info["shape"])
        if e - b != int(np.prod(shape)) * dt.itemsize:
            raise FormatError(f"{path}: tensor {name} has {e - b} bytes for shape {shape} {info['dtype']}")
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        return self._maps[path][start + b : start + e].view(dt).reshape(shape)


def write(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """One safetensors file; tensors written in name order, 8-byte aligned header (as the reference)."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    names = sorted(tensors)
    for k in names:
        a = tensors[k]
        header[k] = {
            "dtype": NAMES[np.dtype(a.dtype)],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for k in names:
            f.write(np.ascontiguousarray(tensors[k]).tobytes())  # numpy on every supported host is little-endian


def write_sharded(directory: str | Path, tensors: Iterable[tuple[str, np.ndarray]], max_shard_bytes: int) -> list[str]:
    """Write (name, array) pairs, in order, into shards of at most `max_shard_bytes` (a bigger tensor gets
    its own shard), named like transformers' (model-00001-of-00003.safetensors) plus the index; a single
    shard is model.safetensors without an index. Holds at most one shard in memory. Returns the files."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = [[]]
    tmp_names: list[str] = []
    current: dict[str, np.ndarray] = {}
    size, total = 0, 0

    def flush():
        name = f".shard-{len(tmp_names):05d}.tmp"
        write(d / name, current)
        tmp_names.append(name)

    for name, a in _iter(tensors):
        if current and size + a.nbytes > max_shard_bytes:
            flush()
            current, size = {}, 0
            shards.append([])
        current[name] = a
        shards[-1].append(name)
        size += a.nbytes
        total += a.nbytes
    flush()
    n = len(tmp_names)
    final = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for tmp, out in zip(tmp_names, final):
        (d / tmp).replace(d / out)
    if n > 1:
        weight_map = {k: final[i] for i, names in enumerate(shards) for k in names}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (d / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return final


def _iter(tensors: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    for name, a in tensors:
        yield name, np.asarray(a)
