"""`checkpoint:`: how often to save, how many to keep, where to resume from, and the local tier."""

from __future__ import annotations

from dataclasses import dataclass

from meshrun.errors import ConfigError


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # save every N steps (0: only at the end)
    keep: int = 2  # newest checkpoints kept
    async_save: bool = True  # save in the background while training goes on
    resume: bool = True  # resume from the newest intact checkpoint in train.run_dir (false: refuse if any)
    # A parameter-only checkpoint (`meshrun import-hf`) to start from when run_dir has no checkpoint
    # yet: its params, a fresh optimizer state, step 0.
    init_params: str = ""
    # The local tier (docs/faults.md): every N steps each process also writes the shards it holds to
    # local_dir, a per-host local disk or RAM disk; a restart resumes from the newest step every process
    # still has, else from the persistent checkpoints (0: off).
    local_every: int = 0
    local_dir: str = ""  # "{process}" is replaced by the process index (else a process-P subdirectory)
    local_keep: int = 2  # newest local checkpoints kept per process

    def __post_init__(self):
        if self.every < 0:
            raise ConfigError("checkpoint.every", self.every, "use 0 (only at the end) or a positive step count")
        if self.keep < 1:
            raise ConfigError("checkpoint.keep", self.keep, "keep at least 1 checkpoint")
        if self.local_every < 0:
            raise ConfigError("checkpoint.local_every", self.local_every, "use 0 (no local tier) or a step count")
        if self.local_keep < 1:
            raise ConfigError("checkpoint.local_keep", self.local_keep, "keep at least 1 local checkpoint")
        if self.local_every > 0 and not self.local_dir.strip():
            raise ConfigError(
                "checkpoint.local_dir", self.local_dir,
                "set checkpoint.local_dir=PATH (a local disk or RAM disk) or checkpoint.local_every=0",
                "required with checkpoint.local_every > 0",
            )  # fmt: skip
