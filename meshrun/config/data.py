"""`data:`: where the tokens come from."""

from __future__ import annotations

from dataclasses import dataclass

from meshrun.config.base import _choice
from meshrun.errors import ConfigError


@dataclass(frozen=True)
class DataConfig:
    kind: str = "text"  # synthetic | text | tokens | prepared
    glob: str = ""  # text: files to read; empty = the Python standard library's own .py sources
    path: str = ""  # tokens: flat uint16/uint32 .bin file; prepared: a `meshrun prepare-data` directory
    token_dtype: str = "uint16"  # tokens: dtype of the .bin file (uint16 | uint32)
    seed: int = 0  # which rows each step draws: a batch is a function of (seed, step)
    val_fraction: float = 0.0  # prepared: share of documents held out for validation (train.eval_every)
    pack_documents: bool = False  # prepared: attention, positions and loss stay inside each document

    def __post_init__(self):
        _choice("data.kind", self.kind, ("synthetic", "text", "tokens", "prepared"))
        _choice("data.token_dtype", self.token_dtype, ("uint16", "uint32"))
        if not 0 <= self.val_fraction < 1:
            raise ConfigError("data.val_fraction", self.val_fraction, "use a fraction in [0, 1), e.g. 0.01")
        if self.kind != "prepared" and (self.val_fraction or self.pack_documents):
            raise ConfigError(
                "data.kind",
                self.kind,
                "use data.kind=prepared (a `meshrun prepare-data` directory), or drop "
                "data.val_fraction / data.pack_documents",
                "validation split and packing need document boundaries",
            )
