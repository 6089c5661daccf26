"""ZB-V (`pipeline.schedule=zb-v`) as the train step runs it: the first step's loss and gradients,
then 3 optimizer steps' losses and updated params equal one device (the references and tolerances of
tests/test_train.py) on data2·pipe2·tensor2 and (slow) pipe4·expert2 MoE; a checkpoint saved by a
zb-v run resumes to the uninterrupted run's losses and params, and onto 1F1B."""

import shutil

import jax
import numpy as np
import pytest
from test_train import (
    SMALL,
    _cfg,
    assert_grads_close,
    assert_same,
    first_grads,
    full_batch_reference,
    reference,
    run_steps,
)
from test_train_cli import SMALL as SMALL_RUN
from test_train_cli import _saved_params, losses

from meshrun.config import load_config
from meshrun.runtime.mesh import build_mesh
from meshrun.train.loop import run
from meshrun.train.plan import build_plan

ZBV = ["pipeline.schedule=zb-v"]
# pipe 4 x expert 2: 2p = 8 chunks need 8 stacked units (a dense and an MoE block each: 16 layers)
P4E2 = ["mesh.pipe=4", "mesh.data=1", "mesh.tensor=1", "model.n_layers=16", "pipeline.microbatches=4"]


@pytest.mark.parametrize(
    "config, over",
    [
        ("tiny_cpu.yaml", []),  # data 2, pipe 2, tensor 2, m = 4
        pytest.param("tiny_moe_cpu.yaml", P4E2, marks=pytest.mark.slow),
    ],
    ids=["p2d2t2", "p4e2-moe"],
)
def test_zb_v_train_step_matches_one_device(config, over):
    cfg = _cfg(config, [*ZBV, *over])
    plan = build_plan(cfg, build_mesh(cfg.mesh, devices=jax.devices()[:8]))  # what the step runs
    assert plan.program.executor == "per_op" and plan.program.slots == 2 * cfg.mesh.pipe and plan.relaid
    # the first step's loss and every gradient (no optimizer: the default eps) against value_and_grad;
    # the step's layer grads are in the V placement (stage s: chunks s and 2p-1-s), compared in model order
    no_eps = [x for x in SMALL if "optimizer.eps" not in x]
    loss, grads, _, (tok, lab) = first_grads(load_config(f"configs/{config}", [*no_eps, *ZBV, *over]))
    grads = {**grads, "layers": plan.split.from_pipeline(grads["layers"])}
    ref_loss, ref_grads, _ = full_batch_reference(cfg, tok, lab)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert_grads_close(grads, ref_grads)
    # 3 optimizer steps: losses and the updated params (model order, as checkpoints hold them)
    model_over = [x for x in over if x.startswith("model.")]
    assert_same(run_steps(cfg), reference(config, model_over))


@pytest.mark.slow  # three zb-v runs and a 1F1B one: ~85 s on 2 loaded cores
def test_zb_v_checkpoint_resumes_to_the_uninterrupted_run(tmp_path):
    """data2·pipe2·tensor2, zb-v (its layers stored in the V placement while it runs): stopped after
    the step-2 checkpoint and rerun, it logs the uninterrupted run's losses and saves its step-3
    params; the same checkpoint continued on 1F1B gives step 3's loss."""
    over = [*SMALL_RUN, *ZBV, "checkpoint.every=2", "train.steps=3"]

    def cfg(name, *more):
        return load_config("configs/tiny_cpu.yaml", [*over, *more, f"train.run_dir={tmp_path / name}"])

    assert run(cfg("full"), quiet=True)["step"] == 3
    assert run(cfg("cut"), quiet=True, stop_after=2)["step"] == 2
    shutil.copytree(tmp_path / "cut", tmp_path / "on_1f1b")
    assert run(cfg("cut"), quiet=True)["step"] == 3
    full, cut = losses(tmp_path / "full"), losses(tmp_path / "cut")
    assert sorted(cut) == sorted(full) == [1, 2, 3]
    for step, loss in cut.items():
        assert loss == pytest.approx(full[step], rel=1e-6), step
    a, b = _saved_params(cfg("full"), tmp_path / "full", 3), _saved_params(cfg("cut"), tmp_path / "cut", 3)
    for (path, x), y in zip(jax.tree.leaves_with_path(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    moved = run(cfg("on_1f1b", "pipeline.schedule=1f1b"), quiet=True)
    assert moved["step"] == 3 and moved["loss"] == pytest.approx(full[3], rel=1e-5)
