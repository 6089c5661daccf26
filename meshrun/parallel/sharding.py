"""Logical axis names -> mesh axes, and the PartitionSpec helpers every other module uses.

Mesh axis names are defined here (and in `config.AXES`/configs); other modules name the axes they
run collectives over through the constants below (`DP_AXES`, `MANUAL`).

Two small tables (Levanter-style): PARAM_RULES for weights, COMPUTE_RULES for activations.
ZeRO is a table swap (Rajbhandari et al. 2020): stage 1 shards optimizer state over the gradient
group ('data','expert','context') and reduce-scatters the gradients onto it, stage 3 also
shards parameters (FSDP). Stage 2 equals stage 1 here: gradients are accumulated locally over the
microbatches and reduced once per step, so no stage keeps full reduced gradients.
A mesh axis may appear once per PartitionSpec: a later dimension drops axes an earlier one used
(e.g. expert weights [expert, embed, mlp] under ZeRO-3 shard `embed` over 'data' only).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = dict[str, tuple[str, ...]]

DP_AXES = ("data", "expert")  # dense layers' data-parallel group: expert parallelism folds into DP
# Context parallelism splits every sequence over this axis: the batch is not split over it, but a
# replicated weight's gradient is summed over it like over DP (Megatron's dp x cp group).
CONTEXT = "context"
ZERO_AXES = (*DP_AXES, CONTEXT)  # the ZeRO sharding group
# Hybrid sharded data parallel (`mesh.zero_group`): the mesh builder splits the data axis into an outer
# 'replica' axis and an inner 'data' axis (the ZeRO group). The batch and the gradient reduction span
# both; ZeRO state is sharded over the inner group only and replicated over 'replica'. Meshes without
# HSDP have no 'replica' axis: `batch_axes` / `manual_axes` give the axes a mesh has.
REPLICA = "replica"
GRAD_AXES = (REPLICA, *ZERO_AXES)  # gradient reduction group (ZeRO shards over its ZERO_AXES only)
# Manual axes of the step's shard_maps (the microbatch loop and the pipeline's tick loop): each device
# runs its own pipeline stage, data shard and sequence chunk; 'tensor' stays auto (GSPMD shards the
# weights inside).
MANUAL = ("pipe", *GRAD_AXES)
BATCH_SPEC = PartitionSpec(DP_AXES, CONTEXT)  # [batch, length] inputs: rows over DP, tokens over context

# Weights. Megatron TP: q/k/v, gate, up column-parallel (heads/mlp), out/down row-parallel; vocab-parallel.
PARAM_RULES: Rules = {
    "layers": ("pipe",),
    "vocab": ("tensor",),
    "embed": (),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "expert": ("expert",),
    "norm": (),
}

# Activations.
COMPUTE_RULES: Rules = {
    "batch": (REPLICA, *DP_AXES),
    "length": (),
    "embed": (),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "vocab": ("tensor",),
    "expert": ("expert",),
    "layers": (),
}

ZERO_PARTS = ("params", "grads", "opt")


def param_rules(zero: int = 0, part: str = "params") -> Rules:
    """Rules for `part` in ('params', 'grads', 'opt') at ZeRO stage `zero`."""
    if part not in ZERO_PARTS:
        raise ValueError(f"part must be one of {ZERO_PARTS}, got {part!r}")
    # Gradients leave the step reduce-scattered from stage 1 on (Megatron's distributed optimizer):
    # each rank updates only its optimizer shard, so it needs only that shard of the reduced grads.
    sharded_from = {"opt": 1, "grads": 1, "params": 3}[part]
    rules = dict(PARAM_RULES)
    if zero >= sharded_from:
        rules["embed"] = ZERO_AXES  # FSDP: every weight has an `embed` dimension (HSDP: not over 'replica')
    return rules


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """Mesh axes the batch rows are split over: the DP axes, after 'replica' where the mesh has it (HSDP)."""
    return ((REPLICA,) if REPLICA in mesh.shape else ()) + DP_AXES


def batch_spec(mesh: Mesh, tokens: bool = True) -> PartitionSpec:
    """[batch, length] inputs on `mesh`: rows over `batch_axes`, tokens over 'context' (`tokens`)."""
    return PartitionSpec(batch_axes(mesh), CONTEXT) if tokens else PartitionSpec(batch_axes(mesh))


def manual_axes(mesh: Mesh) -> tuple[str, ...]:
    """The step's manual axes (`MANUAL`) that `mesh` has: 'replica' only with HSDP."""
    return tuple(a for a in MANUAL if a in mesh.shape)


def compute_rules(sequence_parallel: bool = False) -> Rules:
    """Activation rules; sequence parallelism shards `length` over `tensor` between blocks."""
    rules = dict(COMPUTE_RULES)
    if sequence_parallel:
        rules["length"] = ("tensor",)
    return rules


def logical_to_spec(
    names: Sequence[str | None], rules: Rules, mesh: Mesh | None = None, shape: Sequence[int] | None = None
) -> PartitionSpec:
    """Map logical dimension names to a PartitionSpec. Axes absent from `mesh`, of size 1,
    already used by an earlier dimension, or not dividing `shape` are dropped."""
    used: set[str] = set()
    out = []
    for i, name in enumerate(names):
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
        axes = []
        for ax in rules[name]:
            if ax in used or (mesh is not None and mesh.shape.get(ax, 1) == 1):
                continue
            if mesh is not None and shape is not None:
                size = mesh.shape[ax] * _prod(mesh.shape[a] for a in axes)
                if shape[i] % size:
                    continue
            axes.append(ax)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def logical_names(var: Any) -> tuple[str | None, ...] | None:
    """Logical names declared on an NNX Variable (`out_sharding=` / `nnx.with_partitioning`)."""
    meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
    names = meta.get("out_sharding", meta.get("sharding_names"))
    return tuple(names) if names is not None else None


def is_names(x: Any) -> bool:
    """A leaf of a logical-names tree: a tuple of axis names / None."""
    return isinstance(x, tuple) and all(isinstance(n, str | type(None)) for n in x)


def names_to_specs(names: Any, shapes: Any, rules: Rules, mesh: Mesh | None = None) -> Any:
    """Tree of logical-name tuples + same tree of arrays/ShapeDtypeStructs -> tree of PartitionSpecs
    (names shorter than the array are padded with None)."""

    def one(nm, a):
        nm = tuple(nm or ()) + (None,) * (len(a.shape) - len(nm or ()))
        return logical_to_spec(nm, rules, mesh, a.shape)

    return jax.tree.map(one, names, shapes, is_leaf=lambda x: x is None or is_names(x))


def state_names(state: Any) -> Any:
    """NNX State (Variables with logical names) -> plain nested dict of logical-name tuples."""
    tree = jax.tree.map(lambda v: logical_names(v) or (), state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return tree.to_pure_dict() if hasattr(tree, "to_pure_dict") else tree


def tree_specs(state: Any, rules: Rules, mesh: Mesh | None = None) -> Any:
    """NNX State (Variables with logical names) -> same tree of PartitionSpecs."""

    def one(var):
        value = var.get_value() if hasattr(var, "get_value") else var.value
        names = logical_names(var) or ()
        names = tuple(names) + (None,) * (value.ndim - len(names))
        return logical_to_spec(names, rules, mesh, value.shape)

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def tree_shardings(state: Any, mesh: Mesh, rules: Rules) -> Any:
    """NNX State -> tree of NamedShardings (use with jax.device_put or jit out_shardings)."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), tree_specs(state, rules, mesh), is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


# ---------------------------------------------------------------- PartitionSpec helpers


def spec_dims(spec: PartitionSpec) -> list[tuple[str, ...]]:
    """PartitionSpec -> per-dimension tuple of mesh axes (() for an unsharded dimension)."""
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]


def restrict_spec(spec: PartitionSpec, axes: Sequence[str] = MANUAL) -> PartitionSpec:
    """Keep only `axes` in `spec` (a shard_map's in/out specs may name only its manual axes)."""
    dims = [tuple(a for a in d if a in axes) for d in spec_dims(spec)]
    return PartitionSpec(*[None if not d else d[0] if len(d) == 1 else d for d in dims])


def dims_with(spec: PartitionSpec, axes: Sequence[str]) -> list[tuple[int, tuple[str, ...]]]:
    """(dim, the axes of `axes` on it) for every dimension of `spec` that names one of `axes`."""
    return [(d, hit) for d, names in enumerate(spec_dims(spec)) if (hit := tuple(a for a in names if a in axes))]


def is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


# ---------------------------------------------------------------- activation constraints

_CTX: contextvars.ContextVar[tuple[Mesh | None, Rules, frozenset[str]]] = contextvars.ContextVar(
    "meshrun_rules", default=(None, COMPUTE_RULES, frozenset())
)


@contextlib.contextmanager
def use_rules(mesh: Mesh | None, rules: Rules | None = None, manual: Sequence[str] = ()) -> Iterator[None]:
    """Activate `rules` for `constrain`. Inside a shard_map, list its manual axes in `manual`:
    they are dropped from constraints (those dimensions are already local)."""
    token = _CTX.set((mesh, dict(rules or COMPUTE_RULES), frozenset(manual)))
    try:
        yield
    finally:
        _CTX.reset(token)


def current_rules() -> tuple[Mesh | None, Rules, frozenset[str]]:
    return _CTX.get()


def splits(name: str) -> int:
    """How many devices the logical axis `name` is split over under the active rules (manual axes
    included; 1 without a mesh)."""
    mesh, rules, _ = _CTX.get()
    if mesh is None:
        return 1
    n = 1
    for ax in rules.get(name, ()):
        n *= mesh.shape.get(ax, 1)
    return n


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """with_sharding_constraint by logical names; a no-op when no mesh is active (one device)."""
    mesh, rules, manual = _CTX.get()
    if mesh is None or mesh.size == 1:
        return x
    rules = {k: tuple(a for a in v if a not in manual) for k, v in rules.items()}
    spec = logical_to_spec(names, rules, mesh, x.shape)
    if manual:
        # Inside shard_map the context mesh is abstract with manual axes; a bare spec binds to it.
        return jax.lax.with_sharding_constraint(x, spec)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
