"""ZeRO-2 / ZeRO-3 variants (`train.zero2_reduce`, `train.zero3_gather`): the rules that choose them
and the layouts that cannot run them, asked by the step's plan and the planner alike."""

from __future__ import annotations

from meshrun.config.offload import offload_params_refusals

LAYER_GATHER_AUTO_BYTES = 2**30  # train.zero3_gather=auto: per-layer gathers above this many gathered bytes


def zero3_layer_refusals(overlap_grad_reduce: bool = False) -> list[tuple[str, str]]:
    """Why meshrun refuses `train.zero3_gather=layer` beside these settings: (what, fix) pairs, empty when
    it runs them. The per-layer gather is offload.params' fetch with the weights in device memory,
    so the same rules apply (`offload_params_refusals`), but fp8: the step's update rotates the
    fetched layers' delayed-scaling observations like the gather-once step's."""
    refused = offload_params_refusals(3, "none", overlap_grad_reduce=overlap_grad_reduce)
    return [(what, f"{fix}, or set train.zero3_gather=step") for what, fix in refused]


def zero2_layer_refusals(overlap_grad_reduce: bool = False) -> list[tuple[str, str]]:
    """Why meshrun refuses `train.zero2_reduce=microbatch` beside these settings: (what, fix) pairs. The
    layers' gradient is reduce-scattered by the per-layer fetch's backward into float32 arrays beside
    the parameters, which the microbatch scan or the pipeline's stage vjp differentiates (any param
    dtype, fp8 included): nothing is left for pipeline.overlap_grad_reduce to reduce."""
    if overlap_grad_reduce:
        return [("reduces each layer's gradients inside the layer loop already (pipeline.overlap_grad_reduce=true)",
                 "set pipeline.overlap_grad_reduce=false or train.zero2_reduce=step")]  # fmt: skip
    return []


def zero2_per_microbatch(reduce: str, zero: int, sum_bytes: float, refused: bool) -> bool:
    """Whether ZeRO-2 reduce-scatters each layer's gradient every microbatch into sharded float32 sums
    (DeepSpeed's ZeRO-2) rather than keeping whole sums reduced once per step: as asked, or (auto) where
    the layers' whole float32 sums (`sum_bytes` per device) would exceed `LAYER_GATHER_AUTO_BYTES` and the
    layout runs it. The one rule the step's plan and the planner ask."""
    if zero != 2:
        return False
    if reduce != "auto":
        return reduce == "microbatch"
    return not refused and sum_bytes > LAYER_GATHER_AUTO_BYTES


def zero3_per_layer(gather: str, zero: int, offload_params: bool, gathered_bytes: float, refused: bool) -> bool:
    """Whether ZeRO-3 gathers each layer's weights inside the layer scan (FSDP) rather than every weight
    once per step: always with offload.params (its fetch); `gather` layer or step as asked; auto:
    per layer where the whole model's gathered weights (`gathered_bytes` per device) would exceed
    `LAYER_GATHER_AUTO_BYTES` and the layout can run it (`refused`: `zero3_layer_refusals` objects).
    The one rule the step's plan and the planner ask."""
    if zero != 3:
        return False
    if offload_params:
        return True
    if gather != "auto":
        return gather == "layer"
    return not refused and gathered_bytes > LAYER_GATHER_AUTO_BYTES
