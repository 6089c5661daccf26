"""Typed, frozen configs: one small dataclass per component, loaded from YAML + `section.key=value`.

Each component gets only its own section (layers get `ModelConfig`, the mesh builder `MeshConfig`).
Every error is a `ConfigError` naming the field, the value seen and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from meshrun.errors import ConfigError

AXES = ("data", "pipe", "expert", "context", "tensor")
DEFAULT_ORDER = ("pipe", "data", "expert", "context", "tensor")
CONTEXT_KINDS = ("allgather", "ring")  # model.context_parallel
# Model fields that decide how the step runs, not what it computes: a checkpoint resumes across them.
EXECUTION_FIELDS = (
    "remat", "remat_every", "sequence_parallel", "tp_comm_overlap", "attention_impl", "context_parallel",
)  # fmt: skip
REMATS = ("none", "full", "selective", "offload")
GRAD_REDUCE_DTYPES = ("float32", "bfloat16")
FP8_RECIPES = ("none", "tensorwise", "delayed")  # a family's model.fp8 (meshrun.parallel.fp8)
OFFLOAD_TIERS = ("none", "host", "nvme")  # train.offload_optimizer
OFFLOAD_UPDATES = ("auto", "streamed", "whole")  # train.offload_update
OFFLOAD_UPDATE_ON = ("auto", "device", "host")  # train.offload_update_on
OFFLOAD_GRADS = ("host", "nvme")  # train.offload_grads
ZERO3_GATHERS = ("auto", "layer", "step")  # train.zero3_gather
ZERO2_REDUCES = ("auto", "microbatch", "step")  # train.zero2_reduce
# Upper bounds of sizes and counts (ConfigError past them): far above any real run, low enough that
# int32 indexing and per-element Python work stay bounded.
MAX_DIM = 2**24  # one dimension: vocab, d_model, d_ff, sequence length, batch rows, ...
MAX_DEVICES = 2**17  # a mesh degree, hosts, racks
MAX_MICROBATCHES = 2**16
MAX_STEPS = 2**40
MAX_SIMULATED_DEVICES = 1024  # --devices on CPU: XLA sets up ~250 simulated devices a second


def check_device_count(flag: str, n: int | None) -> None:
    """`--devices N` (None: not given): 1..MAX_SIMULATED_DEVICES, else a ConfigError (0 is not 'unset')."""
    if n is not None and not 1 <= n <= MAX_SIMULATED_DEVICES:
        raise ConfigError(
            flag, n, f"use 1..{MAX_SIMULATED_DEVICES} simulated devices (or leave it out)", "out of range"
        )


@dataclass(frozen=True)
class MeshConfig:
    """Parallel degrees. One of them may be -1: it takes the devices left over."""

    data: int = -1  # data-parallel degree: the batch (and ZeRO state) split over this many devices
    pipe: int = 1  # pipeline stages: the stack of layers split over this many devices
    expert: int = 1  # expert parallelism: MoE experts split over this many devices (borrowed from data)
    tensor: int = 1  # tensor parallelism: each layer's weights split over this many devices (Megatron)
    context: int = 1  # context parallelism: each sequence split over this many devices
    order: tuple[str, ...] = DEFAULT_ORDER  # outer -> inner; `tensor` innermost keeps TP on NVLink
    hosts: int = 0  # 0: one host per process; on CPU, H>0 splits the simulated devices into H hosts
    racks: int = 0  # hosts per rack (consecutive hosts share a rack); 0: all hosts in one rack
    allow_cross_host_tensor: bool = False  # true: a tensor group across hosts is a warning, not an error

    def __post_init__(self):
        for ax in AXES:
            v = getattr(self, ax)
            if v == 0 or v < -1:
                raise ConfigError(
                    f"mesh.{ax}",
                    v,
                    "use a positive degree, or -1 to take the devices left over",
                    "degree must be >= 1 or -1",
                )
            _bounded(f"mesh.{ax}", v, -1, MAX_DEVICES)
        fill = [ax for ax in AXES if getattr(self, ax) == -1]
        if len(fill) > 1:
            raise ConfigError("mesh", {a: -1 for a in fill}, "set at most one axis to -1", "two axes are -1")
        if "context" not in self.order and sorted((*self.order, "context")) == sorted(AXES):
            # an order written before the context axis existed: context sits just outside tensor
            at = self.order.index("tensor") if "tensor" in self.order else len(self.order)
            object.__setattr__(self, "order", (*self.order[:at], "context", *self.order[at:]))
        if sorted(self.order) != sorted(AXES):
            raise ConfigError(
                "mesh.order",
                list(self.order),
                f"list each of {list(AXES)} exactly once",
                "order must be a permutation of the mesh axes",
            )
        if self.hosts < 0:
            raise ConfigError("mesh.hosts", self.hosts, "use 0 (one host per process) or a positive count")
        if self.racks < 0:
            raise ConfigError("mesh.racks", self.racks, "use 0 (one rack) or the number of hosts per rack")
        _bounded("mesh.hosts", self.hosts, 0, MAX_DEVICES)
        _bounded("mesh.racks", self.racks, 0, MAX_DEVICES)


@dataclass(frozen=True)
class ModelConfig:
    """What every model family shares: the transformer's sizes and dtypes, then the execution settings
    (how the step runs the model, not what it computes: a checkpoint resumes across them). Each family
    adds its own keys (below); a key the chosen family does not have is refused naming the family."""

    # The base of the families' config classes (`meshrun.family.registry`), never built itself.

    family: str = ""  # the model family: its config class and code (meshrun.family.registry; empty: the default)
    vocab: int = 256  # vocabulary size (a multiple of mesh.tensor); byte-level text data needs >= 256
    # > 0: ids >= vocab_used are padding (a Hugging Face import padded to a multiple): excluded from
    # the softmax and never drawn as data
    vocab_used: int = 0
    d_model: int = 64  # hidden size
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # query heads (a multiple of mesh.tensor)
    n_kv_heads: int = 2  # key/value heads (grouped-query attention; divides n_heads)
    head_dim: int = 16  # size of one attention head
    d_ff: int = 128  # MLP hidden size (per expert in MoE layers)
    max_seq_len: int = 128  # longest sequence the model takes (with learned positions: how many)
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"  # dtype of the parameters; bfloat16 keeps a float32 master copy in the optimizer
    norm_eps: float = 1e-5  # epsilon of RMSNorm / LayerNorm
    init_std: float = 0.02  # standard deviation of the normal weight initialisation
    # ---- execution settings (EXECUTION_FIELDS)

    attention_impl: str = "xla"  # "xla" | "cudnn" (flash attention on GPUs)
    remat: str = "none"  # none | full | selective | offload (selective's names kept in host memory)
    remat_every: int = 1  # k > 1 (with remat=full): keep only every k-th layer's input (groups of k units)
    sequence_parallel: bool = False  # split the residual stream over mesh.tensor along the sequence
    # with sequence_parallel: each block's tensor-parallel matmuls run as rings over mesh.tensor, the
    # all-gather and reduce-scatter split into per-chunk transfers beside the chunks' matmuls (collective
    # matmul, Megatron-Core's --tp-comm-overlap; docs/mesh.md)
    tp_comm_overlap: bool = False
    # mesh.context > 1: how attention crosses the sequence split. allgather: K/V all-gathered over
    # 'context' (cheap with grouped-query attention); ring: K/V blocks passed around a ring (Liu et al.
    # 2023) with the causal work load-balanced (zigzag chunks)
    context_parallel: str = "allgather"

    # ---- what a family declares: class constants, read by the planner, the FLOP counts and the
    # start-up block. A family's class either makes a layer fact its own field or fixes it.
    context_attention: ClassVar[bool] = False  # its attention can cross the 'context' mesh axis
    tp_rings: ClassVar[bool] = False  # its blocks run model.tp_comm_overlap's rings
    predictable: ClassVar[bool] = True  # the planner's transformer formulas describe its layer
    mlp: ClassVar[str] = "gelu"  # swiglu: 3 matrices (gate, up, down); gelu: 2
    tie_embeddings: ClassVar[bool] = False  # the head reuses the embedding matrix
    n_experts: ClassVar[int] = 0  # MoE layers (0: dense)
    top_k: ClassVar[int] = 1
    capacity_factor: ClassVar[float] = 1.0
    moe_dispatch: ClassVar[str] = "capacity"
    moe_every: ClassVar[int] = 1
    # the fields `meshrun checkpoints` shows for a saved model (the family's own fields follow)
    summary: ClassVar[tuple[str, ...]] = (
        "vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len", "n_experts", "dtype",
    )  # fmt: skip

    def __post_init__(self):
        if type(self) is ModelConfig:
            raise TypeError("ModelConfig is the shared base: build the family's class (model_class(name))")
        own = type(self).__dataclass_fields__["family"].default
        if self.family != own and ":" not in self.family:  # package.module:FAMILY names a user's family
            raise ConfigError("model.family", self.family, f"use {type(self).__name__} only for model.family={own}")
        for f in ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "max_seq_len"):
            _bounded(f"model.{f}", getattr(self, f), 1, MAX_DIM)
        if not self.norm_eps > 0:
            raise ConfigError("model.norm_eps", self.norm_eps, "use a positive number")
        if not self.init_std >= 0:
            raise ConfigError("model.init_std", self.init_std, "use a number >= 0")
        if not 0 <= self.vocab_used <= self.vocab:
            raise ConfigError("model.vocab_used", self.vocab_used, f"use 0 (no padding) or 1..model.vocab={self.vocab}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                "model.n_kv_heads",
                self.n_kv_heads,
                f"choose a divisor of model.n_heads={self.n_heads}",
                "n_heads not divisible",
            )
        for f in ("dtype", "param_dtype"):
            if getattr(self, f) not in ("float32", "bfloat16", "float16"):
                raise ConfigError(f"model.{f}", getattr(self, f), "use float32, bfloat16 or float16")
        _choice("model.attention_impl", self.attention_impl, ("xla", "cudnn"))
        _choice("model.remat", self.remat, REMATS)
        _choice("model.context_parallel", self.context_parallel, CONTEXT_KINDS)
        if not isinstance(self.tp_comm_overlap, bool):
            raise ConfigError("model.tp_comm_overlap", self.tp_comm_overlap, "use true or false")
        if self.tp_comm_overlap and not self.tp_rings:
            raise ConfigError(
                "model.tp_comm_overlap", True, "turn it off for this family",
                f"model.family={self.family} does not run its matmuls as tensor rings (docs/mesh.md)",
            )  # fmt: skip
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise ConfigError(
                "model.tp_comm_overlap", True, "set model.sequence_parallel=true with it (or turn it off)",
                "overlaps the sequence-parallel all-gather and reduce-scatter, so it needs sequence parallelism",
            )  # fmt: skip
        if self.remat_every < 1:
            raise ConfigError("model.remat_every", self.remat_every, "use a positive layer count, e.g. 2")
        if self.remat_every > 1 and self.remat != "full":
            raise ConfigError(
                "model.remat_every",
                self.remat_every,
                "set model.remat=full (a group of k layers is rematerialised from its input), or remat_every=1",
                f"grouping layers needs full remat (model.remat={self.remat})",
            )

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def n_units(self) -> int:
        """Entries on the stacked 'layers' axis: n_layers (dense), or n_layers / moe_every (MoE: groups
        of moe_every - 1 dense blocks and one MoE block)."""
        return self.n_layers // self.moe_every if self.is_moe else self.n_layers

    @property
    def n_moe_layers(self) -> int:
        return self.n_units if self.is_moe else 0

    def check_context(self, c: int, field: str = "mesh.context") -> None:
        """ConfigError for a context-parallel degree c > 1 when the family's attention cannot cross the
        'context' axis: the one rule `train` and `plan` apply."""
        if c > 1 and not self.context_attention:
            raise ConfigError(
                field, c, "use context=1 (no context parallelism) for this family",
                f"model.family={self.family} has no context-parallel attention",
            )  # fmt: skip

    @classmethod
    def fixed(cls) -> dict[str, Any]:
        """The layer facts this family's class fixes rather than lets users set: {name: value}."""
        own = cls.__mro__[: cls.__mro__.index(ModelConfig)]  # the family's classes, not this base
        consts = (n for n, tp in typing.get_type_hints(cls).items() if typing.get_origin(tp) is ClassVar)
        consts = (n for n in consts if n not in ("context_attention", "tp_rings", "predictable", "summary"))
        return {n: getattr(cls, n) for n in consts if any(n in vars(k) for k in own)}


# The family config class of a `model.family` name ("": the default family). `meshrun.family.registry`
# installs it when imported (the `meshrun` package imports it first), so that this module names no family.
_model_class: Callable[[str], type[ModelConfig]] | None = None


def use_model_classes(lookup: Callable[[str], type[ModelConfig]]) -> None:
    global _model_class
    _model_class = lookup


def model_class(name: str) -> type[ModelConfig]:
    """The config class of family `name` ("": the default family); ConfigError for an unknown one."""
    if _model_class is None:
        raise RuntimeError("no model families registered: import meshrun.family.registry")
    return _model_class(name)


def default_model() -> ModelConfig:
    return model_class("")()


@dataclass(frozen=True)
class PipelineConfig:
    schedule: str = "1f1b"  # a schedule of the registry (docs/pipeline.md lists them; `meshrun schedule --help`)
    microbatches: int = 1  # m: number of microbatches per step (>= 4*pipe recommended)
    virtual: int = 1  # v: virtual chunks per stage (schedules whose chunk count is free)
    # Stacked layers (MoE: layer groups) per virtual stage k = chunk*pipe + stage, in model order;
    # empty: split by `balance` ('even': equal counts; 'auto': the planner's cost model).
    layers_per_stage: tuple[int, ...] = ()
    balance: str = "even"  # even | auto
    # How ticks run: 'lockstep' (one forward and one backward per stage per tick; 1F1B holds
    # min(m, 2p-1) microbatches' residuals on every stage), 'per_op' (one op per stage per tick, the
    # schedule's own timeline with each backward split into B and W: 1F1B holds p - s on stage s,
    # Megatron's), 'auto' (the schedule's registry entry decides). The schedule's entry says which
    # executors play it (`pipeline.registry.check_config`, run by the step plan: config sits below it).
    executor: str = "auto"  # auto | lockstep | per_op
    # Reduce each chunk's gradients over the data-parallel axes as soon as its last backward op ran
    # (ZeRO >= 1: its reduce-scatter), beside the rest of the tick loop, instead of all after it
    # (Megatron's --overlap-grad-reduce). Schedules with 2+ chunks per stage (zb-v, interleaved).
    overlap_grad_reduce: bool = False

    def __post_init__(self):
        if not self.schedule or not isinstance(self.schedule, str):
            fix = "name a schedule (`meshrun schedule --help` lists them)"
            raise ConfigError("pipeline.schedule", self.schedule, fix)
        _choice("pipeline.executor", self.executor, ("auto", "lockstep", "per_op"))
        _bounded("pipeline.microbatches", self.microbatches, 1, MAX_MICROBATCHES)
        _bounded("pipeline.virtual", self.virtual, 1, MAX_DIM)
        _choice("pipeline.balance", self.balance, ("even", "auto"))
        if not isinstance(self.overlap_grad_reduce, bool):
            raise ConfigError("pipeline.overlap_grad_reduce", self.overlap_grad_reduce, "use true or false")
        if any(n < 1 for n in self.layers_per_stage):
            raise ConfigError(
                "pipeline.layers_per_stage",
                list(self.layers_per_stage),
                "give every stage at least one layer (use fewer stages, or pipeline.balance=auto)",
                "empty stage",
            )
        if self.layers_per_stage and self.balance != "even":
            raise ConfigError(
                "pipeline.balance",
                self.balance,
                "set either pipeline.layers_per_stage or pipeline.balance=auto, not both",
            )


def offload_params_refusals(
    zero: int,
    offload_optimizer: str,
    param_dtype: str | None = None,
    fp8: str | None = None,
    pipe: int | None = None,
    offload_grads: str = "host",
    microbatches: int | None = None,
    overlap_grad_reduce: bool = False,
) -> list[tuple[str, str]]:
    """Why meshrun refuses `train.offload_params=true` beside these settings: (what, fix) pairs, empty
    when it runs them. The one place these rules live: TrainConfig, the step's plan (the model's
    fields, the mesh's pipeline degree) and the planner (which proposes only what this accepts) ask
    it. A field given as None is not checked (TrainConfig does not see the model's), except that
    params below float32 need `pipe` known: they are built without a pipeline only."""
    out = []
    if offload_grads == "nvme":
        # The gradient goes to the nvme tier's file as the backward makes it and the streamed update
        # reads it there once: the tier's file and its update must exist, and with several micro-
        # batches every layer's sum would be read, added to and written back on NVMe m times a step.
        if offload_optimizer != "nvme":
            out.append(
                (
                    f"with train.offload_grads=nvme needs the nvme tier (train.offload_optimizer={offload_optimizer})",
                    "set train.offload_optimizer=nvme with it",
                )
            )
        if microbatches is not None and microbatches > 1:
            out.append(
                (
                    f"with train.offload_grads=nvme writes each layer's gradient once a step, so it takes one "
                    f"microbatch (pipeline.microbatches={microbatches})",
                    "set pipeline.microbatches=1 (a larger micro-batch instead) or train.offload_grads=host",
                )
            )
        if pipe is not None and pipe > 1:
            out.append((f"with train.offload_grads=nvme is built without a pipeline only (mesh.pipe={pipe})",
                        "use mesh.pipe=1 or train.offload_grads=host with it"))  # fmt: skip
    if overlap_grad_reduce:
        out.append(("reduces each layer's gradients inside the layer loop already (pipeline.overlap_grad_reduce=true)",
                    "set pipeline.overlap_grad_reduce=false with it"))  # fmt: skip
    if zero != 3:
        out.append((f"needs ZeRO-3's sharded parameters (train.zero={zero})", "set train.zero=3 (or turn it off)"))
    if fp8 not in (None, "none"):
        out.append(("is not built with fp8 training", "turn model.fp8 off with it"))
    if param_dtype not in (None, "float32") and (pipe is None or pipe > 1):
        # The fetched layer's float32 gradient goes to float32 arrays beside the params
        # (layer_fetch.Shadowed), which the microbatch scan differentiates; the pipeline's backward takes
        # the vjp of the (bf16) params themselves, so each layer's reduced gradient would be rounded.
        got = "mesh.pipe unknown" if pipe is None else f"mesh.pipe={pipe}"
        out.append((f"is built for {param_dtype} params without a pipeline only ({got})",
                    "use mesh.pipe=1 or model.param_dtype=float32 with it"))  # fmt: skip
    return out


LAYER_GATHER_AUTO_BYTES = 2**30  # train.zero3_gather=auto: per-layer gathers above this many gathered bytes


def zero3_layer_refusals(
    param_dtype: str | None = None, fp8: str | None = None, pipe: int | None = None, overlap_grad_reduce: bool = False
) -> list[tuple[str, str]]:
    """Why meshrun refuses `train.zero3_gather=layer` beside these settings: (what, fix) pairs, empty when
    it runs them. The per-layer gather is train.offload_params' fetch with the weights in device memory,
    so the same rules about the model and the pipeline apply (`offload_params_refusals`)."""
    refused = offload_params_refusals(3, "none", param_dtype, fp8, pipe, "host", None, overlap_grad_reduce)
    return [(what, f"{fix}, or set train.zero3_gather=step") for what, fix in refused]


def zero2_layer_refusals(
    param_dtype: str | None = None, fp8: str | None = None, pipe: int | None = None
) -> list[tuple[str, str]]:
    """Why meshrun refuses `train.zero2_reduce=microbatch` beside these settings: (what, fix) pairs. The
    layers' gradient is reduce-scattered by the per-layer fetch's backward into float32 arrays beside
    the parameters, which only the microbatch scan differentiates: no pipeline, no fp8."""
    out = []
    if pipe is not None and pipe > 1:
        out.append((f"is built without a pipeline only (mesh.pipe={pipe})",
                    "use mesh.pipe=1 or train.zero2_reduce=step"))  # fmt: skip
    if fp8 not in (None, "none"):
        out.append(("is not built with fp8 training", "turn model.fp8 off or set train.zero2_reduce=step"))
    return out


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
    once per step: always with train.offload_params (its fetch); `gather` layer or step as asked; auto:
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


def streamed_update_refusal(optimizer: str, elementwise: bool, state_dtype: str, fp8: str | None = None) -> str | None:
    """Why the host tier cannot stream this optimizer's update chunk by chunk (None: it can), so that
    `train.offload_update=auto` keeps the whole-shard update and `streamed` is refused. The one place
    the rule lives: the step's plan (`train.plan.streams_update`) and the planner (`planner.tiers`)."""
    if not elementwise:
        return f"{optimizer}'s update is not elementwise"
    if state_dtype != "float32":
        return f"the streamed update keeps float32 state (optimizer.state_dtype={state_dtype})"
    if fp8 not in (None, "none"):
        return "the streamed update does not carry fp8 scaling state"
    return None


def streams_host_update(offload_update: str, offload_params: bool, refusal: str | None) -> bool:
    """Whether the host tier's update streams chunk by chunk: not with train.offload_update=whole, nor
    train.offload_params (which streams layer by layer itself), nor where `streamed_update_refusal`
    objects (auto keeps the whole-shard update there). The one rule the step's plan
    (`train.plan.streams_update`) and the planner (`planner.tiers.host_streams`) ask."""
    return offload_update != "whole" and not offload_params and refusal is None


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 20  # optimizer steps of the whole run (a resume continues up to it)
    global_batch: int = 16  # sequences per step, over all devices and microbatches
    seq_len: int = 64  # tokens per sequence
    zero: int = 0  # ZeRO stage 0..3
    # ZeRO-3's weight gathers: layer (FSDP: each layer's weights all-gathered inside the layer scan just
    # before use, gathered again in the backward, its gradient reduce-scattered as the backward makes it)
    # | step (every weight gathered once before the loop, kept through the step) | auto (layer where the
    # gathered weights would take more than 1 GiB per device, else step). docs/memory.md
    zero3_gather: str = "auto"
    # ZeRO-2's gradient reduction: microbatch (each layer's gradient reduce-scattered as the backward makes
    # it, every microbatch, into float32 sums that are themselves sharded: 1/DP of the bytes) | step (full
    # float32 sums, one reduce-scatter per step: fewer bytes on the wire, more memory) | auto (microbatch
    # where the layers' float32 sums would take more than 1 GiB per device, else step). docs/memory.md
    zero2_reduce: str = "auto"
    seed: int = 0  # parameter initialisation seed
    log_every: int = 1  # progress line + metrics.jsonl row every k steps (first and last step always)
    eval_every: int = 0  # val_loss on the held-out documents every k steps and at the end (0: never)
    eval_batches: int = 4  # global batches per evaluation (the same ones every time)
    run_dir: str = "runs/default"  # one run: config.yaml, metrics.jsonl, checkpoints/, logs; a rerun resumes
    profile: bool = False  # trace steps with jax.profiler into RUN_DIR/profile and print the profile report
    # Where the optimizer state (moments, and the float32 master weights of params stored below
    # float32) rests between steps: none (device) | host (host memory) | nvme (files in offload_dir);
    # host and nvme stream the update through the device in chunks of offload_budget_mb
    # (docs/offload.md). true/false are read as host/none.
    offload_optimizer: str | bool = "none"
    offload_dir: str = ""  # nvme: a local directory per process ("{process}" is replaced by its index)
    offload_budget_mb: float = 256.0  # nvme, host: host memory for the streamed update's chunk buffers
    # host tier's update: streamed (chunk by chunk, as nvme's; the device holds a few chunks of state) |
    # whole (the whole shard to the device inside the step) | auto (streamed when the optimizer allows)
    offload_update: str = "auto"
    # where the streamed update's chunks are computed: device (copied to the devices and back) | host (jax's
    # CPU backend: the gradient comes down, the new params go up) | auto (in place on CPU devices, whose
    # memory is host memory; device on others). docs/offload.md#where-the-update-runs
    offload_update_on: str = "auto"
    # ZeRO-3 parameters rest in pinned host memory; each layer comes to the device (and is gathered)
    # inside the layer scan, and its reduced gradient goes back to host memory as the backward makes it
    offload_params: bool = False
    # with offload_params and offload_optimizer=nvme: where the layers' float32 gradient rests between the
    # backward and the update: host (pinned host memory) | nvme (written to the tier's file layer by layer
    # as the backward makes it; one microbatch, no pipeline)
    offload_grads: str = "host"
    # dtype of the one data-parallel gradient reduction per step (all-reduce / ZeRO reduce-scatter);
    # gradients accumulate in float32 either way and are cast back before the optimizer
    grad_reduce_dtype: str = "float32"
    # seconds without a finished step before the watchdog ends this process with exit 7 (a hang;
    # RUN_DIR/logs/hang-<process>.txt); 0: auto, max(600, 10 x the median step); -1: off
    step_timeout: float = 0.0
    compile_allowance: float = 1800.0  # seconds added to step_timeout while compiling, evaluating or saving
    # name a process whose host-side time per step exceeds the others' by more than this fraction of
    # the step time (checked every log_every steps, 2+ processes); 0: off
    straggler_threshold: float = 0.2

    def __post_init__(self):
        if not (self.step_timeout >= 0 or self.step_timeout == -1) or not math.isfinite(self.step_timeout):
            raise ConfigError("train.step_timeout", self.step_timeout, "use seconds > 0, 0 (auto) or -1 (off)")
        for f in ("compile_allowance", "straggler_threshold"):
            if not (getattr(self, f) >= 0 and math.isfinite(getattr(self, f))):
                raise ConfigError(f"train.{f}", getattr(self, f), "use a number >= 0")
        for f in ("steps", "log_every", "eval_batches"):
            _bounded(f"train.{f}", getattr(self, f), 1, MAX_STEPS)
        for f in ("global_batch", "seq_len"):
            _bounded(f"train.{f}", getattr(self, f), 1, MAX_DIM)
        if self.eval_every < 0:
            raise ConfigError("train.eval_every", self.eval_every, "use 0 (no evaluation) or a positive step count")
        _bounded("train.seed", self.seed, 0, 2**32 - 1)
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError("train.zero", self.zero, "use a ZeRO stage 0, 1, 2 or 3")
        _choice("train.grad_reduce_dtype", self.grad_reduce_dtype, GRAD_REDUCE_DTYPES)
        _choice("train.zero3_gather", self.zero3_gather, ZERO3_GATHERS)
        if self.zero3_gather != "auto" and self.zero != 3:
            raise ConfigError("train.zero3_gather", self.zero3_gather, "set train.zero=3 with it, or leave it auto",
                              f"chooses ZeRO-3's weight gathers (train.zero={self.zero})")  # fmt: skip
        _choice("train.zero2_reduce", self.zero2_reduce, ZERO2_REDUCES)
        if self.zero2_reduce != "auto" and self.zero != 2:
            raise ConfigError("train.zero2_reduce", self.zero2_reduce, "set train.zero=2 with it, or leave it auto",
                              f"chooses ZeRO-2's gradient reduction (train.zero={self.zero})")  # fmt: skip
        if self.zero3_gather == "step" and self.offload_params:
            raise ConfigError("train.zero3_gather", "step", "leave it auto (or layer) with train.offload_params",
                              "train.offload_params fetches each layer inside the layer scan")  # fmt: skip
        if isinstance(self.offload_optimizer, bool):  # the older boolean spelling
            object.__setattr__(self, "offload_optimizer", "host" if self.offload_optimizer else "none")
        _choice("train.offload_optimizer", self.offload_optimizer, OFFLOAD_TIERS)
        _choice("train.offload_update", self.offload_update, OFFLOAD_UPDATES)
        if self.offload_update != "auto" and self.offload_optimizer != "host":
            raise ConfigError("train.offload_update", self.offload_update, "leave it auto, or set "
                              "train.offload_optimizer=host", "chooses the host tier's update only")  # fmt: skip
        if self.offload_update == "streamed" and self.offload_params:
            raise ConfigError("train.offload_update", "streamed", "leave it auto with train.offload_params",
                              "train.offload_params streams the update layer by layer itself")  # fmt: skip
        _choice("train.offload_update_on", self.offload_update_on, OFFLOAD_UPDATE_ON)
        if self.offload_update_on != "auto":
            why = ("there is no optimizer tier (train.offload_optimizer=none)" if self.offload_optimizer == "none" else
                   "train.offload_update=whole updates the whole shard on the device" if self.offload_update == "whole"
                   else "train.offload_params streams the update layer by layer on the device" if self.offload_params
                   else None)  # fmt: skip
            if why is not None:
                raise ConfigError("train.offload_update_on", self.offload_update_on, "leave it auto, or use it with "
                                  "the streamed update (train.offload_optimizer=host or nvme)", why)  # fmt: skip
        if not 0 < self.offload_budget_mb <= 2**30:
            raise ConfigError("train.offload_budget_mb", self.offload_budget_mb, "use a positive size in MiB, e.g. 256")
        if self.offload_params not in (True, False):
            raise ConfigError("train.offload_params", self.offload_params, "use true or false")
        _choice("train.offload_grads", self.offload_grads, OFFLOAD_GRADS)
        if self.offload_grads != "host" and not self.offload_params:
            raise ConfigError("train.offload_grads", self.offload_grads, "set train.offload_params=true with it "
                              "(or leave it host)", "moves the gradient of the parameters train.offload_params "
                              "streams")  # fmt: skip
        if self.offload_params and (
            refused := offload_params_refusals(self.zero, self.offload_optimizer, offload_grads=self.offload_grads)
        ):
            raise ConfigError("train.offload_params", True, refused[0][1], refused[0][0])
        if self.offload_optimizer == "nvme" and not self.offload_dir:
            raise ConfigError(
                "train.offload_dir", self.offload_dir, "give a local directory for the optimizer state files, "
                "e.g. train.offload_dir=/local/nvme/offload", "required with train.offload_optimizer=nvme",
            )  # fmt: skip


OPTIMIZER_STATE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer (`name`: an entry of meshrun/optim/registry.py), its learning-rate schedule
    (linear warmup from 0 to lr, cosine decay to min_lr_ratio·lr at decay_steps or train.steps) and
    global-norm clipping. `state_dtype`: the dtype of its moments (the float32 master copy stays float32)."""

    name: str = "adamw"  # an entry of meshrun/optim/registry.py: adamw | muon
    lr: float = 3e-3  # peak learning rate (linear warmup, then cosine decay)
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 2  # steps of linear warmup from 0
    weight_decay: float = 0.01  # decoupled weight decay (AdamW; muon: on every parameter too)
    beta1: float = 0.9  # Adam first-moment decay (muon: of its Adam part, the non-matrix parameters)
    beta2: float = 0.95  # Adam second-moment decay
    eps: float = 1e-8  # Adam epsilon (muon: also the Newton-Schulz normalization's)
    grad_clip: float = 1.0  # clip the global gradient norm to this (0: off)
    momentum: float = 0.95  # muon: momentum of the orthogonalized weight matrices
    ns_steps: int = 5  # muon: Newton-Schulz iterations
    state_dtype: str = "float32"  # dtype of the moments: float32 | bfloat16 (the fp32 master stays fp32)
    decay_steps: int = 0  # the cosine reaches min_lr_ratio·lr at this step (0: train.steps), then stays

    def __post_init__(self):
        _bounded("optimizer.decay_steps", self.decay_steps, 0, MAX_STEPS)
        if not self.lr > 0:
            raise ConfigError("optimizer.lr", self.lr, "use a positive learning rate")
        if self.warmup_steps < 0:
            raise ConfigError("optimizer.warmup_steps", self.warmup_steps, "use 0 (no warmup) or a positive step count")
        for f in ("beta1", "beta2", "min_lr_ratio", "momentum"):
            if not 0 <= getattr(self, f) <= 1:
                raise ConfigError(f"optimizer.{f}", getattr(self, f), "use a number in [0, 1]")
        for f in ("weight_decay", "grad_clip"):
            if not getattr(self, f) >= 0:
                raise ConfigError(f"optimizer.{f}", getattr(self, f), "use a number >= 0 (0: off)")
        if not self.eps > 0:
            raise ConfigError("optimizer.eps", self.eps, "use a small positive number, e.g. 1e-8")
        _bounded("optimizer.ns_steps", self.ns_steps, 1, 100)
        _choice("optimizer.state_dtype", self.state_dtype, OPTIMIZER_STATE_DTYPES)


# Keys that moved out of `train:` (issue 37): an old YAML fails with one line naming the new key.
MOVED_KEYS = {f"train.{k}": f"optimizer.{k}" for k in
              ("lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip")}  # fmt: skip
MOVED_KEYS["train.adam_eps"] = "optimizer.eps"


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


@dataclass(frozen=True)
class RunConfig:
    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: ModelConfig = field(default_factory=default_model)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def _bounded(name: str, value: int, lo: int, hi: int) -> None:
    """ConfigError unless lo <= value <= hi: the upper bounds keep every command's work bounded (a size
    past them would overflow an int32 index or take hours before failing)."""
    if not lo <= value <= hi:
        raise ConfigError(name, value, f"use a whole number in [{lo}, {hi}]", "out of range")


def _choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(name, value, f"use one of {list(allowed)}")


bounded, choice = _bounded, _choice  # for the families' config classes


# ---------------------------------------------------------------- generic loading


# other frameworks' names for a key, too far from it for difflib (optax, PyTorch, HF Trainer)
_ALIASES = {"learning_rate": "lr", "epsilon": "eps", "max_steps": "steps", "num_steps": "steps"}


def _suggest(key: str, options) -> str:
    if _ALIASES.get(key) in options:
        return f"did you mean '{_ALIASES[key]}'?"
    close = difflib.get_close_matches(key, list(options), n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'?" if close else f"valid keys: {sorted(options)}"


def _coerce(name: str, tp, value):
    """Check/convert one value against a field's type hint."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if any(type(value) is a for a in args):  # already one of the members (e.g. `str | bool`)
            return value
        return _coerce(name, args[0], value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(name, value, "use true or false", "not a boolean")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if not (isinstance(value, float) and value.is_integer()):
                raise ConfigError(name, value, "use a whole number, e.g. 2", "not an integer")
            value = int(value)
        if abs(value) > 2**62:
            raise ConfigError(name, value, "use a whole number of a sensible size", "out of range")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(name, value, "use a number, e.g. 0.5", "not a number")
        try:
            value = float(value)
        except OverflowError:  # an int past float range
            value = math.inf
        if not math.isfinite(value):
            raise ConfigError(name, value, "use a finite number, e.g. 0.5", "not a finite number")
        return value
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(name, value, "use a string", "not a string")
        return str(value)
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(name, value, "use a list, e.g. [a, b] or a,b", "not a list")
        (inner, *_rest) = typing.get_args(tp)
        return tuple(_coerce(name, inner, v) for v in value)
    raise TypeError(f"unsupported config type {tp} for {name}")


def from_dict(cls, data: dict[str, Any] | None, prefix: str = ""):
    """Build dataclass `cls` from a (nested) dict, checking keys and types (ModelConfig: the family's
    class, `model_from_dict`)."""
    if cls is ModelConfig:
        return model_from_dict(data or {}, prefix)
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if full in MOVED_KEYS:
            new = MOVED_KEYS[full]
            raise ConfigError(full, value, f"write it as {new} (its `{new.split('.')[0]}:` section)", f"moved to {new}")
        if key not in names:
            raise ConfigError(full, value, _suggest(key, names), "unknown key")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(full, value, f"give a mapping of {tp.__name__} keys", "not a section")
            kwargs[key] = from_dict(tp, value, f"{full}.")
        else:
            kwargs[key] = _coerce(full, tp, value)
    return cls(**kwargs)


def model_from_dict(data: dict[str, Any], prefix: str = "model."):
    """The `model:` section -> its family's config class. A key the family does not have is refused
    naming the family; a fact it fixes may be stated with the value it fixes (older configs did)."""
    data = dict(data)
    name = _coerce(f"{prefix}family", str, data.get("family", ""))
    cls = model_class(name)
    fam = name or cls.__dataclass_fields__["family"].default
    names, fixed = {f.name for f in dataclasses.fields(cls)}, cls.fixed()
    for key, value in list(data.items()):
        if key in names:
            continue
        full = f"{prefix}{key}"
        if key in fixed:
            if _coerce(full, type(fixed[key]), value) == fixed[key]:
                del data[key]
                continue
            raise ConfigError(
                full, value, f"remove it ({fam}'s {key} is always {fixed[key]!r})", f"{fam} has no such field"
            )
        if difflib.get_close_matches(key, list(names), n=1, cutoff=0.75):
            raise ConfigError(full, value, _suggest(key, names), "unknown key")
        raise ConfigError(full, value, "remove it", f"{fam} has no such field")
    return from_dict(cls, data, prefix)


def saved_model(saved: dict[str, Any]) -> dict[str, Any]:
    """A model config written by an older meshrun (a checkpoint's meta) as its family's class writes
    it today: a field added since has its default; a field the family does not have is dropped
    (checkpoints from when every family shared one config recorded every family's fields)."""
    defaults = {f.name: f.default for f in dataclasses.fields(model_class(saved.get("family", "")))}
    return {**defaults, **{k: v for k, v in saved.items() if k in defaults}}


def to_dict(cfg) -> dict[str, Any]:
    out = dataclasses.asdict(cfg)

    def fix(d):
        return {k: (fix(v) if isinstance(v, dict) else list(v) if isinstance(v, tuple) else v) for k, v in d.items()}

    return fix(out)


_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`section.key=value` strings -> nested dict (values parsed as YAML scalars)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                item, item, "write overrides as section.key=value, e.g. mesh.tensor=2", "not a key=value override"
            )
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) < 2 or not all(_KEY.match(p) for p in parts):
            raise ConfigError(
                key or item,
                item,
                "write overrides as section.key=value, e.g. mesh.tensor=2",
                "not a section.key name",
            )
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = tree
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(key, raw, "do not set a section and one of its keys together")
        node[parts[-1]] = value
    return tree


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                dup = key in seen
            except TypeError:  # an unhashable key: the base class reports it
                dup = False
            if dup:
                raise ConfigError(
                    "config",
                    key,
                    "give each key once (the later value would silently win)",
                    f"duplicate key on line {key_node.start_mark.line + 1}",
                )
            seen.add(key) if not isinstance(key, (list, dict)) else None
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(
            "config", str(path), "give the path of a YAML file, e.g. configs/tiny_cpu.yaml", "a directory"
        )
    if not p.is_file():
        raise ConfigError("config", str(path), "give the path of an existing YAML file", "no such file")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            "config",
            str(path),
            "give a YAML text file (UTF-8), e.g. configs/tiny_cpu.yaml",
            f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}; a binary file?)",
        ) from None
    except OSError as e:
        raise ConfigError(
            "config", str(path), "give a YAML file you can read", f"cannot read it ({e.strerror or e})"
        ) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except ConfigError as e:
        raise ConfigError("config", str(path), e.fix, f"{e.what}: {e.value!r}") from None
    except yaml.YAMLError as e:
        why = " ".join(str(e).split())  # one line
        raise ConfigError("config", str(path), f"fix the YAML syntax ({why})", "not valid YAML") from None
    if not isinstance(data, dict):
        raise ConfigError("config", str(path), "the top level must be a mapping of sections")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] = (), cls=RunConfig):
    """YAML file (optional) + overrides -> validated config of type `cls`."""
    data = load_yaml(path) if path else {}
    return from_dict(cls, merge(data, parse_overrides(list(overrides))))


def load_mesh(path: str | Path | None, overrides: list[str] = ()) -> MeshConfig:
    """Only the mesh of a run's YAML + overrides: commands set up their devices from it before the
    whole config loads (a user's model family may import jax with its module)."""
    data = merge(load_yaml(path) if path else {}, parse_overrides(list(overrides)))
    mesh = data.get("mesh") or {}
    if not isinstance(mesh, dict):
        raise ConfigError("mesh", mesh, "give a mapping of mesh keys", "not a section")
    return from_dict(MeshConfig, mesh, "mesh.")


def load_section(cls, overrides: list[str], section: str):
    """Only `section.*` overrides -> `cls` (e.g. MeshConfig for `meshrun mesh`)."""
    tree = parse_overrides(list(overrides))
    for k, v in tree.items():
        if k != section:
            raise ConfigError(k, v, f"only {section}.KEY=VALUE overrides apply here", "unknown section")
    return from_dict(cls, tree.get(section, {}), f"{section}.")
