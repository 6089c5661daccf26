"""offload.params: ZeRO-3 parameters rest in pinned host memory, are fetched layer by layer
inside the layer scan, each layer's reduced gradient goes back to host memory as the backward
makes it, and the update streams the layers through the device one at a time.

XLA:CPU emits no transfers between memory kinds, so the tests check what the CPU can show: the
same numbers as the run without the switch (losses and params after 3 steps, rtol 1e-5); the
transfers of the program lowered for a GPU (no GPU needed), counted per loop iteration; the memory
kind of the step's arguments; and the compiled step's device argument bytes.
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_train import _cfg, assert_same, reference, run_steps

from meshrun.analysis import hlo, placement
from meshrun.analysis.memory import memory_spaces
from meshrun.cli.main import main
from meshrun.config import offload_params_refusals
from meshrun.data.datasets import global_batch_arrays, make_dataset
from meshrun.parallel.sharding import DP_AXES
from meshrun.runtime.mesh import build_mesh
from meshrun.train.evaluate import make_eval_step
from meshrun.train.step import make_train_step

DP4_TP2 = ["mesh.pipe=1", "mesh.data=4", "mesh.tensor=2", "pipeline.microbatches=4", "train.zero=3"]
DP8_M1 = ["mesh.pipe=1", "mesh.data=8", "mesh.tensor=1", "pipeline.microbatches=1", "train.zero=3"]
PIPE = ["train.zero=3"]  # tiny_cpu: data 2 x pipe 2 x tensor 2, 1F1B over 4 microbatches
ON = ["offload.params=true"]
LEAVES = 9  # parameter leaves of one tiny_cpu layer: q, k, v, o, gate, up, down, two norm scales


def _same_as_without(over, config="tiny_cpu.yaml"):
    off = run_steps(_cfg(config, over))
    on = run_steps(_cfg(config, [*over, *ON]))
    assert_same(on, off)


@pytest.mark.slow
def test_offload_params_matches_without_data_tensor():
    """data 4 x tensor 2, 4 microbatches: the layers' float32 sums rest in host memory; with the
    optimizer state in host memory too (offload.optimizer=host)."""
    _same_as_without([*DP4_TP2, "offload.optimizer=host"])


def test_offload_params_matches_without_pipeline():
    """data 2 x pipe 2 x tensor 2, 1F1B: the tick loop's layer sums rest in host memory too."""
    _same_as_without(PIPE)


def test_offload_params_matches_without_data_one_microbatch():
    """data 8, one microbatch: each layer's reduced gradient is the step's, straight to host memory."""
    _same_as_without(DP8_M1)


@pytest.mark.parametrize(
    "over", [PIPE, pytest.param(DP4_TP2, marks=pytest.mark.slow)], ids=["pipe-1f1b", "data4-tensor2-m4"]
)
def test_offload_params_matches_one_device(over):
    """The embedding's, head's and final norm's gradient goes every microbatch to 1/DP float32 sums on
    the device (in the tick loop: from the first and last stage's vjps) beside the layers' host sums:
    losses and params after 3 steps equal one device."""
    assert_same(run_steps(_cfg("tiny_cpu.yaml", [*over, *ON])), reference("tiny_cpu.yaml"))


def test_embedding_and_head_reduce_scattered_every_microbatch():
    """data 4 x tensor 2, 4 microbatches: the embedding's and head's gradients are reduce-scattered to
    1/DP shards inside the microbatch loop, once per microbatch (not from whole sums after it)."""
    ts, traced = _step([*DP4_TP2, *ON])
    cfg, mesh = ts.plan.cfg, ts.plan.zero.mesh
    colls = hlo.collectives(traced.lower().compile().as_text(), dict(mesh.shape))
    edge = 4 * cfg.model.vocab * cfg.model.d_model // (cfg.mesh.tensor * cfg.mesh.data)  # a shard's bytes
    edges = [c for c in colls if c.op == "reduce-scatter" and c.bytes == edge]
    assert len(edges) == 2 and all(c.in_loop and c.per_step == cfg.pipeline.microbatches for c in edges), edges


@pytest.mark.slow
def test_offload_params_matches_without_expert():
    """data 2 x expert 2 x tensor 2, MoE every other layer: the MoE unit, which keeps everything for
    its backward at remat=none, is checkpointed around the fetched weights (fetched again)."""
    _same_as_without(["train.zero=3"], "tiny_moe_cpu.yaml")


@pytest.mark.slow
def test_offload_params_matches_without_context():
    """data 2 x context 2 x tensor 2."""
    _same_as_without(["mesh.pipe=1", "mesh.data=2", "mesh.context=2", "pipeline.microbatches=2", "train.zero=3"])


def test_offload_params_carries_the_fp8_histories():
    """data 8, delayed fp8: the amax histories, resting in host memory with the layers, take each step's
    observations on the device after the streamed step's reduction; the same numbers, histories
    included, as the step without the switch (the gather-once ZeRO-3 step)."""
    _same_as_without([*DP8_M1, "model.fp8=delayed"])


@pytest.mark.slow
def test_offload_params_carries_the_fp8_histories_through_the_pipeline():
    """data 2 x pipe 2 x tensor 2, 1F1B, delayed fp8: the histories' zero gradient (the loss does not
    differentiate them) goes into the host sums beside the fetched layers' reduced ones."""
    _same_as_without([*PIPE, "model.fp8=delayed"])


@pytest.mark.slow
def test_offload_params_carries_the_moe_balance_bias():
    """tiny_deepseek_cpu (data 2 x expert 2 x tensor 2, balance: bias, 2 microbatches): each MoE layer's
    bias, resting in host memory, moves by the step's loads as without the switch."""
    _same_as_without(["train.zero=3"], "tiny_deepseek_cpu.yaml")


def test_evaluation_matches_without():
    """The forward-only evaluation step fetches the layers the same way (data 4 x tensor 2)."""
    got = []
    for over in (DP4_TP2, [*DP4_TP2, *ON]):
        cfg = _cfg("tiny_cpu.yaml", over)
        mesh = build_mesh(cfg.mesh)
        ts = make_train_step(cfg, mesh)
        ds = make_dataset(
            cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch
        )
        got.append(
            jax.device_get(make_eval_step(ts, mesh)(ts.init().params, *global_batch_arrays(ds, 0, mesh, P(DP_AXES))))
        )
    np.testing.assert_allclose(got[1], got[0], rtol=1e-6)


def _step(over):
    cfg = _cfg("tiny_cpu.yaml", over)
    ts = make_train_step(cfg, build_mesh(cfg.mesh))
    shape = (cfg.train.global_batch, cfg.train.seq_len)
    batch = jax.ShapeDtypeStruct(shape, np.int32, sharding=ts.batch_sharding)
    return ts, ts.step.trace(ts.abstract_run, batch, batch)


def _param_kinds(ts, text):
    """Memory kinds of the step's parameter arguments (the state's first leaves) in the lowered program."""
    n = len(jax.tree.leaves(ts.abstract_run.params))
    return set(placement.argument_kinds(text)[:n])


def test_transfers_are_inside_the_layer_loops_one_per_layer_and_direction():
    """Lowered for a GPU: the parameters enter in pinned host memory and every transfer of a
    layer's leaves runs inside a loop over the layers, once per leaf and iteration:
    - forward: each leaf to the device;
    - backward: each leaf to the device again (the gathered weights are recomputed, not kept), each
      reduced gradient to host memory; with 4 microbatches also each float32 sum and gradient to the
      device and the sum back;
    - the update's norm: each gradient to the device; the update: gradient and param (and with
      offload.optimizer=host Adam's m and v) to the device, the new param (m, v) back;
    - the gradient sums' zeros (the carry of the microbatch loop) made on the device and moved to
      host memory a layer at a time.
    No loop moves anything without the switch."""
    n = LEAVES
    one = {"device": n, "pinned_host": n}
    cases = [
        ([*DP8_M1, *ON], one, {"device": 2 * n, "pinned_host": n}),
        ([*DP4_TP2, *ON, "offload.optimizer=host"], {"device": 3 * n, "pinned_host": 2 * n},
         {"device": 4 * n, "pinned_host": 3 * n}),
    ]  # fmt: skip
    for over, backward, update in cases:
        ts, traced = _step(over)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        moving = sorted(sorted(loop.transfers.items()) for loop in placement.loops(text) if loop.transfers)
        expected = [{"device": n}, backward, {"device": n}, update, {"pinned_host": n}]  # ..., norm, update, zeros
        assert moving == sorted(sorted(t.items()) for t in expected), over
        assert _param_kinds(ts, text) == {"pinned_host"}
        assert {s.memory_kind for s in jax.tree.leaves(ts.state_shardings.params)} == {"pinned_host"}
    ts, traced = _step(DP8_M1)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert not any(loop.transfers for loop in placement.loops(text))
    assert "pinned_host" not in _param_kinds(ts, text)


def test_device_argument_bytes_fall_by_the_parameters():
    """XLA:CPU counts host buffers in memory_analysis' device fields; the entry layout's S(5) splits
    them off (`memory_spaces`): the step's device arguments fall by exactly the parameters' local
    ZeRO-3 shard, which now sits in host memory."""
    ts_on, on = _step([*DP4_TP2, *ON])
    _, off = _step(DP4_TP2)
    on, off = memory_spaces(on.lower().compile()), memory_spaces(off.lower().compile())
    shard = sum(
        int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
        for a, s in zip(
            jax.tree.leaves(ts_on.abstract_run.params), jax.tree.leaves(ts_on.state_shardings.params), strict=True
        )
    )
    assert off["host"] == 0 and on["host"] == shard  # arguments and outputs alias (donated)
    assert off["device_argument"] - on["device_argument"] == shard


def test_offload_params_needs_zero_3(capsys):
    assert main(["train", "configs/tiny_cpu.yaml", "offload.params=true", "train.zero=1"]) == 2
    err = capsys.readouterr().err
    assert "offload.params" in err and "set train.zero=3" in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_offload_params_rules():
    """The config, the step's plan and the planner ask the same pure function: it accepts the nvme tier
    and pipelines (bf16 params too: test_zero3_layer.py) and fp8, and refuses ZeRO below 3 and fp8 with the
    gradient file."""
    assert offload_params_refusals(3, "nvme", fp8="none", pipe=1) == []
    assert offload_params_refusals(3, "none", fp8="none", pipe=2) == offload_params_refusals(3, "none") == []
    assert offload_params_refusals(3, "none", fp8="delayed", pipe=1) == []
    assert offload_params_refusals(1, "none")
    assert offload_params_refusals(3, "nvme", fp8="tensorwise", pipe=1, offload_grads="nvme", microbatches=1)


BF16 = ["model.param_dtype=bfloat16", "model.dtype=bfloat16"]


def _grads_and_one_step(over, step: bool = True):
    """(loss, float32 gradient, state after one step in model order, or None without `step`) of tiny_cpu
    with `over`."""
    cfg = _cfg("tiny_cpu.yaml", over)
    mesh = build_mesh(cfg.mesh)
    ts = make_train_step(cfg, mesh)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    batch = global_batch_arrays(ds, 0, mesh, P(DP_AXES))
    state = ts.init()
    loss, grads, _ = jax.device_get(jax.jit(ts.loss_and_grads)(state.params, *batch))
    if not step:
        return loss, grads, None
    state, _ = ts.step(state, *batch)
    return loss, grads, jax.device_get(ts.to_model(state))


@pytest.mark.parametrize(
    "over", [pytest.param(DP4_TP2, marks=pytest.mark.slow), DP8_M1], ids=["data4-tensor2-m4", "data8-m1"]
)
def test_bf16_params_reduce_the_fetched_gradient_in_float32(over):
    """bf16 params with a float32 master: each fetched layer's gradient is reduced in float32 (the
    backward sends it to float32 arrays beside the bf16 shards, `layer_fetch.Shadowed`), so the
    gradient equals the run without the switch's float32 sums (rtol 1e-5; the sums are added in
    another order: per microbatch after the reduction instead of before it; with one microbatch
    the same numbers bit for bit) where a bf16 reduced gradient would be 2^-9 off. After one step
    the float32 master and Adam's moments follow at rtol 1e-5 and the params are the rounded
    master. Further steps are not compared: a last-bit difference of the master flips the bf16
    rounding of a few params, and the runs then part by bf16 steps, with or without the switch."""
    off = _grads_and_one_step([*BF16, *over])
    on = _grads_and_one_step([*BF16, *over, *ON])
    assert on[0] == off[0]
    assert_bf16_step_follows(on, off, exact="pipeline.microbatches=1" in over)


def assert_bf16_step_follows(on, off, exact: bool = False) -> None:
    """`_grads_and_one_step` of two bf16-param runs: float32 gradients at rtol 1e-5 (bit for bit when
    `exact`), the master and Adam's moments at rtol 1e-5, and the params the rounded master."""
    assert_float32_grads_follow(on, off, exact)
    state, ref = on[2], off[2]
    for (path, a), b in zip(jax.tree.leaves_with_path(state.opt_state), jax.tree.leaves(ref.opt_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    rounded = jax.tree.map(lambda m, p: np.asarray(m).astype(p.dtype), state.opt_state.master, state.params)
    jax.tree.map(np.testing.assert_array_equal, state.params, rounded)


def assert_float32_grads_follow(on, off, exact: bool = False) -> None:
    """The float32 gradients of two `_grads_and_one_step` runs at rtol 1e-5 (bit for bit when `exact`)."""
    for (path, g), r in zip(jax.tree.leaves_with_path(on[1]), jax.tree.leaves(off[1]), strict=True):
        assert g.dtype == r.dtype == np.float32, path
        if exact:
            np.testing.assert_array_equal(g, r, err_msg=jax.tree_util.keystr(path))
        np.testing.assert_allclose(
            g, r, rtol=1e-5, atol=1e-6 * float(np.abs(r).max()), err_msg=jax.tree_util.keystr(path)
        )


def test_offload_params_refuses_overlap_grad_reduce(capsys):
    """offload_params reduces each layer's gradients inside its layer loop, so the pipeline's early-chunk
    reduction has nothing to move: the step's plan and the planner refuse the pair through the same rule."""
    over = ["offload.params=true", "train.zero=3", "pipeline.schedule=zb-v", "pipeline.microbatches=4",
            "pipeline.overlap_grad_reduce=true", "train.run_dir=runs/t-op-overlap"]  # fmt: skip
    assert main(["train", "configs/tiny_cpu.yaml", *over]) == 2  # tiny_cpu: mesh.pipe=2
    err = capsys.readouterr().err
    assert "offload.params" in err and "pipeline.overlap_grad_reduce=false" in err and "Traceback" not in err
    assert err.count("\n") == 1
    assert offload_params_refusals(3, "none", fp8="none", pipe=2, overlap_grad_reduce=True)
    assert not offload_params_refusals(3, "none", fp8="none", pipe=2)
