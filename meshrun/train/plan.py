"""The static plan of a train step, computed once per run: `build_plan(cfg, mesh) -> StepPlan`.

Everything the step, the evaluation, the loop, `explain` and `profile` need to know before any array
exists: the checks across config and mesh (`validate`), the model family and its `ModelFns`, the
pipeline's layer split (balance=auto: per-layer costs from the planner's time model) and tick
program, the schedule's bubble, the ZeRO shardings of the parameters in run order and in model
order, the planner's `Layout` of this run (`planner.layout.layout_of`: the one config -> Layout
conversion), and where the state rests (`offload.registry.placement`: which tier, whether and where
the update streams).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import jax
from jax.sharding import Mesh

from meshrun.config import (
    AXES,
    ModelConfig,
    RunConfig,
    offload_params_refusals,
    zero2_layer_refusals,
    zero2_per_microbatch,
    zero3_layer_refusals,
    zero3_per_layer,
)
from meshrun.errors import ConfigError
from meshrun.family import registry
from meshrun.family.contract import Family, ModelFns
from meshrun.offload.registry import Placement, placement
from meshrun.parallel import context
from meshrun.parallel.sharding import REPLICA, is_names, param_rules
from meshrun.parallel.zero import ZeroShardings
from meshrun.pipeline.program import TickProgram, tick_program
from meshrun.pipeline.registry import SCHEDULES, check_config
from meshrun.pipeline.spec import PipelineSpec
from meshrun.pipeline.split import LayerSplit, layer_split
from meshrun.planner.balance import DEFAULT_GPU, stage_costs
from meshrun.planner.cost import Layout, layout_of
from meshrun.planner.hardware import gpu_of_kind


@dataclass(frozen=True)
class StepPlan:
    """What one run's step is, decided before anything is built. `abstract_params`, `zero` and
    `model_zero` are None when the mesh is only a shape (explain's prediction for meshes too large to
    simulate)."""

    cfg: RunConfig
    mesh_shape: MappingProxyType  # axis -> size
    family: Family
    model_fns: ModelFns
    split: LayerSplit | None  # None without a pipeline
    program: TickProgram | None  # None without a pipeline
    stage_bubbles: tuple[float, ...]  # the schedule's idle fraction per stage ((0.0,) without a pipeline)
    bubble: float  # their mean
    layout: Layout  # the planner's view of this run
    abstract_params: Any  # ShapeDtypeStructs of the parameters, model order (None: a mesh shape only)
    zero: ZeroShardings | None  # parameter/gradient/optimizer shardings in run order (pipeline placement)
    model_zero: ZeroShardings | None  # the same in model order (checkpoints; == zero unless relaid)
    offload: Placement  # where the state rests: which tier, whether and where the update streams
    balance_on: tuple[str, str] | None = None  # pipeline.balance=auto: (GPU its layer costs model, why)
    zero3_gather: str | None = None  # ZeRO-3: 'layer' (FSDP, train.zero3_gather resolved) or 'step'; else None
    zero2_reduce: str | None = None  # ZeRO-2: 'microbatch' (sharded sums, train.zero2_reduce resolved) or 'step'

    @property
    def pipe(self) -> int:
        return self.mesh_shape["pipe"]

    @property
    def context(self) -> int:
        return self.mesh_shape.get("context", 1)

    def lay_out(self, batch: tuple) -> tuple:
        """The step's [B, L] inputs in the layout the `context` axis splits (the ring kind's zigzag
        chunks; anything else: unchanged), before they enter the shard_map."""
        return context.lay_out(batch, self.context, self.cfg.model.context_parallel == "ring")

    @property
    def skip_idle(self) -> bool:
        """Whether the pipeline's idle cells skip their compute under a `lax.cond`. Not with layers
        that pass blocks around a ring (`layer_rings`): their collective-permutes inside that
        conditional gave wrong values on XLA:CPU (jax 0.10.2; a permute's pairs span every device,
        the all-reduces and all-gathers there have per-group replica groups), so idle cells compute
        on fill values instead (the residuals go to the trash slot, nothing is added): the same
        numbers, work in the bubble."""
        return layer_rings(self.cfg, self.mesh_shape) is None

    def pipeline_spec(self, mesh: Mesh) -> PipelineSpec:
        """The pipelined step on `mesh` (pipe > 1): this plan's model, tick program, layer split and
        ZeRO shardings (pipeline placement, as training stores the layers)."""
        return PipelineSpec(self.model_fns, self.program, self.split, mesh, self.zero, skip_idle=self.skip_idle)

    @property
    def relaid(self) -> bool:
        """Training stores the layers in pipeline placement (interleaved or an uneven split)."""
        return self.split is not None and not self.split.identity


def dp_degree(mesh) -> int:
    return mesh.shape.get(REPLICA, 1) * mesh.shape["data"] * mesh.shape["expert"]


def unit_costs(model: ModelConfig, seq_len: int | None = None, gpu: str = DEFAULT_GPU) -> tuple[float, float, float]:
    """(one stacked unit, first stage's extra, last stage's extra): the planner's seconds on `gpu`, the
    costs pipeline.balance=auto splits by (a stacked MoE unit is moe_every layers)."""
    layer, first, last = stage_costs(model, seq_len or model.max_seq_len, gpu=gpu)
    return layer * (model.moe_every if model.is_moe else 1), first, last


def balance_gpu(mesh) -> tuple[str, str]:
    """(GPUS name, why) the layer costs of pipeline.balance=auto use: the mesh's own GPU when the
    planner models it, else DEFAULT_GPU (a CPU, an unknown kind, or a mesh given as a shape only)."""
    devices = getattr(mesh, "devices", None)
    kind = getattr(devices.flat[0], "device_kind", "") if devices is not None else ""
    name = gpu_of_kind(kind)
    if name is not None:
        return name, f"this run's {kind}"
    return DEFAULT_GPU, f"the planner's default: {kind or 'the device'} is not a GPU it models"


def check_param_names(value: str, family: Family, names: Any, abstract: Any) -> None:
    """A family's `ModelFns.param_names`: one logical-name tuple (or None) per parameter, in the tree
    of its `init_params`, so that every parameter can be laid out on the mesh."""
    fix = "give ModelFns(param_names=...) one tuple of logical axis names per parameter, in the tree of init_params"
    if names is None:
        raise ConfigError("model.family", value, fix + " (meshrun.state_names of NNX parameters)",
                          f"{family.name}'s ModelFns has no param_names")  # fmt: skip
    leaf = lambda x: x is None or is_names(x)  # noqa: E731
    if jax.tree.structure(names, is_leaf=leaf) != jax.tree.structure(abstract):
        what = f"{family.name}'s ModelFns.param_names is not its parameters' tree"
        raise ConfigError("model.family", value, fix, what)
    known = param_rules()
    for name in {n for t in jax.tree.leaves(names, is_leaf=leaf) if t for n in t if n is not None} - set(known):
        what = f"{family.name}'s parameters use the logical axis {name!r}, which has no mesh rule"
        raise ConfigError("model.family", value, f"use one of {', '.join(sorted(known))}", what)


def build_plan(cfg: RunConfig, mesh) -> StepPlan:
    """Check the config against the mesh and decide the step (see the module doc). `mesh`: a jax Mesh,
    or anything with a `.shape` mapping (then no shardings are built)."""
    shape = {a: int(mesh.shape.get(a, 1)) for a in AXES}
    if REPLICA in mesh.shape:  # HSDP: 'data' is the ZeRO group, 'replica' the groups (mesh.zero_group)
        shape[REPLICA] = int(mesh.shape[REPLICA])
    validate(cfg, mesh)
    family = registry.get(cfg.model.family)
    fns = family.model_fns(cfg.model)
    split, program, stage_bubbles, balance_on = _pipeline_plan(cfg, shape, mesh)
    if cfg.pipeline.overlap_grad_reduce and shape["pipe"] == 1:
        why = "the data-parallel reduction overlaps the pipeline's last ticks"
        raise ConfigError("pipeline.overlap_grad_reduce", True, "set mesh.pipe > 1, or set it false", why)
    check_remat_every(cfg, split)
    if (rings := layer_rings(cfg, shape)) is not None:
        check_ring_pipeline(cfg, split, rings)
    offload = _offload_placement(cfg, shape, mesh)
    gather, reduce = zero3_gather(cfg, shape, family), zero2_reduce(cfg, shape, family)
    abstract = zero = model_zero = None
    if isinstance(mesh, Mesh):
        fsdp = gather == "layer" or reduce == "microbatch"
        abstract, zero, model_zero = _param_shardings(cfg, mesh, family, fns, split, offload, fsdp)
    return StepPlan(
        cfg, MappingProxyType(shape), family, fns, split, program, stage_bubbles,
        sum(stage_bubbles) / len(stage_bubbles), layout_of(cfg, shape), abstract, zero, model_zero, offload,
        balance_on,
        gather, reduce,
    )  # fmt: skip


def _pipeline_plan(
    cfg: RunConfig, shape: Mapping[str, int], mesh
) -> tuple[LayerSplit | None, TickProgram | None, tuple[float, ...], tuple[str, str] | None]:
    """(layer split, tick program, the schedule's bubble per stage, pipeline.balance=auto's (GPU, why))
    of a pipelined run; (None, None, (0.0,), None) without a pipeline (mesh.pipe=1). The bubbles are
    those of the table the program plays (per-op: F = B = W)."""
    if shape["pipe"] == 1:
        return None, None, (0.0,), None
    pc = cfg.pipeline
    program = tick_program(pc, shape["pipe"])  # checks the schedule first, then the layer split
    balance_on = costs = None
    if pc.balance == "auto":
        balance_on = balance_gpu(mesh)
        costs = unit_costs(cfg.model, cfg.train.seq_len, balance_on[0])
    split = layer_split(pc, cfg.model.n_units, shape["pipe"], costs)
    return split, program, program.stage_bubbles, balance_on


def _param_shardings(
    cfg: RunConfig, mesh: Mesh, family: Family, fns: ModelFns, split: LayerSplit | None, offload: Placement, fsdp: bool
) -> tuple[Any, ZeroShardings, ZeroShardings]:
    """(the parameters' ShapeDtypeStructs in model order, their ZeRO shardings in run order, the same
    in model order) on a real mesh, once the family's param_names are checked against its params.
    Run order is pipeline placement where the split relays the layers (`StepPlan.relaid`); else the
    two are one. `fsdp`: ZeRO-3 per layer or ZeRO-2 per microbatch (`ZeroShardings.build`)."""
    abstract = jax.eval_shape(lambda: family.init_params(cfg.model, cfg.train.seed))
    check_param_names(cfg.model.family, family, fns.param_names, abstract)
    build = lambda shapes: ZeroShardings.build(
        fns.param_names,
        shapes,
        mesh,
        cfg.train.zero,
        cfg.train.grad_reduce_dtype,
        offload.pinned,
        from_host=cfg.offload.params,
        fsdp=fsdp,
    )
    model_zero = build(abstract)
    if split is None or split.identity:
        return abstract, model_zero, model_zero
    run = {**abstract, "layers": jax.eval_shape(split.to_pipeline, abstract["layers"])}
    return abstract, build(run), model_zero


def _offload_placement(cfg: RunConfig, shape: Mapping[str, int], mesh) -> Placement:
    """The run's offload placement (`offload.registry.placement`), after the rules that need the mesh:
    offload.params beside the pipeline and microbatches, the MoE bias with the tier's streamed update, and
    pinned host memory on this platform."""
    if cfg.offload.params and (refused := offload_params_refusals(
        cfg.train.zero, cfg.offload.optimizer, fp8=cfg.model.fp8, pipe=shape["pipe"], offload_grads=cfg.offload.grads,
        microbatches=cfg.pipeline.microbatches, overlap_grad_reduce=cfg.pipeline.overlap_grad_reduce,
    )):  # fmt: skip
        raise ConfigError("offload.params", True, refused[0][1], refused[0][0])
    offload = placement(cfg, mesh.devices.flat if hasattr(mesh, "devices") else None)
    if cfg.model.balance == "bias" and offload.streams:
        raise ConfigError(
            "model.balance", "bias", "use model.balance=aux_loss with it, or the host tier's offload.update=whole",
            "the optimizer tier's streamed update does not carry the MoE balance biases",
        )  # fmt: skip
    host = cfg.offload.optimizer == "host" and not offload.streams  # pinned host memory
    if hasattr(mesh, "devices") and (host or cfg.model.remat == "offload" or cfg.offload.params):
        field = "offload.optimizer" if host else "model.remat" if cfg.model.remat == "offload" else \
            "offload.params"  # fmt: skip
        check_host_memory(mesh.devices.flat[0], field)
    return offload


def zero3_gather(cfg: RunConfig, shape: Mapping[str, int], family: Family) -> str | None:
    """ZeRO-3's weight gathers for this run: 'layer' (FSDP: inside the layer scan) or 'step' (once before
    the loop); None below ZeRO-3. train.zero3_gather=layer that the layout cannot run is a ConfigError;
    auto gathers per layer where the whole model's gathered weights would exceed 1 GiB per device
    (`config.zero3_per_layer`)."""
    t, m = cfg.train, cfg.model
    if t.zero != 3:
        return None
    refused = zero3_layer_refusals(cfg.pipeline.overlap_grad_reduce)
    if refused and t.zero3_gather == "layer":
        raise ConfigError("train.zero3_gather", "layer", refused[0][1], refused[0][0])
    gathered = 0.0
    if t.zero3_gather == "auto" and not cfg.offload.params:
        abstract = jax.eval_shape(lambda: family.init_params(m, t.seed))
        split = shape.get("tensor", 1) * shape["pipe"]  # the gathered weights stay split over these
        gathered = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract)) / split
    return "layer" if zero3_per_layer(t.zero3_gather, t.zero, cfg.offload.params, gathered, bool(refused)) else "step"


def zero2_reduce(cfg: RunConfig, shape: Mapping[str, int], family: Family) -> str | None:
    """ZeRO-2's gradient reduction for this run: 'microbatch' (each layer's gradient reduce-scattered into
    sharded float32 sums as the backward makes it) or 'step' (whole sums, one reduction a step); None
    below or above ZeRO-2. train.zero2_reduce=microbatch that the layout cannot run is a ConfigError."""
    t, m = cfg.train, cfg.model
    if t.zero != 2:
        return None
    refused = zero2_layer_refusals(cfg.pipeline.overlap_grad_reduce)
    if refused and t.zero2_reduce == "microbatch":
        raise ConfigError("train.zero2_reduce", "microbatch", refused[0][1], refused[0][0])
    sums = 0.0
    if t.zero2_reduce == "auto":
        abstract = jax.eval_shape(lambda: family.init_params(m, t.seed))["layers"]
        sums = sum(a.size * 4 for a in jax.tree.leaves(abstract)) / (shape.get("tensor", 1) * shape["pipe"])
    return "microbatch" if zero2_per_microbatch(t.zero2_reduce, t.zero, sums, bool(refused)) else "step"


def validate(cfg: RunConfig, mesh) -> None:
    """Cross-component checks before anything is built: batch divisibility, sequence length, the model
    fields its family uses, model vs mesh."""
    t, m = cfg.train, cfg.pipeline.microbatches
    dp = dp_degree(mesh)
    if t.global_batch % (m * dp):
        raise ConfigError(
            "train.global_batch",
            t.global_batch,
            f"use a multiple of pipeline.microbatches ({m}) x data-parallel degree ({dp}) = {m * dp}",
            "global batch not divisible by microbatches x data-parallel degree",
        )
    if t.seq_len > cfg.model.max_seq_len:
        raise ConfigError("train.seq_len", t.seq_len, f"use at most model.max_seq_len={cfg.model.max_seq_len}")
    check_config(cfg.pipeline)  # the schedule's name and executor, on any mesh
    registry.get(cfg.model.family).check_mesh(cfg.model, dict(mesh.shape))
    check_context(cfg, int(mesh.shape.get("context", 1)), int(mesh.shape.get("pipe", 1)))


def check_context(cfg: RunConfig, c: int, pipe: int = 1) -> None:
    """Context parallelism: a family that attends across the axis (the rule `meshrun plan` applies
    too), and sequences that split evenly (the ring kind's zigzag layout cuts each into 2c chunks)."""
    if c == 1:
        return
    cfg.model.check_context(c)
    kind = cfg.model.context_parallel
    if kind == "ring" and pipe > 1:
        check_ring_pipeline(cfg, None, ("model.context_parallel", "ring"))
    div = 2 * c if kind == "ring" else c
    for field, n in (("train.seq_len", cfg.train.seq_len),):
        if n % div:
            how = f"2 x mesh.context = {div}" if kind == "ring" else f"mesh.context = {c}"
            raise ConfigError(
                field, n, f"use a multiple of {how} (model.context_parallel={kind}), or another mesh.context",
                "the sequence does not split evenly over the context axis",
            )  # fmt: skip


def layer_rings(cfg: RunConfig, shape: Mapping[str, int]) -> tuple[str, str] | None:
    """(field, value) of the setting whose layers pass blocks around a ring of collective-permutes
    (the ring kind of context parallelism; model.tp_comm_overlap's matmuls), or None."""
    if shape.get("context", 1) > 1 and cfg.model.context_parallel == "ring":
        return "model.context_parallel", "ring"
    if shape.get("tensor", 1) > 1 and cfg.model.tp_comm_overlap:
        return "model.tp_comm_overlap", True
    return None


def check_ring_pipeline(cfg: RunConfig, split: LayerSplit | None, rings: tuple[str, Any]) -> None:
    """Layers with rings (`layer_rings`) in a pipeline run on the lockstep executor over an even
    layer split: their collective-permutes cannot sit inside a per-stage conditional (the per-op
    executor's op switch, the skipped padding of an uneven split), where XLA:CPU gave wrong values
    (`StepPlan.skip_idle`). `rings`: `layer_rings`' answer."""
    ring_field, ring_value = rings
    off = "model.context_parallel=allgather" if ring_field == "model.context_parallel" else f"{ring_field}=false"
    pc = cfg.pipeline
    sched = check_config(pc)
    if sched.executor(pc.executor) == "per_op":
        own = "lockstep" not in sched.executors  # the schedule itself runs per-op only
        field, value = ("pipeline.schedule", pc.schedule) if own else ("pipeline.executor", pc.executor)
        lock = "/".join(n for n, s in SCHEDULES.items() if "lockstep" in s.executors)
        raise ConfigError(
            field, value, f"use {off}, or {lock} on the lockstep executor",
            f"{ring_field}={ring_value} cannot run on the per-op executor (its rings' permutes sit in the op switch)",
        )  # fmt: skip
    if split is not None and not split.even:
        field = "pipeline.layers_per_stage" if pc.layers_per_stage else "pipeline.balance"
        value = list(pc.layers_per_stage) if pc.layers_per_stage else pc.balance
        raise ConfigError(
            field, value, f"use a layer count per stage that divides evenly (now {list(split.counts)}), or {off}",
            f"{ring_field}={ring_value} needs the same layer count on every stage",
        )  # fmt: skip


def check_remat_every(cfg: RunConfig, split: LayerSplit | None) -> None:
    """remat_every=k groups k stacked units inside each call of the layer stack: the whole stack, or
    one pipeline chunk (an even split's n_units / (pipe * virtual)); groups never straddle a stage."""
    k = cfg.model.remat_every
    if split is not None and not split.even and k > 1:
        raise ConfigError(
            "model.remat_every", k, f"use 1, or an even layer split (layers per chunk now {list(split.counts)})",
            "grouped remat needs the same layer count in every pipeline chunk",
        )  # fmt: skip
    per_chunk = cfg.model.n_units if split is None else split.lmax
    if k > 1 and per_chunk % k:
        where = f"each pipeline chunk holds {per_chunk}" if split is not None else f"the model stacks {per_chunk}"
        raise ConfigError(
            "model.remat_every", k, f"use a divisor of {per_chunk} ({where} layers)", "does not divide the layers"
        )


def check_host_memory(device, field: str) -> None:
    """Host offload needs a 'pinned_host' memory space on the device (GPU, TPU and XLA:CPU have one)."""
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" not in kinds:
        raise ConfigError(
            field, True, f"turn host offload off on {device.platform} (its memories: {sorted(kinds)})",
            "this platform has no pinned_host memory",
        )  # fmt: skip
