"""A residual-MLP language model as a meshrun family, using only meshrun's public API.

Each block mixes the current token with the previous one (a causal shift), then applies a pre-norm
GELU MLP: x <- x + W_out·gelu(W_in·norm(x + shift(x))). Parameters are Flax NNX `Param`s that carry
logical axis names only ('vocab', 'embed', 'mlp', stacked 'layers'); meshrun maps them to the mesh
(tensor parallelism, ZeRO, the pipeline), turns off NNX eager sharding while they are created, and
accepts the `nnx.State` that `init_params` returns.

Shape letters: B batch, L length, D d_model, F d_ff, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

import meshrun
from meshrun import ConfigError, ModelConfig


@dataclass(frozen=True)
class MLPConfig(ModelConfig):
    """The shared model keys (vocab, d_model, n_layers, d_ff, dtypes, init_std, norm_eps) plus one of
    its own. The planner's transformer formulas do not describe this layer: `predictable = False`.
    It has no attention, so it fixes the head fields as class constants: model.n_heads is then a key
    it does not have (refused), not one that is checked and ignored."""

    family: str = "custom_model.model:FAMILY"
    shift: float = 0.5  # weight of the previous token's stream mixed into each block's input

    n_heads: ClassVar[int] = 0
    n_kv_heads: ClassVar[int] = 0
    head_dim: ClassVar[int] = 0

    predictable = False  # ClassVar of ModelConfig: the start-up block skips the memory prediction
    summary = ("vocab", "d_model", "n_layers", "d_ff", "dtype")  # `meshrun checkpoints` shows these, then `shift`

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.shift <= 1.0:
            raise ConfigError("model.shift", self.shift, "use a weight in [0, 1]")


class MLPLM(nnx.Module):
    def __init__(self, cfg: MLPConfig, rngs: nnx.Rngs):
        V, D, F, L = cfg.vocab, cfg.d_model, cfg.d_ff, cfg.n_layers
        dt = jnp.dtype(cfg.param_dtype)
        normal = lambda shape: cfg.init_std * jax.random.normal(rngs.params(), shape, dt)
        self.embed = nnx.Param(normal((V, D)), out_sharding=("vocab", "embed"))
        self.layers = nnx.Dict(
            scale=nnx.Param(jnp.ones((L, D), dt), out_sharding=("layers", "norm")),
            w_in=nnx.Param(normal((L, D, F)), out_sharding=("layers", "embed", "mlp")),
            w_out=nnx.Param(normal((L, F, D)) / L**0.5, out_sharding=("layers", "mlp", "embed")),
        )
        self.head = nnx.Param(normal((D, V)), out_sharding=("embed", "vocab"))


def init_params(cfg: MLPConfig, seed: int) -> nnx.State:
    return nnx.state(MLPLM(cfg, nnx.Rngs(seed)), nnx.Param)


def abstract_params(cfg: MLPConfig) -> nnx.State:
    return nnx.state(nnx.eval_shape(lambda: MLPLM(cfg, nnx.Rngs(0))), nnx.Param)


def _rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def model_fns(cfg: MLPConfig) -> meshrun.ModelFns:
    dt = jnp.dtype(cfg.dtype)

    def embed(params, tokens_BxL):
        return jnp.take(params["embed"], tokens_BxL, axis=0).astype(dt)

    def apply_layers(layer_params, x_BxLxD):
        def block(x, p):
            prev = jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]  # the previous token's stream (causal)
            h = _rms_norm(x + cfg.shift * prev, p["scale"], cfg.norm_eps)
            return x + jax.nn.gelu(h @ p["w_in"].astype(dt)) @ p["w_out"].astype(dt), None

        x, _ = jax.lax.scan(block, x_BxLxD, layer_params)  # any contiguous slice of the stacked layers
        return x, {}

    def head_loss(params, x_BxLxD, labels_BxL):
        logits = (x_BxLxD @ params["head"].astype(dt)).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        keep = labels_BxL >= 0
        nll = -jnp.take_along_axis(logp, jnp.maximum(labels_BxL, 0)[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(keep, nll, 0.0)), jnp.sum(keep).astype(jnp.float32)

    names = meshrun.state_names(abstract_params(cfg))
    return meshrun.ModelFns(embed=embed, apply_layers=apply_layers, head_loss=head_loss, param_names=names)


def check_mesh(cfg: MLPConfig, mesh_shape) -> None:
    t = mesh_shape.get("tensor", 1)
    for field in ("vocab", "d_model", "d_ff"):
        if getattr(cfg, field) % t:
            raise ConfigError(f"model.{field}", getattr(cfg, field), f"use a multiple of mesh.tensor={t}")


def flops_per_token(cfg: MLPConfig, seq_len: int) -> float:
    """Training FLOPs per token (what MFU counts): 2 per weight of each matmul (the blocks' w_in and
    w_out, the head) in the forward, x3 with the backward; the embedding is a lookup."""
    return 3 * 2 * (cfg.n_layers * 2 * cfg.d_model * cfg.d_ff + cfg.d_model * cfg.vocab)


FAMILY = meshrun.Family(
    name="custom_mlp",
    config=MLPConfig,
    model_fns=model_fns,
    init_params=init_params,
    abstract_params=abstract_params,
    check_mesh=check_mesh,
    flops_per_token=flops_per_token,
)
