"""The planner's view of one run: its parallel `Layout` (`layout_of` a run config: the one config ->
Layout conversion) and the bytes per element of each model state (`precision_of`), shared by the
Megatron-style memory model (cost.py), the model of meshrun's own step (step_model.py) and the time
model (timing.py). Pure Python.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from meshrun.config import ModelConfig, RunConfig
from meshrun.optim import registry as optimizers
from meshrun.pipeline import registry

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Layout:
    """One candidate parallel layout. Dense layers' data-parallel group is data x expert (EP folded
    into DP). Context parallelism (`context` = c > 1) splits each sequence over c devices (tensor
    innermost, then context: TP x CP inside a node where possible); it does not multiply the batch,
    but the gradient reduction and the ZeRO shards run over data x expert x context
    (`grad_group`). `context_kind`: how attention crosses the split (CONTEXT_KINDS). `optimizer` and
    `state_dtype`: the optimizer (an entry of `meshrun.optim.registry`) and its moments' dtype, which
    set the optimizer state's bytes (`precision_of`). `grad_reduce_dtype`: the dtype of meshrun's one
    data-parallel gradient reduction per step (`train.grad_reduce_dtype`). `offload_optimizer` and
    `offload_params`: where the state and the parameters rest (`search.evaluate` costs them with
    `offload.apply`); `offload_update`: whether the host tier streams its update (`tiers.host_streams`)."""

    tensor: int = 1
    pipe: int = 1
    data: int = 1
    expert: int = 1
    virtual: int = 1
    microbatches: int = 1
    micro_batch_size: int = 1
    zero: int = 0
    remat: str = "full"  # none | selective | full (| offload: `layout_of` a run config)
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # a name in `pipeline.registry`
    executor: str = "lockstep"  # lockstep | per_op (resolved by the schedule's entry: `sched`, `run_executor`)
    context: int = 1  # context parallelism: each sequence split over this many devices
    context_kind: str = "allgather"  # allgather (K/V all-gathered over 'context') | ring (K/V blocks ring)
    optimizer: str = "adamw"  # optimizer.name
    state_dtype: str = "float32"  # optimizer.state_dtype
    grad_reduce_dtype: str = "float32"  # train.grad_reduce_dtype (meshrun's default; Megatron reduces in fp32)
    offload_optimizer: str = "none"  # offload.optimizer: none | host | nvme (`tiers.py`)
    offload_update: str = "auto"  # offload.update: the host tier's update, auto | streamed | whole
    offload_params: bool = False  # offload.params (`param_offload.py`)
    overlap_grad_reduce: bool = False  # pipeline.overlap_grad_reduce (Megatron: --overlap-grad-reduce)
    offload_grads: str = "host"  # offload.grads: host | nvme, with offload_params
    tp_comm_overlap: bool = False  # model.tp_comm_overlap (Megatron-Core: --tp-comm-overlap), with sequence_parallel
    # Megatron semantics, fp8 with tp_comm_overlap: the forward reduce-scatters' userbuffers hold fp8 too
    # (Transformer Engine's fp8_buf on proj_fprop / fc2_fprop; its all-gathers' are fp8 by default)
    tp_comm_fp8_rs: bool = False
    # Megatron semantics: the distributed optimizer's param all-gathers run beside the next step's first
    # forwards (--overlap-param-gather; NeMo's distributed Adam: overlap_param_sync)
    overlap_param_gather: bool = False
    # Megatron semantics, pipelined: the output layer's weight gradients of this many micro-batches run in
    # the pipeline flush (--defer-embedding-wgrad-compute, --wgrad-deferral-limit); 0: not deferred
    wgrad_deferral: int = 0
    # Megatron semantics only: NeMo's distributed Adam (Apex DistributedFusedAdam) on a bf16 model keeps
    # the 16-bit remainders of the fp32 master weights beside the bf16 params (store_param_remainders),
    # 2 bytes per param in place of a 4-byte master copy (`precision_of`)
    param_remainders: bool = False
    zero3_gather: str = "auto"  # train.zero3_gather: layer (FSDP) | step | auto (`step_model.layerwise`)
    zero2_reduce: str = "auto"  # train.zero2_reduce: microbatch (sharded sums) | step | auto
    # mesh.zero_group (HSDP): ZeRO state sharded over groups of this many data ranks (e.g. one node's GPUs)
    # and replicated over data / zero_group of them; 0: over all of `data`
    zero_group: int = 0

    @property
    def zero_data(self) -> int:
        """Data ranks one ZeRO shard group spans: `zero_group` (HSDP) or all of `data`."""
        return self.zero_group or self.data

    @property
    def replicas(self) -> int:
        """Copies of the ZeRO state (HSDP: data / zero_group; else 1): the all-reduce across them."""
        return self.data // self.zero_data

    @property
    def sched(self) -> registry.Schedule:
        """The schedule's registry entry."""
        return registry.get(self.schedule)

    @property
    def run_executor(self) -> str:
        """The executor that plays the schedule: `executor` if the schedule runs on it, else its first."""
        return self.sched.executor(self.executor)

    @property
    def chunks(self) -> int:
        """Virtual chunks per stage the schedule runs (1 without a pipeline)."""
        return self.sched.chunks_of(self.virtual) if self.pipe > 1 else 1

    @property
    def n_devices(self) -> int:
        return self.tensor * self.pipe * self.data * self.expert * self.context

    @property
    def grad_group(self) -> int:
        """Ranks that hold the same dense weights: the gradient reduction and ZeRO group, data x
        expert x context (Megatron's dp x cp)."""
        return self.data * self.expert * self.context

    @property
    def global_batch(self) -> int:
        # Pipeline stages share each micro-batch, so PP does not multiply the batch: B = b x m x DP.
        return self.micro_batch_size * self.microbatches * self.data * self.expert


def replaced(lay: Layout, **fields) -> Layout:
    """`dataclasses.replace(lay, **fields)` without its per-call field checks (Layout has no
    __post_init__, so a copy of its fields is the same Layout): the search builds hundreds of thousands."""
    new = object.__new__(Layout)
    new.__dict__.update(lay.__dict__, **fields)
    return new


def model_layout(model: ModelConfig, **kw) -> Layout:
    """A Layout whose remat and sequence parallelism are the model's unless given in `kw`."""
    return Layout(**{"remat": model.remat, "sequence_parallel": model.sequence_parallel, **kw})


def layout_of(cfg: RunConfig, mesh_shape) -> Layout:
    """The Layout of a run config on a mesh of `mesh_shape` (axis -> size): the one config -> planner
    conversion. remat is the model's, remat=offload included (`step_model.predict_memory_jax` models it;
    the time model costs it as selective plus its host traffic: `search.predict_step_time`). Context
    parallelism: `mesh_shape['context']` (else `mesh.context`) and `model.context_parallel`."""
    m = cfg.pipeline.microbatches
    replicas = mesh_shape.get("replica", 1)  # HSDP: the data axis split into replica x data (mesh.zero_group)
    data = replicas * mesh_shape["data"]
    dp = data * mesh_shape["expert"]  # the batch is split over data x expert only (not context)
    return Layout(
        tensor=mesh_shape["tensor"],
        pipe=mesh_shape["pipe"],
        data=data,
        zero_group=mesh_shape["data"] if replicas > 1 else 0,
        expert=mesh_shape["expert"],
        virtual=cfg.pipeline.virtual,
        microbatches=m,
        micro_batch_size=max(1, cfg.train.global_batch // (m * dp)),
        zero=cfg.train.zero,
        remat=cfg.model.remat,
        sequence_parallel=cfg.model.sequence_parallel,
        schedule=cfg.pipeline.schedule,
        executor=registry.executor_of(cfg.pipeline),
        context=max(1, int(mesh_shape.get("context", getattr(cfg.mesh, "context", 1)))),  # -1 unresolved: 1
        context_kind=getattr(cfg.model, "context_parallel", "allgather"),
        optimizer=cfg.optimizer.name,
        state_dtype=cfg.optimizer.state_dtype,
        grad_reduce_dtype=cfg.train.grad_reduce_dtype,
        offload_optimizer=cfg.offload.optimizer,
        offload_update=cfg.offload.update,
        offload_params=cfg.offload.params,
        overlap_grad_reduce=cfg.pipeline.overlap_grad_reduce,
        offload_grads=cfg.offload.grads,
        tp_comm_overlap=getattr(cfg.model, "tp_comm_overlap", False),
        zero3_gather=cfg.train.zero3_gather,
        zero2_reduce=cfg.train.zero2_reduce,
    )


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model state, and per activation element."""

    param: float
    grad: float
    opt: float  # optimizer state of a hidden-layer weight matrix (moments + fp32 master when params are 16-bit)
    act: float
    opt_other: float | None = None  # of every other parameter (embeddings, head, norms) when it differs
    reduce: float = 4.0  # per gradient element of the data-parallel reduction on the wire

    @property
    def opt_rest(self) -> float:
        return self.opt if self.opt_other is None else self.opt_other


def precision_of(model: ModelConfig, framework: str = "meshrun", layout: Layout | None = None) -> Precision:
    """Bytes per param of params, grads, optimizer state, and per activation element, as `framework` keeps them.
    megatron, bf16 params: 2 + 4 + 12 = 18 B/param (fp32 `main_grad` buffers, accumulated and
    all-reduced in fp32; fp32 master + Adam m, v: the ZeRO paper's K=12), Adam whatever the layout
    says, sharded by `layout.zero` (Megatron-Core's distributed optimizer: 6 + 12/d). The gradient
    buffer and its reduction take `layout.grad_reduce_dtype` (NeMo's `grad_sync_dtype: bf16`: 2 + 2 +
    12/d); `layout.param_remainders` (NeMo's distributed Adam) stores 2-byte master remainders: 2 + 8.
    meshrun: gradients in the param dtype; the optimizer state the registry entry of
    `layout.optimizer` declares (moments in `layout.state_dtype`, plus a float32 master below float32):
    adamw with bf16 params 2 + 2 + 12 (8 with bf16 moments), fp32 params 4 + 4 + 8. `layout` None:
    adamw with float32 moments. `predict_memory` adds meshrun's float32 gradient accumulator and the
    update temporary. The DP reduction (`reduce`) carries the float32 sums, or their bf16 cast with
    `layout.grad_reduce_dtype=bfloat16`; Megatron's is fp32."""
    lay = layout or Layout()
    if framework == "megatron":
        return _precision(model.param_dtype, model.dtype, "megatron", grad_reduce_dtype=lay.grad_reduce_dtype,
                          remainders=lay.param_remainders)  # fmt: skip
    return _precision(model.param_dtype, model.dtype, framework, lay.optimizer, lay.state_dtype, lay.grad_reduce_dtype)


@functools.lru_cache(maxsize=256)
def _precision(param_dtype: str, dtype: str, framework: str, optimizer: str = "adamw", state_dtype: str = "float32",
               grad_reduce_dtype: str = "float32", remainders: bool = False) -> Precision:  # fmt: skip
    """`precision_of` from the fields it reads (cached: the search asks it several times per layout)."""
    pb, act = DTYPE_BYTES[param_dtype], DTYPE_BYTES[dtype]
    if framework == "megatron":
        gb = DTYPE_BYTES[grad_reduce_dtype]
        master = 0 if pb == 4 else (2 if remainders and pb == 2 else 4)
        return Precision(param=pb, grad=gb, opt=8 + master, act=act, reduce=gb)
    spec, master = optimizers.get(optimizer), pb < 4
    opt, other = (spec.state_bytes(state_dtype, master, matrix) for matrix in (True, False))
    rb = DTYPE_BYTES[grad_reduce_dtype]
    return Precision(param=pb, grad=pb, opt=opt, act=act, opt_other=None if other == opt else other, reduce=rb)


CONTEXT_KINDS = ("allgather", "ring")


def zero_divisors(zero: int, dp: int) -> tuple[int, int, int]:
    """How many ways ZeRO stage `zero` splits (params, grads, optimizer states) over `dp` ranks."""
    return {0: (1, 1, 1), 1: (1, 1, dp), 2: (1, dp, dp), 3: (dp, dp, dp)}[zero]
