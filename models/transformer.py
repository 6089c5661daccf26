"""Decoder-only transformer: NNX parameter containers and the functional API used by train/pipeline.

Stacked unit: a dense model stacks its n_layers blocks on a leading 'layers' axis. An MoE model with
moe_every = k stacks n_layers / k *groups*; a group is k-1 dense blocks (params['layers']['dense'],
leading axes ['layers', None]) followed by one MoE block (params['layers']['moe']). Units are applied
with one `lax.scan`, so compile time does not grow with depth and a pipeline can slice the stack.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from meshrun_models.attention import Attention, attention, segment_info
from meshrun_models.layers import (
    KEPT_NAMES,
    MLP,
    SAVED_NAMES,
    Fp8State,
    Lead,
    RMSNorm,
    arrays,
    embed_lookup,
    fp8_state,
    mlp,
    normal_param,
    rms_norm,
    vary_over,
    varying_axes,
    vocab_parallel_xent,
)
from meshrun_models.moe import STATS, MoE, moe_ffn

from meshrun.config import ModelConfig
from meshrun.errors import ConfigError
from meshrun.parallel.collective_matmul import ring_degree
from meshrun.parallel.layer_fetch import FETCHED, fetch_layer, fetching
from meshrun.parallel.sharding import constrain

RESID = ("batch", "length", "embed")  # the residual stream between blocks ('length' sharded under SP)
FULL = ("batch", None, "embed")  # inside a block: full sequence (an all-gather under SP)


def n_units(cfg: ModelConfig) -> int:
    """Entries on the 'layers' axis (`ModelConfig.n_units`)."""
    return cfg.n_units


def n_moe_layers(cfg: ModelConfig) -> int:
    return cfg.n_moe_layers


class Block(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(.)); ffn is an MLP or an MoE."""

    def __init__(self, cfg: ModelConfig, lead: Lead, *, moe: bool, rngs: nnx.Rngs, first: bool = False):
        if cfg.fp8 != "none" and (cfg.fp8 == "delayed" or cfg.fp8_first_last_bf16):
            self.fp8 = Fp8State(cfg, lead, last_in_group=moe, first=first)
        self.attn_norm = RMSNorm(cfg, lead)
        self.attn = Attention(cfg, lead, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg, lead)
        if moe:
            self.moe = MoE(cfg, lead, rngs=rngs)
            if cfg.n_shared_experts:  # shared experts: one dense MLP every token passes through
                self.shared = MLP(cfg, lead, rngs=rngs, d_ff=cfg.n_shared_experts * cfg.expert_d_ff)
        else:
            self.mlp = MLP(cfg, lead, rngs=rngs)


class MoEGroup(nnx.Module):
    def __init__(self, cfg: ModelConfig, units: int, *, rngs: nnx.Rngs):
        if cfg.moe_every > 1:
            self.dense = Block(cfg, ((units, "layers"), (cfg.moe_every - 1, None)), moe=False, rngs=rngs)
        self.moe = Block(cfg, ((units, "layers"),), moe=True, rngs=rngs)


class Embed(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.embedding = normal_param(rngs.params(), (cfg.vocab, cfg.d_model), ("vocab", "embed"), (), cfg)


class Head(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.kernel = normal_param(rngs.params(), (cfg.d_model, cfg.vocab), ("embed", "vocab"), (), cfg)


class Transformer(nnx.Module):
    """Params: embed, layers (stacked), final_norm, head (absent when tie_embeddings)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        units = n_units(cfg)
        self.embed = Embed(cfg, rngs=rngs)
        if cfg.first_dense_layers:  # off the 'layers' axis: run by `embed` (see first_layers)
            self.first = Block(cfg, ((cfg.first_dense_layers, None),), moe=False, rngs=rngs, first=True)
        if cfg.is_moe:
            self.layers = MoEGroup(cfg, units, rngs=rngs)
        else:
            self.layers = Block(cfg, ((units, "layers"),), moe=False, rngs=rngs)
        self.final_norm = RMSNorm(cfg)
        if not cfg.tie_embeddings:
            self.head = Head(cfg, rngs=rngs)

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        p = nnx.state(self, nnx.Param)
        x, _ = apply_layers(p["layers"], embed(p, tokens_BxL, self.cfg), self.cfg)
        return logits(p, x, self.cfg)


# ---------------------------------------------------------------- functional API


def init_params(cfg: ModelConfig, rng_seed: int) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params): params is an nnx.State of nnx.Param (logical names on every leaf).
    Values depend only on (cfg, rng_seed), never on the mesh."""
    model = Transformer(cfg, rngs=nnx.Rngs(rng_seed))
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params


def abstract_params(cfg: ModelConfig) -> nnx.State:
    """Shapes/dtypes/logical names without allocating (for shardings and memory estimates)."""
    return nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)


def embed(params: Any, tokens_BxL: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Token ids -> residual stream x_BxLxD (vocab-parallel lookup), in cfg.dtype, then the
    model.first_dense_layers blocks (`first_layers`)."""
    x = embed_lookup(arrays(params["embed"]["embedding"]), tokens_BxL, cfg)
    return first_layers(params, x, cfg) if cfg.first_dense_layers else x


def first_layers(params: Any, x_BxLxD: jax.Array, cfg: ModelConfig) -> jax.Array:
    """model.first_dense_layers: DeepSeek-V3's leading dense layers (params['first'], leading axis
    unnamed, so never split over 'pipe'). They are not units of the 'layers' stack, which stays
    homogeneous (every unit the same MoE group, as the pipeline split and the layer scan need):
    the embedding step runs them, i.e. the first pipeline stage, with their own layer scan under the
    same remat policy. Rows are plain (model_fns refuses packed documents for such a model)."""
    p = arrays(params["first"])
    unit = remat_unit(lambda q, x, seg: _block(q, x, cfg, False, seg), cfg.remat)
    segments = segment_info(None, cfg, x_BxLxD.shape[1])
    x, _ = jax.lax.scan(lambda x, q: (unit(q, x, segments)[0], None), constrain(x_BxLxD, RESID), p)
    return x


def _block(p: Mapping, x_BxLxD: jax.Array, cfg: ModelConfig, moe: bool, segments=None):
    # model.tp_comm_overlap: the matmuls gather the sequence themselves (rings), so h stays split.
    ring = ring_degree(cfg.tp_comm_overlap, x_BxLxD.shape[1])
    h = constrain(
        checkpoint_name(rms_norm(x_BxLxD, p["attn_norm"]["scale"], cfg.norm_eps), "attn_in"), RESID if ring else FULL
    )
    f8 = fp8_state(p, cfg)
    x = x_BxLxD + constrain(attention(p["attn"], h, cfg, segments, f8=f8, ring=ring), RESID)
    x = checkpoint_name(x, "resid_mid")
    ring_mlp = 0 if moe else ring  # the experts' FFN keeps its own dispatch (docs/mesh.md)
    h = constrain(
        checkpoint_name(rms_norm(x, p["mlp_norm"]["scale"], cfg.norm_eps), "mlp_in"), RESID if ring_mlp else FULL
    )
    if moe:
        y, stats = moe_ffn(p["moe"], h, cfg, f8)
        if "shared" in p:  # shared experts, beside the routed ones (DeepSeek-V3: routed + shared)
            y = y + mlp(p["shared"], h, cfg, f8)
    else:
        y, stats = mlp(p["mlp"], h, cfg, f8, ring_mlp), {k: jnp.zeros((), jnp.float32) for k in STATS}
    return constrain(x + constrain(y, RESID), RESID), stats


def _unit(p: Mapping, x_BxLxD: jax.Array, segments, cfg: ModelConfig):
    p = fetch_layer(p)  # offload.params: host -> device and the ZeRO-3 gather, inside the remat
    if not cfg.is_moe:
        return _block(p, x_BxLxD, cfg, moe=False, segments=segments)
    for i in range(cfg.moe_every - 1):
        x_BxLxD, _ = _block(jax.tree.map(lambda w, i=i: w[i], p["dense"]), x_BxLxD, cfg, False, segments)
    return _block(p["moe"], x_BxLxD, cfg, moe=True, segments=segments)


def remat_unit(fn, policy: str, *, named: bool = True):
    """A unit under the remat policy: none keeps Megatron's no-recompute set (`layers.KEPT_NAMES`,
    element-wise work recomputed), selective `layers.SAVED_NAMES`, full only the unit input.
    `named=False` (an MoE unit, whose routing and all_to_alls carry no names): none keeps everything."""
    if policy == "none":
        if not named:  # offload.params: keep everything but the fetched weights (fetched again)
            keep = jax.checkpoint_policies.save_anything_except_these_names(FETCHED)
            return jax.checkpoint(fn, prevent_cse=False, policy=keep) if fetching() else fn
        return jax.checkpoint(fn, prevent_cse=False, policy=jax.checkpoint_policies.save_only_these_names(*KEPT_NAMES))
    if policy == "full":  # Chen et al. 2016: keep only the unit input, recompute everything
        return jax.checkpoint(fn, prevent_cse=False)
    if policy == "offload":  # selective's names, kept in pinned host memory between forward and backward
        return jax.checkpoint(fn, prevent_cse=False, policy=OFFLOAD_POLICY)
    # selective (Korthikanti et al. 2022): keep matmul outputs, recompute the attention core's
    # softmax and the element-wise ops.
    return jax.checkpoint(fn, prevent_cse=False, policy=jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES))


OFFLOAD_POLICY = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=list(SAVED_NAMES),
    offload_src="device", offload_dst="pinned_host",
)  # fmt: skip


def grouped_remat(unit, k: int):
    """remat_every=k: one rematerialised function over k stacked units. Only the group's input is
    kept; the backward re-runs the k units without remat (the same recompute as full remat, one
    forward), so saved layer inputs fall by k and the working set is one group's activations."""

    def group(p_group, x, segments=None):
        # Unrolled (k is small): differentiating an inner lax.scan left one dead matmul per layer in
        # the backward loop (measured: +1 down-projection transpose per layer vs full remat).
        total = None
        for i in range(k):
            x, stats = unit(jax.tree.map(lambda a, i=i: a[i], p_group), x, segments)
            total = stats if total is None else {n: total[n] + stats[n] for n in stats}
        return x, total

    return jax.checkpoint(group, prevent_cse=False)


def apply_layers(layer_params: Any, x_BxLxD: jax.Array, cfg: ModelConfig, segment_ids_BxL: jax.Array | None = None):
    """Run stacked units [a, b) (any contiguous slice of params['layers'] along axis 0; units are
    homogeneous, so the math does not depend on where the slice starts). `segment_ids_BxL`
    (packed documents): attention stays inside each segment and positions restart at its start.

    Returns (x_BxLxD, aux) with aux = {moe_aux_loss, moe_z_loss, dropped_tokens}: float32 sums over
    these units' MoE layers and over the batch's sequences (zeros for a dense model).
    """
    p = arrays(layer_params)
    k = cfg.remat_every
    if k > 1:
        n = jax.tree.leaves(p)[0].shape[0]
        if n % k:
            raise ConfigError(
                "model.remat_every", k, f"use a divisor of the {n} stacked units each call runs", "does not divide"
            )
        unit = grouped_remat(functools.partial(_unit, cfg=cfg), k)
        p = jax.tree.map(lambda a: a.reshape(n // k, k, *a.shape[1:]), p)
    else:
        unit = remat_unit(functools.partial(_unit, cfg=cfg), cfg.remat, named=not cfg.is_moe)

    x = constrain(x_BxLxD, RESID)
    vma = varying_axes(x)
    segments = segment_info(segment_ids_BxL, cfg, x.shape[1])  # once, outside the layer scan

    def step(carry, p_unit):
        x, aux = carry
        x, stats = unit(p_unit, x, segments)
        return (x, {k: aux[k] + vary_over(stats[k], vma) for k in STATS}), None

    aux0 = {k: vary_over(jnp.zeros((), jnp.float32), vma) for k in STATS}
    (x, aux), _ = jax.lax.scan(step, (x, aux0), p)
    return x, aux


def logits(params: Any, x_BxLxD: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm + output projection; logits_BxLxV stay sharded on 'vocab'."""
    p = arrays(params)
    h = constrain(rms_norm(x_BxLxD, p["final_norm"]["scale"], cfg.norm_eps), FULL)
    dt = jnp.dtype(cfg.dtype)
    if cfg.tie_embeddings:
        out = jnp.einsum("bld,vd->blv", h, p["embed"]["embedding"].astype(dt))
    else:
        out = jnp.einsum("bld,dv->blv", h, p["head"]["kernel"].astype(dt))
    return constrain(out, ("batch", None, "vocab"))


def head_loss(params: Any, x_BxLxD: jax.Array, labels_BxL: jax.Array, cfg: ModelConfig):
    """(loss_sum, n_tokens): summed vocab-parallel cross-entropy over labels >= 0 (negative labels
    are ignored) and their count, both float32 -- sums, so microbatches accumulate exactly."""
    return vocab_parallel_xent(logits(params, x_BxLxD, cfg), labels_BxL, cfg.vocab_used)


# ---------------------------------------------------------------- validation


def validate_model_for_mesh(cfg: ModelConfig, mesh_shape: Mapping[str, int]) -> None:
    """ConfigError when the model cannot be split over the mesh (pipeline divisibility is the pipeline's job)."""
    t = int(mesh_shape.get("tensor", 1))
    ep = int(mesh_shape.get("expert", 1))
    widths = (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads), ("d_ff", cfg.d_ff))
    if getattr(cfg, "attention", "gqa") == "mla":  # every head has its own k and v: no kv heads
        widths = (("n_heads", cfg.n_heads), ("d_ff", cfg.d_ff))
    if cfg.is_moe and cfg.moe_d_ff:
        widths += (("moe_d_ff", cfg.moe_d_ff),)
    for field, n in widths:
        if n % t:
            raise ConfigError(
                f"model.{field}",
                n,
                f"use a multiple of mesh.tensor={t}, or a tensor degree that divides {n}",
                f"{field} not divisible by the tensor-parallel degree",
            )
    if cfg.vocab % t:
        padded = -(-cfg.vocab // t) * t
        raise ConfigError(
            "model.vocab",
            cfg.vocab,
            f"pad the vocabulary to a multiple of mesh.tensor={t} (e.g. {padded}) for the vocab-parallel "
            "embedding and loss",
            "vocab not divisible by the tensor-parallel degree",
        )
    if cfg.is_moe:
        if cfg.n_experts % ep:
            raise ConfigError(
                "model.n_experts",
                cfg.n_experts,
                f"use a multiple of mesh.expert={ep}, or an expert degree that divides {cfg.n_experts}",
                "experts not divisible by the expert-parallel degree",
            )
        g = getattr(cfg, "route_groups", 0)
        if g > 1 and ep > 1 and g % ep and ep % g:
            # The choice is exact on any layout; nesting makes route_group_limit bound the expert ranks
            # a token reaches (limit x max(1, ep / groups)), the point of device-limited routing.
            raise ConfigError(
                "model.route_groups", g,
                f"use a multiple or a divisor of mesh.expert={ep}, so that groups and expert ranks nest",
                "expert groups straddle expert-parallel ranks",
            )  # fmt: skip
