"""Mixed precision with bf16 params: Adam runs on a float32 master copy held in the optimizer state,
sharded with the moments (ZeRO >= 1: 12 bytes per parameter / data-parallel degree), and the params
are the master rounded once."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from meshrun.config import load_config
from meshrun.data.datasets import global_batch_arrays, make_dataset
from meshrun.optim.optimizer import MasterState, apply_optimizer, make_optimizer, with_master_weights
from meshrun.parallel.sharding import DP_AXES
from meshrun.runtime.mesh import build_mesh
from meshrun.train.step import make_train_step

OVER = ["model.param_dtype=bfloat16", "model.dtype=bfloat16", "mesh.pipe=1", "mesh.data=4", "mesh.tensor=2"]


def test_master_weights_update_in_float32_and_round_once():
    """The wrapper's update on float32 master copies equals the plain optimizer on float32 params,
    and the bf16 params are exactly the rounded master (no bf16 Adam state, no rounded update)."""
    params = {"w": jnp.linspace(-1, 1, 64, dtype=jnp.float32).reshape(8, 8).astype(jnp.bfloat16)}
    grads = {"w": jnp.full((8, 8), 1e-3, jnp.bfloat16)}
    inner = optax.adamw(1e-3)
    tx = with_master_weights(inner)
    state = tx.init(params)
    assert isinstance(state, MasterState) and state.master["w"].dtype == jnp.float32
    new, state = apply_optimizer(tx, grads, state, params)
    ref_updates, _ = inner.update(
        {"w": grads["w"].astype(jnp.float32)}, inner.init(state.master), {"w": params["w"].astype(jnp.float32)}
    )
    expect = params["w"].astype(jnp.float32) + ref_updates["w"]
    np.testing.assert_array_equal(np.asarray(state.master["w"]), np.asarray(expect))
    np.testing.assert_array_equal(np.asarray(new["w"]), np.asarray(expect.astype(jnp.bfloat16)))
    assert new["w"].dtype == jnp.bfloat16


def test_float32_params_keep_the_plain_optimizer():
    cfg = load_config("configs/tiny_cpu.yaml", [])
    assert not isinstance(make_optimizer(cfg).init({"w": jnp.zeros(2)}), MasterState)


@pytest.mark.parametrize("zero", [1])
def test_master_and_moments_sharded_over_data(zero):
    """data4 x tensor2, ZeRO-1, bf16 params: master, m and v are float32 and split over data and
    tensor (norm scales excepted: replicated by design); the step's arguments are 2/t + 12/(d t)
    bytes per parameter up to the norm scales; two steps train and the params stay the rounded master."""
    cfg = load_config("configs/tiny_cpu.yaml", [*OVER, f"train.zero={zero}"])
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:8])
    ts = make_train_step(cfg, mesh)
    state = ts.init()
    master = state.opt_state.master
    assert {x.dtype for x in jax.tree.leaves(master)} == {jnp.dtype(jnp.float32)}
    n = sum(x.size for x in jax.tree.leaves(state.params))
    unsplit = [x for x in jax.tree.leaves(master) if x.addressable_shards[0].data.size == x.size]
    assert sum(x.size for x in unsplit) < 0.01 * n and all(x.ndim <= 2 for x in unsplit)  # norm scales
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    batches = [global_batch_arrays(ds, i, mesh, P(DP_AXES)) for i in range(2)]
    compiled = ts.step.lower(ts.abstract_run, *batches[0]).compile()
    per_param = compiled.memory_analysis().argument_size_in_bytes / n
    assert per_param == pytest.approx(2 / 2 + 12 / 8, rel=0.05)
    losses = []
    for b in batches:
        state, metrics = ts.step(state, *b)
        losses.append(float(metrics["loss"]))
    assert all(np.isfinite(losses))
    same = jax.tree.map(lambda m, p: bool(jnp.all(m.astype(p.dtype) == p)), state.opt_state.master, state.params)
    assert all(jax.tree.leaves(same))
