"""`PipelineSpec`: what one pipelined step is, fixed before tracing (typed and frozen). The step plan
builds it once from its layer split and tick program (`StepPlan.pipeline_spec`), `Pipeline.for_params`
from a params tree; `Pipeline` takes it, and the tick loop (`StageRun`, `OpRun`) and the forward-only
pipeline read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from jax.sharding import Mesh

from meshrun.errors import ConfigError
from meshrun.family.contract import ModelFns
from meshrun.parallel.sharding import DP_AXES
from meshrun.pipeline.program import TickProgram
from meshrun.pipeline.split import LayerSplit

Residuals = Literal["store", "recompute"]  # store each stage vjp's activation leaves, or re-run the forward
Placement = Literal["model", "pipeline"]  # 'layers' stacked in model order, or as the pipeline holds them


@dataclass(frozen=True)
class PipelineSpec:
    fns: ModelFns
    program: TickProgram  # the schedule's table as index arrays (built once)
    split: LayerSplit  # the layers of each virtual stage and their padded placement
    mesh: Mesh
    residuals: Residuals = "store"  # store the activation leaves of each stage's vjp, or 'recompute' the forward
    nan_bubbles: bool = False  # idle cells compute on NaN fill values (a test that nothing leaks)
    skip_idle: bool = True  # idle cells skip their compute under a `lax.cond`

    def __post_init__(self):
        if self.residuals not in ("store", "recompute"):
            raise ConfigError("residuals", self.residuals, "use 'store' or 'recompute'")

    @property
    def p(self) -> int:
        """Pipeline stages."""
        return int(self.mesh.shape.get("pipe", 1))

    @property
    def dp(self) -> int:
        """Data-parallel shards of the batch (data x expert)."""
        return int(np.prod([self.mesh.shape.get(a, 1) for a in DP_AXES]))
