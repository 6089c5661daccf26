"""Datasets: determinism in (seed, step), row slicing, text/tokens corpora, errors, global arrays."""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshrun.config import DataConfig, MeshConfig
from meshrun.data import datasets as data
from meshrun.data.datasets import global_batch_arrays, make_dataset, synthetic_entropy
from meshrun.errors import ConfigError
from meshrun.runtime.mesh import build_mesh

ROOT = Path(__file__).resolve().parents[1]


def _ds(kind="synthetic", vocab=256, seq_len=32, global_batch=8, **kw):
    return make_dataset(DataConfig(kind=kind, **kw), vocab=vocab, seq_len=seq_len, global_batch=global_batch)


@pytest.fixture(scope="module")
def text_ds():
    return _ds("text", seq_len=64, global_batch=8)


@pytest.mark.parametrize("kind", ["synthetic", "text"])
def test_deterministic_in_seed_and_step(kind, text_ds):
    ds = text_ds if kind == "text" else _ds(kind, seq_len=64)
    again = _ds(kind, seq_len=64)
    t1, l1 = ds.batch(5)
    t2, l2 = again.batch(5)  # a fresh dataset object (a resumed run) sees the same batch
    assert t1.dtype == l1.dtype == np.int32 and t1.shape == l1.shape == (8, 64)
    np.testing.assert_array_equal(t1, t2)
    np.testing.assert_array_equal(l1, l2)
    np.testing.assert_array_equal(t1[:, 1:], l1[:, :-1])  # labels are tokens shifted by one
    assert (ds.batch(6)[0] != t1).mean() > 0.5  # another step: another batch
    other_seed = _ds(kind, seq_len=64, seed=1)
    assert (other_seed.batch(5)[0] != t1).mean() > 0.5
    assert len({r.tobytes() for r in t1}) == 8  # rows differ from each other


@pytest.mark.parametrize("kind", ["synthetic", "text"])
def test_row_slices_equal_full_batch_rows(kind, text_ds):
    ds = text_ds if kind == "text" else _ds(kind, seq_len=64)
    full_t, full_l = ds.batch(3)
    for rows in (slice(0, 2), slice(2, 5), slice(5, 8), slice(6, None)):
        t, lab = ds.batch(3, rows)
        np.testing.assert_array_equal(t, full_t[rows])
        np.testing.assert_array_equal(lab, full_l[rows])


def test_synthetic_is_learnable_markov_chain():
    ds = _ds("synthetic", vocab=64, seq_len=256, global_batch=16)
    t, lab = ds.batch(0)
    hit = (ds.nxt[t] == lab).mean()
    # next == nxt[prev] with probability 1 - NOISE + NOISE/V = 0.9016 (4096 samples: sd ~0.005)
    assert abs(hit - (1 - data.NOISE + data.NOISE / 64)) < 0.025
    assert t.min() >= 0 and t.max() < 64
    assert synthetic_entropy(256) == pytest.approx(0.876186, abs=1e-6)  # vs ln 256 = 5.545
    assert synthetic_entropy(256) < np.log(256) / 5


def test_text_default_is_stdlib_bytes(text_ds):
    corpus = text_ds.corpus
    assert corpus.dtype == np.uint8 and len(corpus) == data.TEXT_CAP_BYTES
    first = data.stdlib_sources()[0]
    head = first.read_bytes()[:200]
    assert bytes(corpus[: len(head)]) == head  # first sorted source file comes first
    t, lab = text_ds.batch(0)
    assert t.max() < 256 and lab.max() < 256
    # Python source: mostly printable ASCII
    assert ((t >= 32) & (t < 127) | (t == 10)).mean() > 0.9


def test_text_glob_sorted_with_separator(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"bbbb")
    (tmp_path / "a.txt").write_bytes(b"aaaa")
    corpus = data.load_text(str(tmp_path / "*.txt"))
    assert bytes(corpus) == b"aaaa\x00bbbb\x00"
    assert bytes(data.load_text(str(tmp_path / "*.txt"), cap=6)) == b"aaaa\x00b"
    ds = _ds("text", seq_len=4, glob=str(tmp_path / "*.txt"))
    t, lab = ds.batch(0)
    for row_t, row_l in zip(t, lab):
        window = bytes(np.append(row_t, row_l[-1]).astype(np.uint8))
        assert window in bytes(corpus)


def test_text_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.glob.*matches no files") as e:
        _ds("text", glob=str(tmp_path / "none*.txt"))
    assert str(tmp_path) in str(e.value)
    with pytest.raises(ConfigError, match=r"model\.vocab.*>= 256"):
        _ds("text", vocab=128)
    (tmp_path / "small.txt").write_bytes(b"0123456789")
    with pytest.raises(ConfigError, match=r"train\.seq_len.*holds only 11 tokens"):
        _ds("text", seq_len=32, glob=str(tmp_path / "small.txt"))


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_tokens_bin_memmap(tmp_path, dtype):
    ids = (np.arange(1000) * 7 % 50_000).astype(dtype)
    path = tmp_path / "train.bin"
    ids.tofile(path)
    ds = _ds("tokens", vocab=50_257, seq_len=16, path=str(path), token_dtype=dtype)
    assert isinstance(ds.corpus, np.memmap)
    t, lab = ds.batch(2)
    for row_t, row_l in zip(t, lab):
        start = int(np.flatnonzero(ids == row_t[0])[0])  # ids are distinct: the window's start
        np.testing.assert_array_equal(row_t, ids[start : start + 16])
        np.testing.assert_array_equal(row_l, ids[start + 1 : start + 17])
    np.testing.assert_array_equal(
        t, _ds("tokens", vocab=50_257, seq_len=16, path=str(path), token_dtype=dtype).batch(2)[0]
    )


def test_tokens_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.path.*not set"):
        _ds("tokens")
    missing = str(tmp_path / "missing.bin")
    with pytest.raises(ConfigError, match=r"data\.path.*no such file") as e:
        _ds("tokens", path=missing)
    assert missing in str(e.value)
    path = tmp_path / "t.bin"
    np.array([1, 2, 300, 4] * 10, np.uint16).tofile(path)
    with pytest.raises(ConfigError, match=r"model\.vocab.*holds token id 300.*model\.vocab >= 301"):
        _ds("tokens", vocab=256, seq_len=8, path=str(path))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(ConfigError, match=r"data\.token_dtype.*3 bytes"):
        _ds("tokens", path=str(odd))


@pytest.mark.parametrize(
    "mesh_kw, spec",
    [
        (dict(data=2, pipe=2, tensor=2), P(("data", "expert"))),
        (dict(data=8), P("data")),
        (dict(data=2, expert=2, tensor=2), P(("data", "expert"))),
        (dict(data=4, tensor=2), P("data", "tensor")),  # sequence dim sharded too
        (dict(data=1, pipe=4, tensor=2), P()),  # replicated
    ],
)
def test_global_batch_arrays_equal_full_batch(mesh_kw, spec):
    mesh = build_mesh(MeshConfig(**mesh_kw))
    ds = _ds("synthetic", seq_len=16, global_batch=8)
    tokens, labels = global_batch_arrays(ds, 7, mesh, spec)
    full_t, full_l = ds.batch(7)
    assert tokens.shape == (8, 16) and tokens.dtype == np.int32
    assert tokens.sharding.spec == spec
    np.testing.assert_array_equal(np.asarray(tokens), full_t)
    np.testing.assert_array_equal(np.asarray(labels), full_l)
    for shard in tokens.addressable_shards:  # each device holds its own rows
        np.testing.assert_array_equal(np.asarray(shard.data), full_t[shard.index])


_WORKER = textwrap.dedent(
    """
    import sys, numpy as np, jax
    from jax.experimental import multihost_utils
    jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    from jax.sharding import PartitionSpec as P
    from meshrun.config import DataConfig, MeshConfig
    from meshrun.data.datasets import global_batch_arrays, make_dataset
    from meshrun.runtime.mesh import build_mesh
    ds = make_dataset(DataConfig(kind="synthetic"), vocab=256, seq_len=16, global_batch=8)
    built = []
    orig = ds.batch
    ds.batch = lambda step, rows=None: (built.append(rows), orig(step, rows))[1]
    mesh = build_mesh(MeshConfig(data=4, tensor=2))
    tokens, _ = global_batch_arrays(ds, 3, mesh, P("data"))
    full = orig(3)[0]
    for s in tokens.addressable_shards:
        assert np.array_equal(np.asarray(s.data), full[s.index]), s.index
    rows = sorted(i for r in built for i in range(*r.indices(8)))
    gathered = multihost_utils.process_allgather(tokens, tiled=True)
    assert np.array_equal(np.asarray(gathered), full)
    print("ROWS", jax.process_index(), rows, flush=True)
    jax.distributed.shutdown()
    """
)


@pytest.mark.slow
@pytest.mark.serial
def test_two_processes_build_only_their_rows(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), f"127.0.0.1:{port}", str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    rows = sorted(line for out in outs for line in out.splitlines() if line.startswith("ROWS"))
    # data=4 over 2 processes x 4 devices (tensor=2 innermost): each process owns half the rows
    assert rows == ["ROWS 0 [0, 1, 2, 3]", "ROWS 1 [4, 5, 6, 7]"]
