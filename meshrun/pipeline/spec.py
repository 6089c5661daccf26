"""`PipelineSpec`: what one pipelined step is, fixed before tracing (typed and frozen): the model, the
tick program, the layer split, the mesh and the ZeRO shardings of the params. `Pipeline(spec)` is the
one way to build a pipelined step; the spec comes from the step plan (`StepPlan.pipeline_spec`) or,
for a caller with a params tree, from `pipeline_spec`. The tick loop (`StageRun`, `OpRun`) and the
forward-only pipeline read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from meshrun.config import PipelineConfig
from meshrun.errors import ConfigError
from meshrun.family.contract import ModelFns
from meshrun.parallel.sharding import batch_axes
from meshrun.parallel.zero import ZeroShardings
from meshrun.pipeline.program import TickProgram, tick_program
from meshrun.pipeline.split import LayerSplit, layer_split

Residuals = Literal["store", "recompute"]  # store each stage vjp's activation leaves, or re-run the forward
Placement = Literal["model", "pipeline"]  # 'layers' stacked in model order, or as the pipeline holds them


@dataclass(frozen=True)
class PipelineSpec:
    fns: ModelFns
    program: TickProgram  # the schedule's table as index arrays (built once)
    split: LayerSplit  # the layers of each virtual stage and their padded placement
    mesh: Mesh
    zero: ZeroShardings  # the params' ZeRO shardings in the pipeline placement
    # the same in model order: the step takes 'layers' in model order and returns their gradients so
    # (None: it takes the pipeline placement, as training stores it)
    model_zero: ZeroShardings | None = None
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
        """Data-parallel shards of the batch (replica x data x expert)."""
        return int(np.prod([self.mesh.shape.get(a, 1) for a in batch_axes(self.mesh)]))

    @property
    def placement(self) -> Placement:
        """How the step takes params['layers']: in model order or in the pipeline placement."""
        return "pipeline" if self.model_zero is None else "model"


def pipeline_spec(fns: ModelFns, pcfg: PipelineConfig, mesh: Mesh, params, *, zero: int = 0,
                  placement: Placement = "model", residuals: Residuals = "store", nan_bubbles: bool = False,
                  skip_idle: bool = True) -> PipelineSpec:  # fmt: skip
    """The spec of `pcfg`'s pipeline for `params` (arrays or shapes; 'layers' stacked in `placement`
    order): its tick program, its layer split (from the stacked count and `pcfg`) and ZeRO
    stage-`zero` shardings."""
    if placement not in ("model", "pipeline"):
        raise ConfigError("placement", placement, "use 'model' or 'pipeline'")
    arrays = pure(params)
    p = int(mesh.shape.get("pipe", 1))
    program = tick_program(pcfg, p)  # the schedule's errors first
    n = jax.tree.leaves(arrays["layers"])[0].shape[0]
    lps = pcfg.layers_per_stage
    split = layer_split(pcfg, sum(lps) if lps and placement == "pipeline" else n, p)
    if fns.param_names is None:
        raise ConfigError("ModelFns.param_names", None, "give the logical axis names of the params tree")
    build = lambda t: ZeroShardings.build(fns.param_names, t, mesh, zero)
    model_zero = None
    if placement == "model":
        model_zero = build(arrays)
        arrays = {**arrays, "layers": jax.eval_shape(split.to_pipeline, arrays["layers"])}
    return PipelineSpec(fns, program, split, mesh, build(arrays), model_zero, residuals, nan_bubbles, skip_idle)


def pure(params) -> dict:
    """A nested dict of the arrays (or shapes) of `params` (nnx.State or a dict)."""
    return params.to_pure_dict() if isinstance(params, nnx.State) else dict(params)
