"""Train step: parity with one device across layouts and ZeRO stages, HLO audit, memory, loop."""

import functools
import json
import math

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshrun.analysis import hlo
from meshrun.config import load_config
from meshrun.data.datasets import global_batch_arrays, make_dataset
from meshrun.parallel.sharding import DP_AXES, batch_spec
from meshrun.runtime.mesh import build_mesh
from meshrun.train.step import make_train_step

# optimizer.eps=1e-4 in the multi-step parity tests: gradients agree across layouts to a few ulp of the
# largest partial sum (measured: <= 2e-8 absolute against max |g| = 0.05, see test_gradients_match),
# but Adam's update g/(sqrt(v)+eps) has sensitivity 1/eps for small g, so with the default 1e-8 that
# ulp-level reduction-order noise in near-zero gradients becomes a 1e-5 parameter difference after a
# few steps. That is the optimizer's conditioning, not the layout; the gradient test uses no optimizer.
SMALL = [
    "train.seq_len=16",
    "model.max_seq_len=16",
    "data.kind=synthetic",
    "train.global_batch=16",
    "optimizer.lr=0.01",
    "optimizer.warmup_steps=1",
    "optimizer.eps=1e-4",
]
ONE_DEVICE = ["mesh.data=1", "mesh.pipe=1", "mesh.tensor=1", "mesh.expert=1"]


def _cfg(config, over):
    return load_config(f"configs/{config}", [*SMALL, *over])


def run_state(cfg, n_devices=8, steps=3):
    """`steps` steps of `cfg` on the first `n_devices` devices: (losses, the train state in model order)."""
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:n_devices])
    train_step = make_train_step(cfg, mesh)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    state, losses = train_step.init(), []
    for i in range(steps):
        tok, lab = global_batch_arrays(ds, i, mesh, batch_spec(mesh, tokens=False))
        state, metrics = train_step.step(state, tok, lab)
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(train_step.to_model(state))  # model order, as checkpoints


def run_steps(cfg, n_devices=8, steps=3):
    losses, state = run_state(cfg, n_devices, steps)
    return losses, state.params


def assert_resume_gives_the_same_losses(tmp_path, config: str, over: list[str]) -> None:
    """A run of `config` + `over` (checkpoint.every=2, train.steps=4) stopped after step 3 and resumed
    logs the losses of an uninterrupted run (step 3 again, then 4)."""
    from meshrun.train.loop import run

    run(load_config(config, [*over, f"train.run_dir={tmp_path / 'a'}"]), quiet=True)
    part = load_config(config, [*over, f"train.run_dir={tmp_path / 'b'}"])
    run(part, quiet=True, stop_after=3)
    run(part, quiet=True)
    rows = lambda d: [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["loss"] for r in rows("a")}
    resumed = rows("b")
    assert [r["step"] for r in resumed] == [1, 2, 3, 3, 4]
    for r in resumed:
        assert r["loss"] == pytest.approx(by_step[r["step"]], rel=1e-6)


_REF = {}


def reference(config, over=()):
    key = (config, tuple(over))
    if key not in _REF:
        _REF[key] = run_steps(_cfg(config, [*over, *ONE_DEVICE]), n_devices=1)
    return _REF[key]


def assert_same(got, ref):
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    flat_got, flat_ref = jax.tree.leaves_with_path(got[1]), jax.tree.leaves(ref[1])
    assert jax.tree.structure(got[1]) == jax.tree.structure(ref[1])
    for (path, g), r in zip(flat_got, flat_ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stages_match_one_device_pipe_data_tensor(zero):
    """3 optimizer steps on (data2, pipe2, tensor2) equal one device: losses and updated params.
    ZeRO-3 runs an uneven split (3 + 1 layers): layers and Adam moments stored padded to 3 per stage
    and sharded over 'pipe' and 'data', compared in model order (`to_model`, what checkpoints hold)."""
    split = ["pipeline.layers_per_stage=[3,1]"] if zero == 3 else []
    got = run_steps(_cfg("tiny_cpu.yaml", [f"train.zero={zero}", *split]))
    assert_same(got, reference("tiny_cpu.yaml"))


def test_interleaved_training_matches_one_device():
    """Interleaved 1F1B (p2, v2) trains with the layers stored in pipeline order; params are compared
    after converting back to model order."""
    cfg = _cfg("tiny_cpu.yaml", ["pipeline.schedule=interleaved", "pipeline.virtual=2"])
    mesh = build_mesh(cfg.mesh)
    train_step = make_train_step(cfg, mesh)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    state, losses = train_step.init(), []
    for i in range(3):
        tok, lab = global_batch_arrays(ds, i, mesh, P(DP_AXES))
        state, metrics = train_step.step(state, tok, lab)
        losses.append(float(metrics["loss"]))
    assert_same((np.array(losses), jax.device_get(train_step.to_model(state).params)), reference("tiny_cpu.yaml"))


@pytest.mark.parametrize("zero", [0, 3])
def test_zero_stages_match_one_device_data_tensor(zero):
    got = run_steps(_cfg("tiny_cpu.yaml", ["mesh.pipe=1", "mesh.data=4", f"train.zero={zero}"]))
    assert_same(got, reference("tiny_cpu.yaml"))


def test_moe_data_expert_tensor_matches_one_device():
    got = run_steps(_cfg("tiny_moe_cpu.yaml", []))
    assert_same(got, reference("tiny_moe_cpu.yaml"))


def first_grads(cfg):
    """(loss, grads, metrics) of the step's own loss-and-grads on the first batch, and that batch."""
    sizes = [getattr(cfg.mesh, a) for a in ("data", "pipe", "expert", "tensor")]
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[: 8 if -1 in sizes else math.prod(sizes)])
    train_step = make_train_step(cfg, mesh)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    tok, lab = global_batch_arrays(ds, 0, mesh, P(DP_AXES))
    loss, grads, metrics = jax.jit(train_step.loss_and_grads)(train_step.init().params, tok, lab)
    return float(loss), jax.device_get(grads), jax.device_get(metrics), (np.asarray(tok), np.asarray(lab))


def full_batch_reference(cfg, tok, lab):
    """Plain `jax.value_and_grad` of the model's loss on the whole batch, one device, no microbatches."""
    import meshrun_models as mm

    params = jax.device_put(mm.layers.arrays(mm.init_params(cfg.model, cfg.train.seed)[1]), jax.devices()[0])
    (loss, metrics), grads = jax.jit(jax.value_and_grad(lambda p: mm.loss_fn(p, tok, lab, cfg.model), has_aux=True))(
        params
    )
    return float(loss), jax.device_get(grads), jax.device_get(metrics)


def assert_grads_close(grads, ref):
    """Every gradient leaf equals the reference's (same tree), fp32 rtol 1e-5 with an absolute floor
    of 1e-6 of the leaf's largest reference value."""
    assert jax.tree.structure(grads) == jax.tree.structure(ref)
    for (path, g), r in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref), strict=True):
        scale = float(np.abs(r).max())
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6 * scale, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize(
    "config, over",
    [
        ("tiny_cpu.yaml", [*ONE_DEVICE, "pipeline.microbatches=4"]),
        ("tiny_cpu.yaml", ["mesh.pipe=1", "mesh.data=4", "train.zero=2"]),
        ("tiny_cpu.yaml", ["mesh.pipe=1", "mesh.data=2", "mesh.tensor=2", "pipeline.microbatches=2"]),
        pytest.param("tiny_cpu.yaml", ["train.zero=3"], marks=pytest.mark.slow),  # ZeRO-3 parity: test_zero_stages_*
        ("tiny_moe_cpu.yaml", []),
        pytest.param("tiny_moe_cpu.yaml", [*ONE_DEVICE, "pipeline.microbatches=2"], marks=pytest.mark.slow),
    ],
)
def test_gradients_match_full_batch_value_and_grad(config, over):
    """Loss, metrics and every gradient of the step's accumulation (microbatch scan or pipeline, any
    layout) equal a plain full-batch `jax.value_and_grad` of the model loss on one device."""
    base = [x for x in SMALL if "optimizer.eps" not in x]
    cfg = load_config(f"configs/{config}", [*base, *over])
    loss, grads, metrics, (tok, lab) = first_grads(cfg)
    ref_loss, ref, ref_metrics = full_batch_reference(cfg, tok, lab)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert set(metrics) == set(ref_metrics)
    for k in ref_metrics:
        np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert_grads_close(grads, ref)


@pytest.mark.parametrize("config", ["tiny_cpu.yaml", pytest.param("tiny_moe_cpu.yaml", marks=pytest.mark.slow)])
def test_metric_keys_do_not_depend_on_the_layout(config):
    """The scan path (pipe=1) and the pipeline log the same metrics: the model's `finish`."""
    base = [x for x in SMALL if "optimizer.eps" not in x]
    keys = {}
    for name, over in {"pipe1": ["mesh.pipe=1", "mesh.data=-1"], "pipe2": ["mesh.pipe=2", "mesh.data=-1"]}.items():
        cfg = load_config(f"configs/{config}", [*base, *over, "mesh.expert=1", "mesh.tensor=2"])
        keys[name] = set(first_grads(cfg)[2])
    moe = {"moe_aux_loss", "moe_z_loss", "dropped_tokens"} if "moe" in config else set()
    assert keys["pipe1"] == keys["pipe2"] == {"ce_loss", "n_tokens"} | moe


def _compiled(over, config="tiny_cpu.yaml"):
    """(compiled step, mesh), compiled once per session for each (overrides, config)."""
    return _compiled_once(tuple(over), config)


@functools.cache
def _compiled_once(over, config):
    cfg = _cfg(config, list(over))
    mesh = build_mesh(cfg.mesh)
    train_step = make_train_step(cfg, mesh)
    state = train_step.abstract_run
    shape = (cfg.train.global_batch, cfg.train.seq_len)
    batch = jax.ShapeDtypeStruct(shape, np.int32, sharding=train_step.batch_sharding)
    return train_step.step.lower(state, batch, batch).compile(), mesh


DP4 = ["mesh.pipe=1", "mesh.data=4", "pipeline.microbatches=4", "train.global_batch=16"]


def _audit(zero):
    compiled, mesh = _compiled([*DP4, f"train.zero={zero}"])
    return hlo.collectives(compiled.as_text(), dict(mesh.shape))


def _bytes(colls, op, axes=("data",)):
    return sum(c.bytes for c in colls if c.op == op and c.axes == axes)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_no_data_parallel_collective_inside_accumulation_loop(zero):
    """4 accumulation microbatches on (data4, tensor2): the loop holds only tensor all-reduces; the
    DP gradient reduction runs once after it: an all-reduce (ZeRO-0) or reduce-scatters of the
    local tensor shards + all-gathers of the updated params (ZeRO-1/2/3), never both."""
    colls = _audit(zero)
    assert [c for c in colls if c.in_loop and "data" in c.axes] == []
    assert {c.axes for c in colls if c.in_loop} == {("tensor",)}
    assert [c for c in colls if c.op == "all-gather" and "tensor" in c.axes] == []  # shards stay local
    grads_allreduce = _bytes(_audit(0), "all-reduce")
    if zero == 0:
        assert _bytes(colls, "reduce-scatter") == 0 and _bytes(colls, "all-gather") == 0
    else:
        dp = 4
        scattered, rest = _bytes(colls, "reduce-scatter"), _bytes(colls, "all-reduce")
        # the same gradient bytes, now reduce-scattered (each rank receives 1/dp); only the norm
        # scales (not divisible) and the scalar metrics are still all-reduced
        assert scattered * dp + rest == pytest.approx(grads_allreduce, rel=0.01)
        assert rest < 0.01 * grads_allreduce
        assert _bytes(colls, "all-gather") == scattered * dp  # updated (ZeRO-1) / gathered (ZeRO-3) params


def test_zero3_parameter_memory_is_one_over_dp():
    z0, _ = _compiled([*DP4, "train.zero=0"])
    z3, _ = _compiled([*DP4, "train.zero=3"])
    a0, a3 = z0.memory_analysis().argument_size_in_bytes, z3.memory_analysis().argument_size_in_bytes
    # params + Adam m, v: every matrix is split 4 ways; only norm scales (0.3% of bytes) stay whole
    assert 0.25 <= a3 / a0 < 0.27, (a0, a3)


def test_loop_resumes_and_loss_falls(tmp_path):
    """The loop saves, a second call resumes from the newest checkpoint and sees the same batches."""
    from meshrun.train.loop import run

    over = [*SMALL, "mesh.pipe=1", "mesh.data=4", "checkpoint.every=2", "checkpoint.async_save=false"]
    full = run(
        load_config("configs/tiny_cpu.yaml", [*over, "train.steps=4", f"train.run_dir={tmp_path / 'a'}"]), quiet=True
    )
    part = load_config("configs/tiny_cpu.yaml", [*over, "train.steps=4", f"train.run_dir={tmp_path / 'b'}"])
    first = run(part, quiet=True, stop_after=3)  # stops after step 3; checkpoint at step 2
    assert first["step"] == 3
    second = run(part, quiet=True)
    assert second["step"] == 4
    lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    resumed = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["loss"] for r in lines}
    assert [r["step"] for r in resumed] == [1, 2, 3, 3, 4]
    for r in resumed:
        assert r["loss"] == pytest.approx(by_step[r["step"]], rel=1e-6)
    assert full["loss"] < full["first_loss"]


def test_pipelined_zero3_gathers_and_scatters_local_tensor_shards_once():
    """(data2, pipe2, tensor2), ZeRO-3: weights are all-gathered over 'data' once before the tick
    loop and gradients reduce-scattered once after it, each on the local tensor shard: no tensor
    all-gather anywhere and no data-parallel collective in the loop."""
    compiled, mesh = _compiled(["train.zero=3"])
    colls = hlo.collectives(compiled.as_text(), dict(mesh.shape))
    assert [c for c in colls if c.in_loop and "data" in c.axes] == []
    assert [c for c in colls if c.op == "all-gather" and "tensor" in c.axes] == []
    gathered, scattered = _bytes(colls, "all-gather"), _bytes(colls, "reduce-scatter")
    assert gathered > 0 and scattered * 2 == gathered  # dp=2: each rank receives half of what it gathers
