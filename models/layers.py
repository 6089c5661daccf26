"""Parameter helpers and the small pure layers: RMSNorm, RoPE, dense MLP, vocab-parallel embedding and loss.

Shape letters: B batch, L length, D d_model, F d_ff, V vocab, H query heads, K kv heads, G = H/K,
Dh head_dim, E experts, C expert capacity, S tokens per routing group.

Parameters are created already stacked: `lead` is a tuple of `(size, logical_name)` prefixes, e.g.
`((n_units, 'layers'),)`, so every stacked leaf carries the right logical name on every dimension
(nnx.vmap's PARTITION_NAME only adds one named axis; nested stacks need a `None` axis too).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshrun.config import ModelConfig
from meshrun.parallel import fp8
from meshrun.parallel.collective_matmul import ag_matmul, matmul_rs
from meshrun.parallel.sharding import constrain

# Logical names must stay names (flax 0.12 would otherwise try to shard eagerly on creation).
nnx.use_eager_sharding(False)

Lead = tuple[tuple[int, str | None], ...]

# Activation names used by the `selective` remat policy (saved; everything else is recomputed):
# the matmul outputs the backward cannot rebuild without a matmul, less than Megatron's selective set
# (RoPE, the norms and the attention core are recomputed).
SAVED_NAMES = ("qkv", "attn_out", "resid_mid", "mlp_hidden")
# `remat=none`: what Megatron keeps without recompute (Korthikanti et al. 2022, section 4): the norm
# outputs (matmul inputs; named before the sequence-parallel all-gather, so kept split over
# 'tensor'), roped q and k, v, the softmax output in the compute dtype, the attention output, the
# mid-block residual, the MLP's pre-activation and activation output. Only element-wise work
# (the norms' statistics, RoPE's rotation) is recomputed; nothing is saved in float32.
# Context parallelism's ring kind keeps its output and float32 log-sum-exp (its custom backward
# recomputes each block's probabilities from them, as flash attention does) instead of `probs`.
KEPT_NAMES = ("attn_in", "q_rot", "k_rot", "v", "probs", "attn_out", "resid_mid", "mlp_in", "mlp_hidden", "mlp_act",
              "ring_out", "ring_lse")  # fmt: skip


def varying_axes(x: jax.Array) -> frozenset:
    """The manual mesh axes `x` varies over inside a shard_map (jax >= 0.10: manual_axis_type; older: vma)."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    return frozenset(mat.varying if mat is not None else getattr(t, "vma", ()))


def vary_over(z: jax.Array, axes: frozenset) -> jax.Array:
    """`z` made to vary over `axes` too: a loop carry inside a caller's shard_map varies as its inputs."""
    missing = tuple(sorted(axes - varying_axes(z)))
    return jax.lax.pcast(z, missing, to="varying") if missing else z


def dtype_of(name: str) -> jnp.dtype:
    return jnp.dtype(name)


def normal_param(key, shape: Sequence[int], names: Sequence[str | None], lead: Lead, cfg: ModelConfig, std=None):
    """Stacked normal(0, std) weight with logical names `lead names + names`."""
    lead_shape = tuple(s for s, _ in lead)
    std = cfg.init_std if std is None else std
    value = std * jax.random.normal(key, lead_shape + tuple(shape), dtype_of(cfg.param_dtype))
    return nnx.Param(value, out_sharding=tuple(n for _, n in lead) + tuple(names))


def zeros_param(shape: Sequence[int], names: Sequence[str | None], lead: Lead, cfg: ModelConfig):
    lead_shape = tuple(s for s, _ in lead)
    value = jnp.zeros(lead_shape + tuple(shape), dtype_of(cfg.param_dtype))
    return nnx.Param(value, out_sharding=tuple(n for _, n in lead) + tuple(names))


def ones_param(shape: Sequence[int], names: Sequence[str | None], lead: Lead, cfg: ModelConfig):
    lead_shape = tuple(s for s, _ in lead)
    value = jnp.ones(lead_shape + tuple(shape), dtype_of(cfg.param_dtype))
    return nnx.Param(value, out_sharding=tuple(n for _, n in lead) + tuple(names))


def arrays(tree: Any) -> Any:
    """nnx.State / dict of nnx.Param -> plain nested dict of arrays (differentiable, no copies)."""
    if isinstance(tree, nnx.Variable):
        return tree.get_value()
    if isinstance(tree, Mapping):
        return {k: arrays(v) for k, v in tree.items()}
    return tree


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def softmax_to(x: jax.Array, dtype) -> jax.Array:
    """softmax(x) over the last axis (x float32), returned in `dtype`. Its backward reads only that
    output (Megatron's fused softmax: dx = y (dy - sum(dy y))), so a remat policy that saves the
    probabilities in the compute dtype keeps 2 bytes per score in bf16, not float32 scores and probabilities."""
    return jax.nn.softmax(x, axis=-1).astype(dtype)


def _softmax_fwd(x, dtype):
    y = softmax_to(x, dtype)
    return y, y


def _softmax_bwd(dtype, y, dy):
    y32, dy32 = y.astype(jnp.float32), dy.astype(jnp.float32)
    return ((dy32 - jnp.sum(dy32 * y32, axis=-1, keepdims=True)) * y32,)


softmax_to.defvjp(_softmax_fwd, _softmax_bwd)


# ---------------------------------------------------------------- modules (parameter containers)


class RMSNorm(nnx.Module):
    """Scale named ('norm',): never sharded, not even by ZeRO-3 (a d_model vector is too small to split)."""

    def __init__(self, cfg: ModelConfig, lead: Lead = ()):
        self.scale = ones_param((cfg.d_model,), ("norm",), lead, cfg)


FP8_SLOTS = ("qkv", "attn_out", "mlp_in", "mlp_out")  # the GEMMs of a block model.fp8 covers, in state order
# an MoE block's: its dense MLP slots serve the shared experts, then the routed experts' in and out
FP8_MOE_SLOTS = (*FP8_SLOTS, "expert_in", "expert_out")
# attention=mla's projections in place of 'qkv' (q_up is the full q projection when q_lora_rank=0)
FP8_MLA_SLOTS = ("q_down", "q_up", "kv_down", "kv_up")


def fp8_slots(cfg: ModelConfig, moe: bool = False) -> tuple[str, ...]:
    """The GEMMs model.fp8 covers in a block of `cfg` (an MoE block: `moe`), in state order."""
    slots = FP8_MOE_SLOTS if moe else FP8_SLOTS
    return (*FP8_MLA_SLOTS, *slots[1:]) if getattr(cfg, "attention", "gqa") == "mla" else slots


def fp8_slot(cfg: ModelConfig, name: str) -> int:
    """The state index of GEMM `name` (the same in a dense and an MoE block)."""
    return fp8_slots(cfg, moe=True).index(name)


class Fp8State(nnx.Module):
    """A block's fp8 scaling state (`meshrun.parallel.fp8`), float32, created without drawing random
    numbers (the weights are the same with fp8 on or off). delayed: 'hist' [S, T, H] scale exponents
    and 'obs' [S, T, N] (zeros; its gradient is the step's histogram); fp8_first_last_bf16: 'on' (0
    on the model's first and last layer). `last_in_group`: the MoE block of a group of moe_every (`fp8_slots`);
    `first`: a block of the model.first_dense_layers stack."""

    def __init__(self, cfg: ModelConfig, lead: Lead, *, last_in_group: bool = False, first: bool = False):
        shape = tuple(s for s, _ in lead)
        names = tuple(n for _, n in lead)
        param = lambda v: nnx.Param(v, out_sharding=names + (None,) * (v.ndim - len(names)))
        s, t = len(fp8_slots(cfg, last_in_group)), len(fp8.TENSORS)
        if cfg.fp8 == "delayed":
            self.hist = param(jnp.full((*shape, s, t, cfg.fp8_amax_history), fp8.EMPTY, jnp.float32))
            self.obs = param(jnp.zeros((*shape, s, t, fp8.N_BINS), jnp.float32))
        if cfg.fp8_first_last_bf16:
            k = cfg.moe_every if cfg.is_moe else 1
            unit = jnp.arange(shape[0])[(...,) + (None,) * (len(shape) - 1)]
            inner = jnp.arange(shape[1])[None] if len(shape) > 1 else (k - 1 if last_in_group else 0)
            # `first`: the model.first_dense_layers stack, before the units
            layer = unit if first else getattr(cfg, "first_dense_layers", 0) + unit * k + inner
            self.on = param(((layer != 0) & (layer != cfg.n_layers - 1)).astype(jnp.float32))


def fp8_state(p: Mapping, cfg: ModelConfig) -> Mapping | None:
    """A block's fp8 state leaves (None when it has none)."""
    return p.get(fp8.STATE_KEY) if cfg.fp8 != "none" else None


class MLP(nnx.Module):
    """SwiGLU (gate, up, down; Llama) or GELU (up, down; GPT). Column-parallel in, row-parallel out."""

    def __init__(self, cfg: ModelConfig, lead: Lead, *, rngs: nnx.Rngs, d_ff: int | None = None):
        d, f = cfg.d_model, cfg.d_ff if d_ff is None else d_ff
        if cfg.mlp == "swiglu":
            self.gate = normal_param(rngs.params(), (d, f), ("embed", "mlp"), lead, cfg)
        self.up = normal_param(rngs.params(), (d, f), ("embed", "mlp"), lead, cfg)
        self.down = normal_param(rngs.params(), (f, d), ("mlp", "embed"), lead, cfg)


# ---------------------------------------------------------------- pure functions


def rms_norm(x_BxLxD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019) computed in float32, returned in the input dtype."""
    x = x_BxLxD.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return (y * scale_D.astype(jnp.float32)).astype(x_BxLxD.dtype)


def rope_freqs(cfg: ModelConfig, dim: int | None = None) -> jax.Array:
    """Rotary frequencies [Dh/2]: theta^(-2i/Dh) (Dh: `dim`, default cfg.head_dim); with rope_scaling=llama3
    (Llama 3.1) wavelengths above original_max/low_freq_factor are divided by the factor, those below
    original_max/high_freq_factor kept, the band between interpolated (transformers' `_compute_llama3_parameters`)."""
    half = (cfg.head_dim if dim is None else dim) // 2
    freq = cfg.rope_theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if cfg.rope_scaling == "llama3":
        f, lo, hi, n0 = (
            cfg.rope_scaling_factor,
            cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor,
            cfg.rope_original_max_seq_len,
        )
        wavelen = 2 * jnp.pi / freq
        scaled = jnp.where(wavelen > n0 / lo, freq / f, freq)
        smooth = (n0 / wavelen - lo) / (hi - lo)
        medium = (wavelen >= n0 / hi) & (wavelen <= n0 / lo)
        freq = jnp.where(medium, (1 - smooth) * scaled / f + smooth * scaled, scaled)
    elif cfg.rope_scaling == "yarn":
        freq = _yarn(cfg, freq, 2 * half)
    return freq


def _yarn(cfg: ModelConfig, freq: jax.Array, dim: int) -> jax.Array:
    """YaRN (Peng et al. 2023) as transformers' `_compute_yarn_parameters`: the dims that turn fewer than
    beta_slow times in original_max positions divided by the factor, those turning more than beta_fast
    kept, a linear ramp over the (truncated) dims between."""
    n0, base = cfg.rope_original_max_seq_len, cfg.rope_theta
    at = lambda rot: dim * math.log(n0 / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(at(cfg.rope_beta_fast)), 0), min(math.ceil(at(cfg.rope_beta_slow)), dim - 1)
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / ((high + 0.001 * (low == high)) - low), 0, 1)
    keep = 1 - ramp
    return freq / cfg.rope_scaling_factor * (1 - keep) + freq * keep


def yarn_scales(cfg: ModelConfig) -> tuple[float, float]:
    """(factor on RoPE's cos and sin, factor on the softmax scale): YaRN's (LlamaConfig.yarn_scales), else 1s."""
    return cfg.yarn_scales() if getattr(cfg, "rope_scaling", "none") == "yarn" else (1.0, 1.0)


def rope(x_BxLxHxDh: jax.Array, freq: jax.Array, positions_BxL: jax.Array | None = None, scale: float = 1.0):
    """Rotary position embedding (Su et al. 2021), rotate-half layout (Llama/NeoX and Hugging Face's
    checkpoints, whose q/k rows are already permuted for it); `freq` from rope_freqs; positions 0..L-1
    unless `positions_BxL` is given (packed documents: positions restart at each document). `scale`:
    cos and sin are multiplied by it (YaRN's attention factor, `yarn_scales`)."""
    _, length, _, dh = x_BxLxHxDh.shape
    half = dh // 2
    pos = jnp.arange(length)[None] if positions_BxL is None else positions_BxL
    ang_BxLxHalf = pos.astype(jnp.float32)[..., None] * freq
    cos, sin = jnp.cos(ang_BxLxHalf)[:, :, None, :], jnp.sin(ang_BxLxHalf)[:, :, None, :]
    if scale != 1.0:
        cos, sin = cos * jnp.float32(scale), sin * jnp.float32(scale)
    x = x_BxLxHxDh.astype(jnp.float32)
    x1, x2 = x[..., :half], x[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxDh.dtype)


def segment_positions(segment_ids_BxL: jax.Array) -> jax.Array:
    """Position of each token inside its segment (0 at each segment's first token); segments are
    contiguous runs of equal ids."""
    length = segment_ids_BxL.shape[1]
    idx = jnp.arange(length, dtype=jnp.int32)[None]
    first = jnp.concatenate(
        [jnp.ones_like(segment_ids_BxL[:, :1], bool), segment_ids_BxL[:, 1:] != segment_ids_BxL[:, :-1]], axis=1
    )
    start = jax.lax.cummax(jnp.where(first, idx, 0), axis=1)
    return idx - start


def mlp(
    p: Mapping[str, jax.Array], h_BxLxD: jax.Array, cfg: ModelConfig, f8: Mapping | None = None, ring: int = 0
) -> jax.Array:
    """Dense MLP on normed input (full length). Returns the row-parallel output *before* the
    residual-stream constraint, so the caller's constraint decides all-reduce vs reduce-scatter.
    `f8`: the block's fp8 state (`fp8_state`): its GEMMs run in fp8 under cfg.fp8. `ring` = t > 0
    (model.tp_comm_overlap): h comes split over the sequence, the in and out GEMMs run as rings over
    the t tensor shards (`meshrun.parallel.collective_matmul`) and the output comes back split."""
    dt = dtype_of(cfg.dtype)
    recipe = cfg.fp8

    def gemm(spec, x, w, slot):
        if ring:  # fp8 is refused with tp_comm_overlap (the config)
            w_dim = spec.split(",")[1].index("f")
            run = ag_matmul if slot == "mlp_in" else matmul_rs
            return run(spec, x, w.astype(dt), w_dim, ring)
        return fp8.einsum(spec, x, w, recipe, f8, fp8_slot(cfg, slot), block=cfg.fp8_block)

    if cfg.mlp == "swiglu":
        # gate and up in one einsum: one input-gradient all-reduce in backward instead of two.
        w_Dx2xF = jnp.stack([p["gate"], p["up"]], axis=1)
        gu = gemm("bld,dtf->bltf", h_BxLxD, w_Dx2xF if recipe != "none" else w_Dx2xF.astype(dt), "mlp_in")
        gu = checkpoint_name(constrain(gu, ("batch", None, None, "mlp")), "mlp_hidden")
        a_BxLxF = jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1]
    else:
        u = gemm("bld,df->blf", h_BxLxD, p["up"], "mlp_in")
        u = checkpoint_name(constrain(u, ("batch", None, "mlp")), "mlp_hidden")
        a_BxLxF = jax.nn.gelu(u)
    a_BxLxF = checkpoint_name(constrain(a_BxLxF, ("batch", None, "mlp")), "mlp_act")
    return gemm("blf,fd->bld", a_BxLxF, p["down"], "mlp_out")


def embed_lookup(table_VxD: jax.Array, tokens_BxL: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Vocab-parallel embedding (Megatron): the table stays sharded on 'vocab'; XLA's SPMD gather
    partitioner looks up locally with masked indices and all-reduces the b·s·d result."""
    x = jnp.take(table_VxD, tokens_BxL, axis=0, mode="clip").astype(dtype_of(cfg.dtype))
    # Full length first: under sequence parallelism the backward then all-gathers dx (b·s·d) and
    # scatter-adds locally, instead of all-reducing a whole V×D table gradient.
    x = constrain(x, ("batch", None, "embed"))
    return constrain(x, ("batch", "length", "embed"))


def vocab_parallel_xent(
    logits_BxLxV: jax.Array, labels_BxL: jax.Array, vocab_used: int = 0
) -> tuple[jax.Array, jax.Array]:
    """Summed cross-entropy over tokens with label >= 0, and that token count (both float32).

    Logits stay sharded on 'vocab': max, sum-exp and the label logit are reductions over the vocab
    axis, which GSPMD lowers to all-reduces of b·s scalars (Megatron's vocab-parallel loss); the
    label logit is picked with an iota comparison, never a gather of the full row. `vocab_used` > 0:
    the ids from it up are padding (model.vocab_used) and take no part in the softmax (-inf), so a
    padded import has its source model's loss.
    """
    logits = constrain(logits_BxLxV.astype(jnp.float32), ("batch", None, "vocab"))
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
    if 0 < vocab_used < logits.shape[-1]:
        logits = jnp.where(vocab_ids < vocab_used, logits, -jnp.inf)
    m_BxL = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
    lse_BxL = jnp.log(jnp.sum(jnp.exp(logits - m_BxL[..., None]), axis=-1)) + m_BxL
    label_logit_BxL = jnp.sum(jnp.where(vocab_ids == labels_BxL[..., None], logits, 0.0), axis=-1)
    valid = labels_BxL >= 0
    loss_sum = jnp.sum(jnp.where(valid, lse_BxL - label_logit_BxL, 0.0))
    return loss_sum, jnp.sum(valid).astype(jnp.float32)
