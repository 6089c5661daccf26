"""GPT-2 (Radford et al. 2019) on the shared building blocks: pre-LN blocks with LayerNorm (with bias),
learned absolute position embeddings, multi-head attention without RoPE, a GELU MLP (tanh
approximation, Hugging Face's `gelu_new`), biases on every projection, tied embeddings, final LayerNorm.

Params (logical names only, every 'layers' leaf stacked on a leading 'layers' axis)::

    embed {embedding [V,D] ('vocab','embed')}      pos {embedding [max_seq_len,D] (None,'embed')}
    layers {ln_1 {scale, bias}, attn {q, k, v [D,H,Dh], q_bias, k_bias, v_bias [H,Dh], o [H,Dh,D], o_bias [D]},
            ln_2 {scale, bias}, mlp {up [D,F], up_bias [F], down [F,D], down_bias [D]}}
    final_norm {scale, bias}                        (no head: the output projection is embed^T)

D-sized vectors are ('norm',): never sharded, as the llama norm scales. Positions are added in
`embed`, which sees no segment ids, so packed documents are not supported (`segments=False`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from meshrun_models.attention import attention
from meshrun_models.layers import Lead, arrays, dtype_of, embed_lookup, normal_param, ones_param, vocab_parallel_xent
from meshrun_models.layers import zeros_param as zeros
from meshrun_models.transformer import FULL, RESID, grouped_remat, remat_unit

from meshrun.config import ModelConfig
from meshrun.errors import ConfigError
from meshrun.parallel.sharding import constrain


class LayerNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, lead: Lead = ()):
        self.scale = ones_param((cfg.d_model,), ("norm",), lead, cfg)
        self.bias = zeros((cfg.d_model,), ("norm",), lead, cfg)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, lead: Lead, *, rngs: nnx.Rngs):
        d, h, dh = cfg.d_model, cfg.n_heads, cfg.head_dim
        for n in ("q", "k", "v"):
            heads = "heads" if n == "q" else "kv_heads"
            setattr(self, n, normal_param(rngs.params(), (d, h, dh), ("embed", heads, "head_dim"), lead, cfg))
            setattr(self, f"{n}_bias", zeros((h, dh), (heads, "head_dim"), lead, cfg))
        self.o = normal_param(rngs.params(), (h, dh, d), ("heads", "head_dim", "embed"), lead, cfg)
        self.o_bias = zeros((d,), ("norm",), lead, cfg)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, lead: Lead, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        self.up = normal_param(rngs.params(), (d, f), ("embed", "mlp"), lead, cfg)
        self.up_bias = zeros((f,), ("mlp",), lead, cfg)
        self.down = normal_param(rngs.params(), (f, d), ("mlp", "embed"), lead, cfg)
        self.down_bias = zeros((d,), ("norm",), lead, cfg)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, lead: Lead, *, rngs: nnx.Rngs):
        self.ln_1 = LayerNorm(cfg, lead)
        self.attn = Attention(cfg, lead, rngs=rngs)
        self.ln_2 = LayerNorm(cfg, lead)
        self.mlp = MLP(cfg, lead, rngs=rngs)


class Table(nnx.Module):
    def __init__(self, rows: int, names, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.embedding = normal_param(rngs.params(), (rows, cfg.d_model), names, (), cfg)


class GPT2(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.embed = Table(cfg.vocab, ("vocab", "embed"), cfg, rngs=rngs)
        self.pos = Table(cfg.max_seq_len, (None, "embed"), cfg, rngs=rngs)
        self.layers = Block(cfg, ((cfg.n_layers, "layers"),), rngs=rngs)
        self.final_norm = LayerNorm(cfg)


def init_params(cfg: ModelConfig, rng_seed: int) -> nnx.State:
    """nnx.State of nnx.Param; values depend only on (cfg, rng_seed)."""
    return nnx.split(GPT2(cfg, rngs=nnx.Rngs(rng_seed)), nnx.Param)[1]


def abstract_params(cfg: ModelConfig) -> nnx.State:
    return nnx.state(nnx.eval_shape(lambda: GPT2(cfg, rngs=nnx.Rngs(0))), nnx.Param)


def layer_norm(x_BxLxD: jax.Array, p: Mapping[str, jax.Array], eps: float) -> jax.Array:
    """LayerNorm (Ba et al. 2016) in float32, returned in the input dtype."""
    x = x_BxLxD.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x_BxLxD.dtype)


def embed(params: Any, tokens_BxL: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Token (vocab-parallel) plus learned position embeddings, positions 0..L-1."""
    p = arrays(params)
    x = embed_lookup(p["embed"]["embedding"], tokens_BxL, cfg)
    pos_LxD = p["pos"]["embedding"][: tokens_BxL.shape[1]].astype(dtype_of(cfg.dtype))
    return constrain(x + pos_LxD[None], RESID)


def _mlp(p: Mapping[str, jax.Array], h_BxLxD: jax.Array, cfg: ModelConfig) -> jax.Array:
    dt = dtype_of(cfg.dtype)
    u = jnp.einsum("bld,df->blf", h_BxLxD, p["up"].astype(dt)) + p["up_bias"].astype(dt)
    u = checkpoint_name(constrain(u, ("batch", None, "mlp")), "mlp_hidden")
    a = checkpoint_name(constrain(jax.nn.gelu(u, approximate=True), ("batch", None, "mlp")), "mlp_act")
    return jnp.einsum("blf,fd->bld", a, p["down"].astype(dt))


def _block(p: Mapping, x_BxLxD: jax.Array, segments, cfg: ModelConfig):
    dt = dtype_of(cfg.dtype)
    h = constrain(checkpoint_name(layer_norm(x_BxLxD, p["ln_1"], cfg.norm_eps), "attn_in"), FULL)
    a = attention(p["attn"], h, cfg, segments, rotary=False, bias=True)
    x = x_BxLxD + constrain(a, RESID) + p["attn"]["o_bias"].astype(dt)
    x = checkpoint_name(x, "resid_mid")
    h = constrain(checkpoint_name(layer_norm(x, p["ln_2"], cfg.norm_eps), "mlp_in"), FULL)
    y = constrain(_mlp(p["mlp"], h, cfg), RESID) + p["mlp"]["down_bias"].astype(dt)
    return constrain(x + y, RESID), {}


def apply_layers(layer_params: Any, x_BxLxD: jax.Array, cfg: ModelConfig):
    """Run any contiguous slice of the stacked blocks; aux is empty (no auxiliary losses)."""
    p = arrays(layer_params)
    k = cfg.remat_every
    block = functools.partial(_block, cfg=cfg)
    if k > 1:
        n = jax.tree.leaves(p)[0].shape[0]
        if n % k:
            raise ConfigError(
                "model.remat_every", k, f"use a divisor of the {n} stacked units each call runs", "does not divide"
            )
        unit = grouped_remat(block, k)
        p = jax.tree.map(lambda a: a.reshape(n // k, k, *a.shape[1:]), p)
    else:
        unit = remat_unit(block, cfg.remat)
    x = constrain(x_BxLxD, RESID)

    def step(x, p_unit):
        return unit(p_unit, x, None)[0], None

    x, _ = jax.lax.scan(step, x, p)
    return x, {}


def logits(params: Any, x_BxLxD: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final LayerNorm, then the tied output projection; logits stay sharded on 'vocab'."""
    p = arrays(params)
    h = constrain(layer_norm(x_BxLxD, p["final_norm"], cfg.norm_eps), FULL)
    out = jnp.einsum("bld,vd->blv", h, p["embed"]["embedding"].astype(dtype_of(cfg.dtype)))
    return constrain(out, ("batch", None, "vocab"))


def head_loss(params: Any, x_BxLxD: jax.Array, labels_BxL: jax.Array, cfg: ModelConfig):
    return vocab_parallel_xent(logits(params, x_BxLxD, cfg), labels_BxL, cfg.vocab_used)
