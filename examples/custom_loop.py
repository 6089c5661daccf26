"""The custom_model family driven from Python through meshrun's public API, without `meshrun train`:
a mesh, the family's `ModelFns`, a `Pipeline` over data2 x pipe2 x tensor2, and an optax update.

    PYTHONPATH=examples python examples/custom_loop.py

It prints the loss of a few steps on random tokens; `tests/test_custom_model.py` checks its first
loss and gradients against one device.
"""

from __future__ import annotations

from meshrun.runtime.devices import simulate_cpu_devices

simulate_cpu_devices(8)  # on CPU: 8 simulated devices, set before jax is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from custom_model.model import FAMILY, MLPConfig  # noqa: E402

import meshrun  # noqa: E402


def build(cfg: MLPConfig, mesh_cfg: meshrun.MeshConfig, pcfg: meshrun.PipelineConfig, seed: int = 0):
    """(pipeline, params placed for it): the family's parameters (an nnx.State, made plain by meshrun)."""
    mesh = meshrun.build_mesh(mesh_cfg)
    params = FAMILY.init_params(cfg, seed)
    pipe = meshrun.Pipeline(meshrun.pipeline_spec(FAMILY.model_fns(cfg), pcfg, mesh, params))
    return pipe, pipe.place(params)


def batch(cfg: MLPConfig, step: int, rows: int = 16, seq: int = 32):
    """Random tokens; labels are the next token (the last one ignored: -1)."""
    tok = jax.random.randint(jax.random.key(step), (rows, seq), 0, cfg.vocab)
    return tok, jnp.concatenate([tok[:, 1:], jnp.full((rows, 1), -1, tok.dtype)], axis=1)


def train(steps: int = 5) -> list[float]:
    cfg = MLPConfig(d_model=64, n_layers=4, d_ff=256, max_seq_len=32)
    mesh_cfg = meshrun.MeshConfig(data=2, pipe=2, tensor=2)
    pipe, params = build(cfg, mesh_cfg, meshrun.PipelineConfig(schedule="1f1b", microbatches=4))
    opt = optax.adamw(3e-3)
    state = opt.init(params)

    @jax.jit
    def update(params, state, grads):
        upd, state = opt.update(grads, state, params)
        return optax.apply_updates(params, upd), state

    losses = []
    for step in range(steps):
        loss, grads, _ = pipe(params, *batch(cfg, step))
        params, state = update(params, state, grads)
        losses.append(float(loss))
        print(f"step {step + 1}  loss {float(loss):.4f}")
    return losses


if __name__ == "__main__":
    train()
