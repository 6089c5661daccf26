"""Memory levers: optimizer-state host offload, activation offload, remat every k layers.

Each lever changes no number (3 steps against the one-device reference of test_train, rtol 1e-5)
and moves what it says it moves, read off the compiled step. Few compiles: one pipelined and one
data-parallel train step (two levers each), one baseline compile, and small one-device grads.
"""

import dataclasses
import json
import re
from types import SimpleNamespace

import jax
import meshrun_models as models
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from meshrun_models.layers import SAVED_NAMES, arrays
from meshrun_models.llama.config import LlamaConfig
from test_train import DP4, _cfg, _compiled, assert_same, reference

from meshrun.analysis import hlo
from meshrun.analysis.memory import host_layout_bytes, memory_spaces
from meshrun.cli.main import main
from meshrun.data.datasets import global_batch_arrays, make_dataset
from meshrun.errors import ConfigError
from meshrun.parallel.sharding import DP_AXES
from meshrun.report import explain
from meshrun.runtime.mesh import build_mesh
from meshrun.train.plan import check_host_memory
from meshrun.train.step import make_train_step

WHOLE_SHARD = ["offload.optimizer=true", "offload.update=whole"]  # the state in pinned host memory


def _train(cfg, steps=3):
    """3 steps through one compiled executable; (losses, final state, compiled)."""
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:8])
    train_step = make_train_step(cfg, mesh)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    batches = [global_batch_arrays(ds, i, mesh, P(DP_AXES)) for i in range(steps)]
    compiled = train_step.step.lower(train_step.abstract_state, *batches[0]).compile()
    state, losses = train_step.init(), []
    for tok, lab in batches:
        state, metrics = compiled(state, tok, lab)
        losses.append(float(metrics["loss"]))
    return np.array(losses), state, compiled


def _moments(state):
    return [x for x in jax.tree.leaves(state.opt_state) if x.ndim]  # Adam mu, nu (not the step count)


def test_offload_optimizer_and_activations_pipelined_match_one_device():
    """pipe2 x data2 x tensor2, 1F1B, ZeRO-1: moments rest in pinned host memory (each rank its own
    shard); remat=offload stores the pipeline's residual slots in host memory."""
    cfg = _cfg("tiny_cpu.yaml", ["train.zero=1", *WHOLE_SHARD, "model.remat=offload"])
    losses, state, compiled = _train(cfg)
    assert_same((losses, jax.device_get(state.params)), reference("tiny_cpu.yaml"))
    assert {x.sharding.memory_kind for x in _moments(state)} == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"device"}
    # the step's host arguments are exactly the moments' local ZeRO-1 shards
    shard_bytes = sum(x.addressable_shards[0].data.nbytes for x in _moments(state))
    assert host_layout_bytes(compiled.as_text())["argument"] == shard_bytes


def test_offload_optimizer_and_remat_every_data_parallel_match_one_device():
    """data4 x tensor2, ZeRO-3, remat_every=2: same numbers; device argument bytes fall by the
    optimizer state, which now sits in host memory (memory_analysis + the entry layout's S(5)), against
    the same layout and remat without the offload."""
    over = [*DP4, "train.zero=3"]
    cfg = _cfg("tiny_cpu.yaml", [*over, *WHOLE_SHARD, "model.remat=full", "model.remat_every=2"])
    losses, state, compiled = _train(cfg)
    assert_same((losses, jax.device_get(state.params)), reference("tiny_cpu.yaml"))
    assert {x.sharding.memory_kind for x in _moments(state)} == {"pinned_host"}
    opt_bytes = sum(x.addressable_shards[0].data.nbytes for x in _moments(state))
    on = memory_spaces(compiled)
    off = memory_spaces(_compiled([*over, "model.remat=full", "model.remat_every=2"])[0])
    assert off["host"] == 0 and on["host"] == opt_bytes  # arguments and outputs alias (donated)
    assert off["device_argument"] - on["device_argument"] >= opt_bytes
    assert off["device"] - on["device"] >= opt_bytes
    # the step model (meshrun explain's prediction) puts the same bytes in host memory
    pred = explain.predict(cfg, {"pipe": 1, "data": 4, "expert": 1, "tensor": 2})["memory"]
    assert pred["host"] == pytest.approx(on["host"], rel=0.02)  # as test_explain predicts arguments


def _grads_compiled(cfg, params, tok, fwd_only=False):
    loss = lambda p: models.loss_fn(p, tok, tok, cfg)[0]
    fn = jax.jit(loss if fwd_only else jax.value_and_grad(loss))
    compiled = fn.lower(params).compile()
    return compiled, (None if fwd_only else compiled(params))


def test_remat_every_k_keeps_one_input_per_group():
    """8 layers, one device: k = 1, 2, 4 groups give none's gradients; the
    stacked saved layer inputs [8/k, b, s, d] fall as 1/k, temp stays below none's, and the matmul
    FLOPs stay within one recomputed forward (full remat's budget). XLA drops each layer's last
    matmul from full remat's recompute (the next input is saved); a group must recompute its first
    k-1 outputs, so grouped FLOPs sit between full's and none + one forward."""
    base = LlamaConfig(d_model=32, n_layers=8, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64, vocab=64, max_seq_len=16)
    params = arrays(models.init_params(base, 0)[1])
    tok = jax.random.randint(jax.random.key(0), (4, 16), 0, 64)
    runs = {}
    for name, kw in [("none", {}), ("k1", dict(remat="full")), ("k2", dict(remat="full", remat_every=2)),
                     ("k4", dict(remat="full", remat_every=4))]:  # fmt: skip
        runs[name] = _grads_compiled(dataclasses.replace(base, **kw), params, tok)
    fwd, _ = _grads_compiled(base, params, tok, fwd_only=True)
    ref_loss, ref_grads = runs["none"][1]
    for name in ("k1", "k2", "k4"):
        loss, grads = runs[name][1]
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7, err_msg=name)

    def saved_inputs(c):  # leading sizes of stacked [n, b, s, d] f32 buffers: n = layer inputs kept
        return max(int(n) for n in re.findall(r"f32\[(\d+),4,16,32\]", c.as_text()))

    temp = {k: c.memory_analysis().temp_size_in_bytes for k, (c, _) in runs.items()}
    flops = {k: hlo.dot_flops_per_step(c.as_text()) for k, (c, _) in runs.items()}
    assert [saved_inputs(runs[k][0]) for k in ("k1", "k2", "k4")] == [8, 4, 2]
    assert max(temp["k1"], temp["k2"], temp["k4"]) < temp["none"]
    # remat=offload (its numbers: the pipelined test): the traced backward moves exactly selective's
    # names to host and back; XLA:CPU then drops the transfers (meshrun/analysis/memory.py)
    cfg = dataclasses.replace(base, remat="offload")
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: models.loss_fn(p, tok, tok, cfg)[0]))(params))
    assert len(re.findall(r":f32<host>\[[\d,]+\] = device_put", jaxpr)) == len(SAVED_NAMES)
    one_forward = hlo.dot_flops_per_step(fwd.as_text())
    for k in ("k2", "k4"):
        assert flops["k1"] <= flops[k] <= flops["none"] + one_forward, (k, flops)


def test_bad_memory_levers_exit_2(capsys):
    # 4 layers over pipe=2: each stage chunk holds 2 layers, so 4 does not divide it
    assert main(["train", "configs/tiny_cpu.yaml", "model.remat=full", "model.remat_every=4"]) == 2
    err = capsys.readouterr().err
    assert "model.remat_every" in err and "each pipeline chunk holds 2" in err and "Traceback" not in err
    assert main(["train", "configs/tiny_cpu.yaml", "model.remat_every=2"]) == 2
    assert "set model.remat=full" in capsys.readouterr().err
    no_host = SimpleNamespace(platform="metal", addressable_memories=lambda: [SimpleNamespace(kind="device")])
    with pytest.raises(ConfigError, match=r"offload.optimizer: this platform has no pinned_host memory"):
        check_host_memory(no_host, "offload.optimizer")


def test_planner_proposes_offload_when_nothing_fits(capsys):
    """GPT-3 175B at 16K tokens without context parallelism on 32 A100-80GB fits on no layout; with
    Adam state in host memory it does (the update's peak included), and each proposal says why (host
    bytes, host-link traffic and its time, the device bytes without)."""
    argv = ["--global-batch", "16", "--seq-len", "16384", "--max-context", "1", "--json"]
    assert main(["plan", "--model", "gpt3-175b", "--cluster", "a100-80g:4x8", *argv]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["configs"]
    for c in rep["configs"]:
        why = [v for v in c["violations"] if v.startswith("offload optimizer")]
        assert why and "GB/step over the host link" in why[0] and "> 80.0 GB usable" in why[0], c["violations"]
        assert c["memory_gb"] <= 80.0
