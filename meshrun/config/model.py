"""`model:`: the fields every model family shares (the base of the families' config classes) and the
lookup of a `model.family` name to its class, installed by `meshrun.family.registry`."""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from meshrun.config.base import MAX_DIM, _bounded, _choice
from meshrun.errors import ConfigError

CONTEXT_KINDS = ("allgather", "ring")  # model.context_parallel
# Model fields that decide how the step runs, not what it computes: a checkpoint resumes across them.
EXECUTION_FIELDS = (
    "remat", "remat_every", "sequence_parallel", "tp_comm_overlap", "attention_impl", "context_parallel",
)  # fmt: skip
REMATS = ("none", "full", "selective", "offload")
FP8_RECIPES = ("none", "tensorwise", "delayed", "blockwise")  # model.fp8 (meshrun.parallel.fp8, fp8_block)
FP8_FIELDS = ("fp8", "fp8_amax_history", "fp8_first_last_bf16", "fp8_block")
MAX_AMAX_HISTORY = 1024  # the longest delayed-scaling history NVIDIA Transformer Engine and MaxText use


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
    # fp8 GEMMs in every layer's q/k/v, attention output, MLP and experts in and out (docs/fp8.md): none |
    # tensorwise (scales from the current amax) | delayed (from the max of an amax history) | blockwise
    # (DeepSeek-V3: a scale per 1 x fp8_block activation tile and fp8_block^2 weight block); a family
    # without fp8 GEMMs refuses anything but none
    fp8: str = "none"
    fp8_amax_history: int = 16  # fp8=delayed: steps of amax history
    fp8_block: int = 128  # fp8=blockwise: tile size b (a dim smaller than b is one tile; larger: a multiple of b)
    fp8_first_last_bf16: bool = False  # with fp8: the first and last layers stay in the compute dtype
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
    fp8_gemms: ClassVar[bool] = False  # its layers run model.fp8's GEMMs (else the fp8 keys are refused)
    predictable: ClassVar[bool] = True  # the planner's transformer formulas describe its layer
    mlp: ClassVar[str] = "gelu"  # swiglu: 3 matrices (gate, up, down); gelu: 2
    tie_embeddings: ClassVar[bool] = False  # the head reuses the embedding matrix
    n_experts: ClassVar[int] = 0  # MoE layers (0: dense)
    top_k: ClassVar[int] = 1
    capacity_factor: ClassVar[float] = 1.0
    moe_dispatch: ClassVar[str] = "capacity"
    moe_every: ClassVar[int] = 1
    moe_d_ff: ClassVar[int] = 0  # one routed expert's width (0: d_ff)
    n_shared_experts: ClassVar[int] = 0  # experts every token passes through (width n_shared_experts * expert_d_ff)
    first_dense_layers: ClassVar[int] = 0  # leading dense layers before the MoE units
    balance: ClassVar[str] = "aux_loss"  # how the routed experts' load is balanced: aux_loss | bias
    # the fields `meshrun checkpoints` shows for a saved model (the family's own fields follow)
    summary: ClassVar[tuple[str, ...]] = (
        "vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len", "n_experts", "dtype",
    )  # fmt: skip

    def __post_init__(self):
        self._check_family()
        self._check_sizes()
        self._check_execution()
        self._check_fp8()

    def _check_family(self) -> None:
        """Built as a family's own class, for that family's name (or a user's `package.module:FAMILY`)."""
        if type(self) is ModelConfig:
            raise TypeError("ModelConfig is the shared base: build the family's class (model_class(name))")
        own = type(self).__dataclass_fields__["family"].default
        if self.family != own and ":" not in self.family:  # package.module:FAMILY names a user's family
            raise ConfigError("model.family", self.family, f"use {type(self).__name__} only for model.family={own}")

    def _check_sizes(self) -> None:
        """The transformer's sizes, constants and dtypes (what the model computes)."""
        has = {f.name for f in fields(self)}  # a family may fix a shared field as a ClassVar: not checked here
        for f in ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "max_seq_len"):
            if f in has:
                _bounded(f"model.{f}", getattr(self, f), 1, MAX_DIM)
        if not self.norm_eps > 0:
            raise ConfigError("model.norm_eps", self.norm_eps, "use a positive number")
        if not self.init_std >= 0:
            raise ConfigError("model.init_std", self.init_std, "use a number >= 0")
        if not 0 <= self.vocab_used <= self.vocab:
            raise ConfigError("model.vocab_used", self.vocab_used, f"use 0 (no padding) or 1..model.vocab={self.vocab}")
        if {"n_heads", "n_kv_heads"} <= has and self.n_heads % self.n_kv_heads:
            raise ConfigError(
                "model.n_kv_heads",
                self.n_kv_heads,
                f"choose a divisor of model.n_heads={self.n_heads}",
                "n_heads not divisible",
            )
        for f in ("dtype", "param_dtype"):
            if getattr(self, f) not in ("float32", "bfloat16", "float16"):
                raise ConfigError(f"model.{f}", getattr(self, f), "use float32, bfloat16 or float16")

    def _check_execution(self) -> None:
        """The execution settings (EXECUTION_FIELDS): how the step runs the model."""
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

    def _check_fp8(self) -> None:
        if not self.fp8_gemms:
            for f in FP8_FIELDS:
                if getattr(self, f) != type(self).__dataclass_fields__[f].default:
                    raise ConfigError(f"model.{f}", getattr(self, f), "remove it (or use a family with fp8 GEMMs)",
                                      f"model.family={self.family} has no fp8 GEMMs")  # fmt: skip
        _choice("model.fp8", self.fp8, FP8_RECIPES)
        if self.tp_comm_overlap and self.fp8 != "none":
            raise ConfigError(
                "model.tp_comm_overlap", True, "turn model.fp8 off with it, or model.tp_comm_overlap off",
                f"runs its rings in the compute dtype, not fp8 (model.fp8={self.fp8})",
            )  # fmt: skip
        if self.fp8_amax_history < 1:
            raise ConfigError("model.fp8_amax_history", self.fp8_amax_history, "use at least 1 step, e.g. 16")
        _bounded("model.fp8_block", self.fp8_block, 1, MAX_DIM)
        if self.fp8_amax_history > MAX_AMAX_HISTORY:  # a parameter per fp8 GEMM, with Adam moments of its own
            fix = f"use at most {MAX_AMAX_HISTORY} steps, e.g. 16"
            raise ConfigError("model.fp8_amax_history", self.fp8_amax_history, fix, "longer than any recipe uses")

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def expert_d_ff(self) -> int:
        """One routed expert's hidden size: moe_d_ff, or d_ff when it is 0."""
        return self.moe_d_ff or self.d_ff

    @property
    def n_units(self) -> int:
        """Entries on the stacked 'layers' axis: n_layers (dense), or (n_layers - first_dense_layers) /
        moe_every (MoE: groups of moe_every - 1 dense blocks and one MoE block; the first dense layers
        are not on the axis)."""
        return (self.n_layers - self.first_dense_layers) // self.moe_every if self.is_moe else self.n_layers

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
        declared = ("context_attention", "tp_rings", "fp8_gemms", "predictable", "summary")
        consts = (n for n in consts if n not in declared)
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
