"""Context parallelism in the train step: every layout with a `context` axis computes one device's
numbers (losses and updated params after 3 steps), for both kinds; packed documents, sliding
windows, MoE routing, evaluation and checkpoints across meshes; the collectives it adds; bad input.

The kernels themselves (ring and all-gather attention against the one-device core, c = 2..8,
sequences up to 512) are tested in test_context_attention.py."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from test_train import _cfg, assert_same, reference, run_steps

from meshrun.analysis import hlo
from meshrun.cli.main import main
from meshrun.config import load_config
from meshrun.parallel.context import chunk_ids, lay_out, zigzag_index
from meshrun.runtime.mesh import build_mesh
from meshrun.train.step import make_train_step

ROOT = Path(__file__).resolve().parents[1]
NO_PIPE = ["mesh.pipe=1"]


def test_zigzag_layout_is_a_permutation_with_balanced_causal_work():
    idx = zigzag_index(32, 4)
    assert sorted(idx.tolist()) == list(range(32))
    shards = idx.reshape(4, 8)
    assert shards[0].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]  # chunks 0 and 7
    # causal work (keys visible to the shard's queries) is equal on every shard
    work = [int(np.sum(s + 1)) for s in shards]
    assert len(set(work)) == 1
    assert chunk_ids(4, True).tolist() == [[0, 7], [1, 6], [2, 5], [3, 4]]
    tok = np.arange(64).reshape(2, 32)
    laid = lay_out((tok, tok + 100), 4, zigzag=True)
    assert np.array_equal(np.asarray(laid[0])[:, np.argsort(idx)], tok)
    assert lay_out((tok,), 4, zigzag=False)[0] is tok


LAYOUTS = {
    "context2-tensor2-data2-zero1": [*NO_PIPE, "mesh.data=2", "mesh.tensor=2", "mesh.context=2", "train.zero=1"],
    "context2-pipe2-tensor2-1f1b": ["mesh.pipe=2", "mesh.data=1", "mesh.tensor=2", "mesh.context=2"],
    "context8": [*NO_PIPE, "mesh.data=1", "mesh.tensor=1", "mesh.context=8"],
}
SLOW_LAYOUTS = {
    "context2-tensor2-data2-zero3-sp": [*NO_PIPE, "mesh.data=2", "mesh.tensor=2", "mesh.context=2", "train.zero=3",
                                       "model.sequence_parallel=true"],
    "context2-pipe2-tensor2-zbh1": ["mesh.pipe=2", "mesh.data=1", "mesh.tensor=2", "mesh.context=2",
                                    "pipeline.schedule=zb-h1"],
    "context2-pipe2-tensor2-interleaved": ["mesh.pipe=2", "mesh.data=1", "mesh.tensor=2", "mesh.context=2",
                                           "pipeline.schedule=interleaved", "pipeline.virtual=2"],
    "context4-data2-selective": [*NO_PIPE, "mesh.data=2", "mesh.tensor=1", "mesh.context=4", "model.remat=selective"],
}  # fmt: skip
# Model settings the one-device reference must share (everything else is layout).
SAME_MODEL = ("model.sequence_parallel", "model.remat", "model.sliding_window", "model.moe_dispatch",
              "model.capacity_factor")  # fmt: skip


def _model_over(over):
    return [o for o in over if o.split("=")[0] in SAME_MODEL and o != "model.sequence_parallel=true"]


def _check(config, over, kind):
    got = run_steps(_cfg(config, [*over, f"model.context_parallel={kind}"]))
    assert_same(got, reference(config, _model_over(over)))


SLOW = pytest.mark.slow  # the default suite keeps one kind per layout beyond the first


@pytest.mark.parametrize(
    "layout, kind",
    [
        ("context2-tensor2-data2-zero1", "allgather"),
        ("context2-tensor2-data2-zero1", "ring"),
        ("context2-pipe2-tensor2-1f1b", "ring"),
        pytest.param("context2-pipe2-tensor2-1f1b", "allgather", marks=SLOW),
        ("context8", "allgather"),
        pytest.param("context8", "ring", marks=SLOW),
    ],
)
def test_context_layouts_match_one_device(layout, kind):
    """3 optimizer steps with the sequence split over 'context' equal one device: losses and params."""
    _check("tiny_cpu.yaml", LAYOUTS[layout], kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["allgather", "ring"])
@pytest.mark.parametrize("layout", list(SLOW_LAYOUTS))
def test_context_layouts_match_one_device_more(kind, layout):
    if kind == "ring" and "zbh1" in layout:
        pytest.skip("the ring kind runs on the lockstep executor only (test_bad_context_input...)")
    _check("tiny_cpu.yaml", SLOW_LAYOUTS[layout], kind)


@pytest.mark.parametrize("kind", ["ring", pytest.param("allgather", marks=SLOW)])
def test_sliding_window_and_longer_sequence(kind):
    """A window shorter than a chunk and windows that cross chunk boundaries, 128 tokens over c=4."""
    over = [*NO_PIPE, "mesh.data=2", "mesh.tensor=1", "mesh.context=4", "model.sliding_window=21",
            "train.seq_len=128", "model.max_seq_len=128", "train.global_batch=8"]  # fmt: skip
    got = run_steps(_cfg("tiny_cpu.yaml", [*over, f"model.context_parallel={kind}"]))
    ref_over = ["model.sliding_window=21", "train.seq_len=128", "model.max_seq_len=128", "train.global_batch=8"]
    assert_same(got, reference("tiny_cpu.yaml", ref_over))


MOE = [*NO_PIPE, "mesh.data=2", "mesh.tensor=1", "mesh.expert=2", "mesh.context=2"]


@pytest.mark.parametrize(
    "over, kind",
    [
        pytest.param(["model.capacity_factor=0.5"], "ring", id="capacity-drops-ring"),
        pytest.param([], "allgather", id="capacity-allgather", marks=pytest.mark.slow),
        pytest.param(["model.moe_dispatch=dropless"], "allgather", id="dropless", marks=pytest.mark.slow),
    ],
)
def test_moe_routes_the_whole_sequence(over, kind):
    """context2 x expert2 x data2: capacity, dropped tokens and the router losses are the whole
    sequence's (queue places counted across the context shards), so training equals one device."""
    got = run_steps(_cfg("tiny_moe_cpu.yaml", [*MOE, *over, f"model.context_parallel={kind}"]))
    assert_same(got, reference("tiny_moe_cpu.yaml", over))


# ---------------------------------------------------------------- packed documents, eval, checkpoints

PACKED = [
    "model.vocab=320", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.head_dim=8", "model.d_ff=64", "model.max_seq_len=32", "train.seq_len=32", "train.global_batch=8",
    "pipeline.microbatches=2", "train.steps=3", "optimizer.lr=0.01", "optimizer.warmup_steps=1", "optimizer.eps=1e-4",
    "data.kind=prepared", "data.pack_documents=true", "data.val_fraction=0.2", "train.eval_every=3",
    "train.eval_batches=2", "checkpoint.async_save=false",
]  # fmt: skip


@pytest.fixture(scope="module")
def packed_data(tmp_path_factory):
    from test_prepared_data import _corpus

    from meshrun.data.tokenize import prepare

    root = tmp_path_factory.mktemp("cp_corpus")
    _corpus(root / "in")
    prepare(str(root / "in" / "*"), str(root / "data"), train_bpe=300, shard_mb=0.001, workers=2, quiet=True)
    return root / "data"


def _train(tmp_path, name, data, over, n_devices):
    from meshrun.train.loop import run

    cfg = load_config(
        "configs/tiny_cpu.yaml", [*PACKED, f"data.path={data}", f"train.run_dir={tmp_path / name}", *over]
    )
    res = run(cfg, devices=jax.devices()[:n_devices], quiet=True)
    return res, [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind", ["ring", pytest.param("allgather", marks=pytest.mark.slow)])
def test_packed_documents_and_val_loss(packed_data, tmp_path, kind):
    """Packed rows whose documents cross chunk boundaries (positions restart per document, from the
    segment ids of the whole row) and val_loss: context4 x data2 equals one device."""
    one = ["mesh.data=1", "mesh.pipe=1", "mesh.tensor=1"]
    _, rows1 = _train(tmp_path, "one", packed_data, one, 1)
    cp = ["mesh.data=2", "mesh.pipe=1", "mesh.tensor=1", "mesh.context=4", f"model.context_parallel={kind}"]
    _, rows8 = _train(tmp_path, "cp", packed_data, cp, 8)
    assert [r["step"] for r in rows1 if "val_loss" in r] == [3]
    for r1, r8 in zip(rows1, rows8, strict=True):
        np.testing.assert_allclose(r8["loss"], r1["loss"], rtol=1e-5)
        if "val_loss" in r1:
            np.testing.assert_allclose(r8["val_loss"], r1["val_loss"], rtol=1e-5)


def test_checkpoint_resumes_across_context_layouts(tmp_path):
    """A context2 run's checkpoint resumes on a mesh without context parallelism (and the losses
    continue as an uninterrupted one-layout run's)."""
    small = ["train.seq_len=16", "model.max_seq_len=16", "data.kind=synthetic", "train.global_batch=16",
             "optimizer.warmup_steps=1", "checkpoint.async_save=false", "checkpoint.every=2", "--quiet"]  # fmt: skip
    cfg = str(ROOT / "configs/tiny_cpu.yaml")
    cp = ["mesh.pipe=1", "mesh.data=2", "mesh.tensor=2", "mesh.context=2", "model.context_parallel=ring"]
    plain = ["mesh.pipe=1", "mesh.data=4", "mesh.tensor=2"]
    assert main(["train", cfg, *small, *cp, "train.steps=2", f"train.run_dir={tmp_path / 'a'}"]) == 0
    assert main(["train", cfg, *small, *plain, "train.steps=4", f"train.run_dir={tmp_path / 'a'}"]) == 0
    assert main(["train", cfg, *small, *plain, "train.steps=4", f"train.run_dir={tmp_path / 'b'}"]) == 0
    rows = lambda d: {
        json.loads(x)["step"]: json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()
    }
    a, b = rows(tmp_path / "a"), rows(tmp_path / "b")
    np.testing.assert_allclose([a[s] for s in (1, 2, 3, 4)], [b[s] for s in (1, 2, 3, 4)], rtol=1e-5)


# ---------------------------------------------------------------- collectives


def _collectives(over):
    cfg = _cfg("tiny_cpu.yaml", over)
    mesh = build_mesh(cfg.mesh)
    train_step = make_train_step(cfg, mesh)
    shape = (cfg.train.global_batch, cfg.train.seq_len)
    batch = jax.ShapeDtypeStruct(shape, np.int32, sharding=train_step.batch_sharding)
    text = train_step.step.lower(train_step.abstract_run, batch, batch).compile().as_text()
    return cfg, [c for c in hlo.collectives(text, dict(mesh.shape)) if c.axes == ("context",)]


def test_allgather_kind_gathers_k_and_v_once_per_layer():
    """context4 x data2, 4 layers, one microbatch: per layer the forward all-gathers K and V of the
    local chunk (kv_heads x head_dim x L tokens each, float32) over 'context'; the backward re-gathers
    them (the layer is rematerialised from its saved names) and reduce-scatters dK and dV."""
    cfg, colls = _collectives([*NO_PIPE, "mesh.data=2", "mesh.tensor=1", "mesh.context=4",
                               "pipeline.microbatches=1", "model.context_parallel=allgather"])  # fmt: skip
    m, length = cfg.model, cfg.train.seq_len
    rows = cfg.train.global_batch // 2
    kv_bytes = rows * length * m.n_kv_heads * m.head_dim * 4  # one of K, V, gathered, on one device
    gathers = [c for c in colls if c.op == "all-gather"]
    scatters = [c for c in colls if c.op == "reduce-scatter"]
    # K and V stacked: one gather of 2 x kv_bytes in the forward, the same again in the backward
    assert [(c.bytes, c.per_step) for c in gathers] == [(2 * kv_bytes, m.n_layers)] * 2, colls
    assert [(c.bytes, c.per_step) for c in scatters] == [(2 * kv_bytes // 4, m.n_layers)], colls


def test_ring_kind_passes_kv_around_the_ring():
    """Ring, c=4: per layer the forward sends K/V blocks c-1 = 3 times and the backward passes
    them again with their dK/dV; nothing is all-gathered over 'context' (no packed rows here)."""
    cfg, colls = _collectives([*NO_PIPE, "mesh.data=2", "mesh.tensor=1", "mesh.context=4",
                               "pipeline.microbatches=1", "model.context_parallel=ring"])  # fmt: skip
    m, rows = cfg.model, cfg.train.global_batch // 2
    block = rows * cfg.train.seq_len // 4 * 2 * m.n_kv_heads * m.head_dim * 4  # local K and V, float32
    permutes = [(c.bytes, c.per_step) for c in colls if c.op == "collective-permute"]
    # forward: 3 K/V blocks; backward (remat none keeps the ring's output and log-sum-exp, so the
    # forward ring is not re-run): 3 K/V blocks travelling with 3 dK/dV blocks, and dK/dV's way home
    assert permutes == [(block, m.n_layers)] * 10, colls
    assert not [c for c in colls if c.op in ("all-gather", "reduce-scatter")], colls


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "over, words",
    [
        (["mesh.context=3"], "mesh"),
        (["mesh.context=2", "mesh.data=2", "train.seq_len=14", "model.context_parallel=ring"], "train.seq_len"),
        (["mesh.context=4", "mesh.data=1", "train.seq_len=14"], "train.seq_len"),
        (["model.context_parallel=rings"], "model.context_parallel"),
        (
            [
                "mesh.pipe=2",
                "mesh.tensor=1",
                "mesh.context=2",
                "mesh.data=2",
                "model.context_parallel=ring",
                "pipeline.schedule=zb-h1",
            ],
            "pipeline.schedule",
        ),
        (
            [
                "mesh.pipe=2",
                "mesh.tensor=1",
                "mesh.context=2",
                "mesh.data=2",
                "model.context_parallel=ring",
                "pipeline.layers_per_stage=[3,1]",
            ],
            "pipeline.layers_per_stage",
        ),
    ],
)
def test_bad_context_input_exits_2_and_writes_nothing(tmp_path, capsys, over, words):
    run_dir = tmp_path / "r"
    small = ["train.seq_len=16", "model.max_seq_len=16", "data.kind=synthetic", "train.global_batch=16"]
    args = ["train", str(ROOT / "configs/tiny_cpu.yaml"), *small, "mesh.pipe=1", "mesh.tensor=2", *over]
    rc = main([*args, f"train.run_dir={run_dir}", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert words in err and "Traceback" not in err
    assert not run_dir.exists()


def test_a_family_without_context_attention_is_refused(tmp_path, capsys):
    args = ["train", str(ROOT / "configs/tiny_gpt2_cpu.yaml"), "mesh.pipe=1", "mesh.data=4", "mesh.tensor=1",
            "mesh.context=2", "data.kind=synthetic", f"train.run_dir={tmp_path / 'r'}", "--quiet"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "mesh.context" in err and "gpt2" in err


# ---------------------------------------------------------------- memory


def _temp(length, c, kind):
    from test_bench import _load

    return _load("context").temp_bytes(length, c, kind)  # bench/context.py's figure


@pytest.mark.parametrize("kind", ["allgather", "ring"])
def test_temp_bytes_fall_as_one_over_c(kind):
    """2048 tokens, remat none, one sequence per data shard (data 8/c x context c): the compiled
    temp bytes per device at c = 4 are at most 1.25x a quarter of the c = 1 figure."""
    one, four = _temp(2048, 1, kind), _temp(2048, 4, kind)
    assert four <= 1.25 * one / 4, (one, four)


@pytest.mark.parametrize(
    "over",
    [
        pytest.param(["mesh.pipe=1", "mesh.data=2", "mesh.tensor=2", "mesh.context=2"], id="allgather-t2"),
        pytest.param(
            [
                "mesh.pipe=2",
                "mesh.data=1",
                "mesh.tensor=2",
                "mesh.context=2",
                "model.remat=selective",
                "model.context_parallel=ring",
            ],
            id="ring-pipe2-selective",
        ),  # fmt: skip
    ],
)
def test_planner_context_bytes_equal_the_compiled_step(over):
    """`meshrun explain`: the planner's bytes over 'context' per step (K/V gathers and reduce-scatters,
    or the ring's blocks and float32 dK/dV) equal the compiled program's."""
    from meshrun.report.explain import explain

    rep = explain(load_config("configs/tiny_cpu.yaml", over))
    pred, comp = rep["collectives"]["predicted"]["context"], rep["collectives"]["compiled"]["context"]
    assert abs(pred - comp) <= 64, (pred, comp)  # the planner leaves out scalar all-reduces (loss, counts)


FIVE_AXES = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=32 --xla_backend_optimization_level=0"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, "tests")
from test_train import ONE_DEVICE, _cfg, assert_same, run_steps
over = ["mesh.data=2", "mesh.pipe=2", "mesh.expert=2", "mesh.context=2", "mesh.tensor=2",
        "model.context_parallel=KIND"]
got = run_steps(_cfg("tiny_moe_cpu.yaml", over), n_devices=32)
assert_same(got, run_steps(_cfg("tiny_moe_cpu.yaml", ONE_DEVICE), n_devices=1))
print("same", got[0])
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["allgather", "ring"])
def test_five_axes_on_32_devices_match_one_device(kind):
    """data2 x pipe2 x expert2 x context2 x tensor2 (32 simulated devices, MoE, 1F1B): one device's
    losses and params after 3 steps."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", FIVE_AXES.replace("KIND", kind)], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0 and "same" in r.stdout, r.stderr[-3000:]
