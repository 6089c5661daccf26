"""FP8 GEMMs (`model.fp8`; Micikevicius et al. 2022): e4m3 activations and weights forward, e5m2
gradients backward, per-tensor power-of-two scales, float32 accumulation.

`tensorwise` scales each operand by its current amax / the format's max; `delayed` by the largest
amax of the last `model.fp8_amax_history` steps, kept as power-of-two exponents. Exact across
layouts: the tensorwise amax is `pmax`ed over the manual row axes (`row_axes()`: data, expert,
context; 'tensor' is GSPMD's); delayed scaling records each step's exponent as a one-hot gradient
of a zero parameter (`obs`), so the gradient sums over microbatches, ticks and ranks keep exactly
the bins some shard saw and the largest one is the max whatever the split.

Use: `einsum(spec, x, w, recipe, state, slot)` for `jnp.einsum` (`ragged_dot` for the grouped matmul) on a
covered GEMM (`state`: the layer's `fp8` subtree, `slot` the GEMM's index); after the gradient reduction,
`update_state(params, grads)` rotates the observations into the history and zeroes their gradients.
Shape letters: S GEMM slots of a layer, T = 3 tensors per GEMM (x, w, dy), H history, N bins.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from meshrun.config import FP8_RECIPES as RECIPES
from meshrun.errors import ConfigError
from meshrun.parallel import fp8_block
from meshrun.parallel.layer_fetch import to_device
from meshrun.parallel.sharding import CONTEXT, DP_AXES, current_rules

__all__ = ["RECIPES", "einsum", "ragged_dot", "update_state"]
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
K_LO, K_HI = -120, 120  # scale exponents kept (2^k stays a normal float32 and so do k_x + k_w products)
N_BINS = K_HI - K_LO + 1
EMPTY = float(K_LO - 8)  # a history entry with no observation (below every real exponent)
TENSORS = ("x", "w", "dy")
ROW_AXES = (*DP_AXES, CONTEXT)  # manual axes that split an activation's rows or tokens
STATE_KEY = "fp8"  # params subtree holding a layer's scaling state


def pow2(k: jax.Array) -> jax.Array:
    """2^k in float32, exactly (built from the exponent bits), for integer k in [-126, 127]."""
    return jax.lax.bitcast_convert_type(((k.astype(jnp.int32) + 127) << 23).astype(jnp.int32), jnp.float32)


def scale_exponent(amax: jax.Array, dtype) -> jax.Array:
    """Smallest k with amax / 2^k <= max(dtype), clipped to [K_LO, K_HI]; 0 when amax is 0 or not finite."""
    mf, ef = math.frexp(float(jnp.finfo(dtype).max))  # e4m3: 448 = 0.875 * 2^9
    m, e = jnp.frexp(amax.astype(jnp.float32))  # amax = m * 2^e, m in [0.5, 1)
    k = e - ef + (m > mf).astype(jnp.int32)
    ok = (amax > 0) & jnp.isfinite(amax)
    return jnp.where(ok, jnp.clip(k, K_LO, K_HI), 0).astype(jnp.int32)


def current_scale(amax: jax.Array, dtype) -> jax.Array:
    """Tensorwise scale amax / max(dtype) (Transformer Engine's current scaling); 1 when amax is 0 or
    not finite."""
    ok = (amax > 0) & jnp.isfinite(amax)
    return jnp.where(ok, amax / float(jnp.finfo(dtype).max), 1.0).astype(jnp.float32)


def quantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """x / scale saturated to the format's range, rounded to `dtype` (nearest even)."""
    fmax = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    return (q.astype(jnp.float32) * scale).astype(dtype)


def _amax(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    a = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return jax.lax.pmax(a, axes) if axes else a


def _observed(amax: jax.Array, dtype) -> jax.Array:
    """One-hot [N] of amax's scale exponent; zeros when there is nothing to record."""
    ok = (amax > 0) & jnp.isfinite(amax)
    return jax.nn.one_hot(scale_exponent(amax, dtype) - K_LO, N_BINS, dtype=jnp.float32) * ok


class _How(NamedTuple):
    recipe: str
    rows: tuple[str, ...]  # manual axes to pmax activation amaxes over (tensorwise)
    x_dtype: Any
    w_dtype: Any
    w_rows: tuple[str, ...] = ()  # manual axes that split the weight (experts: 'expert'), pmax'ed too


RAGGED = "ragged"  # the op of `ragged_dot` (else an einsum spec)
_RAGGED_W = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)


def _gemms(op: str, sizes):
    """(forward, input gradient, weight gradient) of `op` on fp8 operands, float32 results."""
    f32 = jnp.float32
    if op == RAGGED:  # x [R, K] rows grouped by `sizes`, w [E, K, N]
        return (
            lambda x, w: jax.lax.ragged_dot(x, w, sizes, preferred_element_type=f32),
            lambda dy, w: jax.lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), sizes, preferred_element_type=f32),
            lambda x, dy: jax.lax.ragged_dot_general(x, dy, sizes, _RAGGED_W, preferred_element_type=f32),
        )
    xs, rest = op.split(",")
    ws, ys = rest.split("->")
    return (
        lambda x, w: jnp.einsum(op, x, w, preferred_element_type=f32),
        lambda dy, w: jnp.einsum(f"{ys},{ws}->{xs}", dy, w, preferred_element_type=f32),
        lambda x, dy: jnp.einsum(f"{xs},{ys}->{ws}", x, dy, preferred_element_type=f32),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dot(op: str, how: _How, x, w, sizes, scale_T, sink_TxN):
    return _fwd(op, how, x, w, sizes, scale_T, sink_TxN)[0]


def _scale(amax_local, dtype, how: _How, stored):
    """(scale, the amax to record). tensorwise: amax over the row axes / max(dtype); delayed: the
    history's scale, or while it is empty (`stored` 0) the current amax's power of two."""
    amax = jax.lax.pmax(amax_local, how.rows) if how.rows else amax_local
    if how.recipe == "tensorwise":
        return current_scale(amax, dtype), None
    return jnp.where(stored > 0, stored, pow2(scale_exponent(amax, dtype))), _observed(amax_local, dtype)


def _fwd(op, how, x, w, sizes, scale_T, sink_TxN):
    del sink_TxN
    (sx, ox), (sw, ow) = (
        _scale(_amax(x, ()), E4M3, how, scale_T[0]),
        _scale(_amax(w, ()), E4M3, how._replace(rows=how.w_rows), scale_T[1]),
    )
    qx, qw = quantize(x, sx, E4M3), quantize(w, sw, E4M3)
    y = _gemms(op, sizes)[0](qx, qw)
    y = (y * (sx * sw)).astype(how.x_dtype)
    return y, (qx, qw, sizes, sx, sw, scale_T[2], None if ox is None else (ox, ow))


def _bwd(op, how, res, dy):
    qx, qw, sizes, sx, sw, sdy, obs = res
    sdy, ody = _scale(_amax(dy, ()), E5M2, how, sdy)
    qdy = quantize(dy, sdy, E5M2)
    _, dgrad, wgrad = _gemms(op, sizes)
    dx = (dgrad(qdy, qw) * (sdy * sw)).astype(how.x_dtype)
    dw = (wgrad(qx, qdy) * (sx * sdy)).astype(how.w_dtype)
    sink = jnp.zeros((len(TENSORS), N_BINS), jnp.float32) if obs is None else jnp.stack([*obs, ody])
    return dx, dw, None, jnp.zeros((len(TENSORS),), jnp.float32), sink


_dot.defvjp(_fwd, _bwd)


MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell


def check_platform(recipe: str, device: Any) -> None:
    """ConfigError unless `device` runs fp8 GEMMs: a GPU of compute capability >= 8.9 (as jax reports
    it), or the CPU, where XLA emulates them (float32 math on f8 values: for numerics, not speed)."""
    if recipe == "none" or device.platform == "cpu":
        return
    cap = str(getattr(device, "compute_capability", "") or "")
    have = tuple(int(p) for p in cap.split(".")[:2] if p.isdigit()) if device.platform == "gpu" else ()
    if len(have) < 2 or have < MIN_CAPABILITY:
        what = f"{device.platform} {getattr(device, 'device_kind', '')}".strip()
        raise ConfigError(
            "model.fp8",
            recipe,
            "use model.fp8=none here; fp8 GEMMs need a GPU of compute capability >= 8.9 (H100, H200, L40S)",
            f"{what} (compute capability {cap or 'n/a'}) has no fp8 GEMMs",
        )


def row_axes() -> tuple[str, ...]:
    """The manual axes of the enclosing shard_map (`use_rules(manual=)`) that split activation rows."""
    mesh, _, manual = current_rules()
    if mesh is None:
        return ()
    return tuple(a for a in ROW_AXES if a in manual and mesh.shape.get(a, 1) > 1)


def history_scales(hist_TxH: jax.Array) -> jax.Array:
    """Delayed scaling's scales [T] for one GEMM: 2^(the largest exponent in the history); 0 while it
    is empty: the first step scales by the current amax (Transformer Engine and Flax start from scale
    1, which flushes most gradients to zero in e5m2)."""
    k = jnp.max(jax.lax.stop_gradient(hist_TxH), axis=-1)
    return jnp.where(k <= EMPTY, 0.0, pow2(jnp.maximum(k, K_LO)))


def einsum(
    spec: str, x: jax.Array, w: jax.Array, recipe: str, state: Mapping | None = None, slot: int = 0, *,
    split_w: bool = False, block: int = 128,
):  # fmt: skip
    """`jnp.einsum(spec, x, w)` in x's dtype, through fp8 under `recipe` (two operands, every index of
    one appearing in the other or the output). `state`: this layer's {'hist' [S, T, H], 'obs' [S, T, N]
    (delayed), 'on' [] (1: fp8; 0: the layer stays in the compute dtype)}. `split_w`: w is split over
    the manual row axes too (the experts over 'expert'), so its amax is reduced like x's. `block`:
    blockwise's tile size (`fp8_block`)."""
    plain = lambda x, w: jnp.einsum(spec, x, w.astype(x.dtype))
    if recipe == "blockwise":
        return _on(state, lambda x, w: fp8_block.einsum(spec, block, x, w), plain, x, w)
    return _gemm(spec, plain, x, w, None, recipe, state, slot, split_w)


def ragged_dot(
    x_RxK: jax.Array, w_ExKxN: jax.Array, sizes_E: jax.Array, recipe: str, state: Mapping | None = None,
    slot: int = 0, *, block: int = 128, interleaved: int = 1,
):  # fmt: skip
    """`jax.lax.ragged_dot(x, w, sizes)` (rows grouped by expert, the dropless experts' grouped matmul)
    in x's dtype, through fp8 under `recipe` as `einsum`: tensorwise and delayed with one scale for all
    experts' weights, reduced over the axes that split them; blockwise per row tile and per expert's
    weight block (`fp8_block.ragged_dot`; `interleaved` matrices along N, each blocked on its own)."""
    plain = lambda x, w: jax.lax.ragged_dot(x, w.astype(x.dtype), sizes_E)
    if recipe == "blockwise":
        blocked = lambda x, w: fp8_block.ragged_dot(block, interleaved, x, w, sizes_E)
        return _on(state, blocked, plain, x_RxK, w_ExKxN)
    return _gemm(RAGGED, plain, x_RxK, w_ExKxN, sizes_E, recipe, state, slot, True)


def _gemm(op, plain, x, w, sizes, recipe, state, slot, split_w):
    if recipe == "none":
        return plain(x, w)
    rows = row_axes()  # pmax'ed for tensorwise and delayed's first step
    how = _How(recipe, rows, x.dtype, w.dtype, rows if split_w else ())
    if recipe == "delayed":
        scale_T, sink = history_scales(state["hist"][slot]), state["obs"][slot]
    else:
        scale_T, sink = jnp.ones((len(TENSORS),), jnp.float32), jnp.zeros((len(TENSORS), N_BINS), jnp.float32)
    return _on(state, lambda x, w: _dot(op, how, x, w, sizes, scale_T, sink), plain, x, w)


def _on(state, fp8, plain, x, w):
    """fp8(x, w), or plain(x, w) in a layer that fp8_first_last_bf16 keeps in the compute dtype."""
    if state is not None and "on" in state:
        return jax.lax.cond(state["on"] > 0, fp8, plain, x, w)
    return fp8(x, w)


# ---------------------------------------------------------------- the delayed recipe's state


def decode(obs_N: jax.Array) -> jax.Array:
    """Histogram of observed exponents [..., N] -> the largest observed exponent [...] (EMPTY if none)."""
    idx = jnp.arange(N_BINS, dtype=jnp.float32)
    top = jnp.max(jnp.where(obs_N > 0, idx, -1.0), axis=-1)
    return jnp.where(top >= 0, top + K_LO, EMPTY)


def rotate(hist_H: jax.Array, new: jax.Array) -> jax.Array:
    """Newest entry first, the oldest dropped (Transformer Engine's amax_history roll)."""
    return jnp.concatenate([new[..., None].astype(hist_H.dtype), hist_H[..., :-1]], axis=-1)


def update_state(params: Any, grads: Any) -> tuple[Any, Any]:
    """After the step's gradient reduction: every `fp8` subtree's history takes this step's observed
    exponents (decoded from the `obs` gradient) and its gradients are zeroed, so clipping, the logged
    norm and Adam never see them. Returns (params with the new fp8 state, grads)."""
    if not isinstance(params, Mapping):
        return params, grads
    new_p, new_g = dict(params), dict(grads)
    for key, sub in params.items():
        if key == STATE_KEY and isinstance(sub, Mapping):
            state = dict(sub)  # 'obs' stays zero: only its gradient carries the observations
            if "hist" in state:  # offload.params: both may rest in host memory
                state["hist"] = rotate(to_device(sub["hist"]), decode(to_device(grads[key]["obs"])))
            new_p[key], new_g[key] = state, jax.tree.map(jnp.zeros_like, grads[key])
        else:
            new_p[key], new_g[key] = update_state(sub, grads[key])
    return new_p, new_g


def with_state(params: Any, src: Any) -> Any:
    """`params` with every `fp8` subtree taken from `src` (the optimizer's update of them discarded)."""
    if not isinstance(params, Mapping):
        return params
    return {k: src[k] if k == STATE_KEY else with_state(v, src[k]) for k, v in params.items()}


def has_state(params: Any) -> bool:
    """Whether the params carry fp8 state (a `fp8` subtree anywhere)."""
    if not isinstance(params, Mapping):
        return False
    return any(k == STATE_KEY or has_state(v) for k, v in params.items())
