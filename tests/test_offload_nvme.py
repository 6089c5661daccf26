"""offload.optimizer=nvme: the streamed update equals the in-memory step exactly (losses and
params after several steps, tolerance 0) on every layout kind, and the tier holds no more host
memory than its budget."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_reliability import CONFIG, one_error_line, train
from test_reliability import SMALL as CLI_SMALL

from meshrun.checkpoint.store import scan
from meshrun.config import load_config
from meshrun.data.datasets import global_batch_arrays, make_dataset
from meshrun.offload.optimizer_tier import CopyUpdate, InPlaceUpdate
from meshrun.parallel.sharding import DP_AXES
from meshrun.runtime.mesh import build_mesh
from meshrun.train.step import make_train_step

SMALL = ["train.seq_len=16", "model.max_seq_len=16", "data.kind=synthetic", "train.global_batch=16",
         "optimizer.lr=0.01", "optimizer.warmup_steps=1"]  # fmt: skip
BUDGET = "offload.budget_mb=0.5"  # several chunks per step on the tiny models
ROOT = Path(__file__).resolve().parents[1]


def run(config, over, steps=3):
    cfg = load_config(f"configs/{config}", [*SMALL, *over])
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:8])
    ts = make_train_step(cfg, mesh)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    state, losses = ts.init(), []
    for i in range(steps):
        state, metrics = ts.step(state, *global_batch_arrays(ds, i, mesh, P(DP_AXES)))
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(ts.to_model(state)), ts


def assert_exact(config, over, tmp_path, steps=3):
    ref = run(config, over, steps)
    got = run(config, [*over, "offload.optimizer=nvme", f"offload.dir={tmp_path}", BUDGET], steps)
    np.testing.assert_array_equal(got[0], ref[0])
    leaves = jax.tree.leaves_with_path(ref[1])
    assert jax.tree.structure(got[1]) == jax.tree.structure(ref[1])
    for (path, r), g in zip(leaves, jax.tree.leaves(got[1]), strict=True):
        np.testing.assert_array_equal(g, r, err_msg=jax.tree_util.keystr(path))
    return got[2]


def test_nvme_equals_in_memory_data_pipe_tensor(tmp_path):
    """data 2 x pipe 2 x tensor 2, ZeRO-1: losses, params and the whole optimizer state (read back from
    the files) equal the in-memory step's bit for bit after 3 steps; the update ran in several chunks,
    one read and one write call each, and the tier never held more host memory than its budget."""
    ts = assert_exact("tiny_cpu.yaml", ["train.zero=1"], tmp_path)
    f = ts.tier.file
    assert ts.tier.layout.n_chunks >= 3
    assert f.peak_resident <= 0.5 * 2**20
    assert f.bytes_read == f.bytes_written == 3 * f.state_bytes + f.state_bytes  # 3 steps + the read-back
    assert f.reads * f.chunk_bytes == f.bytes_read and f.writes * f.chunk_bytes == f.bytes_written  # 1 call a chunk
    assert f.streams == 3 and f.early_reads <= 3 * 2  # at most both ring buffers filled during the device part
    assert f.stream_bytes == 3 * 2 * f.state_bytes - f.early_reads * f.chunk_bytes


LAYOUTS = {
    "data8-zero0": ("tiny_cpu.yaml", ["mesh.data=8", "mesh.pipe=1", "mesh.tensor=1", "pipeline.microbatches=2"]),
    "data4-tensor2-zero2": ("tiny_cpu.yaml", ["mesh.data=4", "mesh.pipe=1", "train.zero=2"]),
    "pipe2-data2-tensor2-zero3-uneven": ("tiny_cpu.yaml", ["train.zero=3", "pipeline.layers_per_stage=[3,1]"]),
    "interleaved": (
        "tiny_cpu.yaml",
        [
            "pipeline.schedule=interleaved",
            "pipeline.virtual=2",
            "mesh.tensor=1",
            "mesh.data=2",
            "mesh.pipe=2",
            "mesh.context=2",
            "model.n_layers=8",
        ],
    ),
    "expert": ("tiny_moe_cpu.yaml", ["train.zero=1"]),
    "context": ("tiny_cpu.yaml", ["mesh.data=2", "mesh.pipe=1", "mesh.tensor=2", "mesh.context=2", "train.zero=1"]),
    "bf16-master": (
        "tiny_cpu.yaml",
        ["model.param_dtype=bfloat16", "model.dtype=bfloat16", "mesh.pipe=1", "mesh.data=4", "train.zero=1"],
    ),
    # the per-layer variants: the layers' gradients leave the loop reduce-scattered, sums sharded
    "data4-tensor2-zero3-layer": (
        "tiny_cpu.yaml",
        ["mesh.data=4", "mesh.pipe=1", "train.zero=3", "train.zero3_gather=layer"],
    ),
    "pipe2-data2-tensor2-zero2-microbatch": ("tiny_cpu.yaml", ["train.zero=2", "train.zero2_reduce=microbatch"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_nvme_equals_in_memory_layouts(name, tmp_path):
    config, over = LAYOUTS[name]
    assert_exact(config, over, tmp_path)


def test_offload_dir_missing_or_shared_exit_2_before_compiling(capsys, tmp_path):
    """A missing offload_dir, or one another process holds: exit 2, one line naming offload.dir."""
    missing = tmp_path / "missing"
    status, _, err = train(capsys, tmp_path / "a", "offload.optimizer=nvme", f"offload.dir={missing}")
    assert status == 2 and "offload.dir: no such directory" in one_error_line(err)
    shared = tmp_path / "shared"
    shared.mkdir()
    code = f"import fcntl,os,sys,time; fd=os.open({str(shared / 'meshrun-offload.lock')!r}, os.O_RDWR|os.O_CREAT); "
    code += "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        status, _, err = train(capsys, tmp_path / "b", "offload.optimizer=nvme", f"offload.dir={shared}")
    finally:
        holder.kill()
    assert status == 2 and "another process" in one_error_line(err)
    assert not (tmp_path / "b" / "checkpoints").exists()


@contextlib.contextmanager
def _unwritable_dir(kind: str, tmp_path: Path):
    """A directory this process cannot create files in, made the way `kind` says, or a skip saying why
    this machine cannot make one that way."""
    if kind == "procfs":  # os.access says writable for root; creating a file fails (ENOENT) for anyone
        if not os.path.isdir("/proc/self"):
            pytest.skip("no /proc here")
        yield Path("/proc")
        return
    d = tmp_path / kind
    d.mkdir()
    if kind == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root writes a mode 0555 directory (it is writable for root)")
        d.chmod(0o555)
        try:
            yield d
        finally:
            d.chmod(0o755)
        return
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(d)], capture_output=True,
                           text=True, timeout=30)  # fmt: skip
    if mount.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs here: {(mount.stderr or mount.stdout).strip().splitlines()[0]}")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True, timeout=30)


@pytest.mark.parametrize("kind", ["procfs", "chmod", "read-only-mount"])
def test_offload_dir_not_writable_exits_2_before_compiling(capsys, tmp_path, kind):
    """An offload_dir this process cannot create files in, as root too: exit 2, one line naming
    offload.dir, the directory and the fix; no checkpoint written."""
    with _unwritable_dir(kind, tmp_path) as d:
        status, _, err = train(capsys, tmp_path / "run", "offload.optimizer=nvme", f"offload.dir={d}")
        line = one_error_line(err)
    assert status == 2, err
    assert "offload.dir: not writable: cannot create a file in it" in line and f"(got '{d}')" in line, line
    assert "use a directory this process can write" in line
    assert not (tmp_path / "run" / "checkpoints").exists()


def _cli(run_dir, *over, **env):
    argv = ["train", "--quiet", CONFIG, *CLI_SMALL, f"train.run_dir={run_dir}", "train.steps=4", "checkpoint.every=2",
            *over]  # fmt: skip
    script = f"import sys\nfrom meshrun.cli.main import main\nsys.exit(main({argv!r}))\n"
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def _final_loss(run_dir) -> float:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] == 4][-1]["loss"]


@pytest.mark.slow
@pytest.mark.serial
def test_sigkill_mid_swap_out_then_rerun_and_cross_tier_resume(tmp_path):
    """SIGKILL in the middle of step 3's swap-out: the rerun resumes from checkpoint 2 and ends on the
    uninterrupted run's final loss exactly; so does a rerun on the in-memory tier (nvme -> none), and
    the none tier's checkpoint resumes on nvme (none -> nvme)."""
    nvme = ["offload.optimizer=nvme", f"offload.dir={tmp_path}", BUDGET]
    ref = _cli(tmp_path / "ref", *nvme)
    assert ref.returncode == 0, ref.stderr[-2000:]
    killed = _cli(tmp_path / "k", *nvme, MESHRUN_FAULT_OFFLOAD_KILL="3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert [e.step for e in scan(tmp_path / "k") if e.status == "complete"] == [2]
    rerun = _cli(tmp_path / "k", *nvme)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert _final_loss(tmp_path / "k") == _final_loss(tmp_path / "ref")
    shutil.copytree(tmp_path / "k" / "checkpoints" / "2", tmp_path / "n" / "checkpoints" / "2")
    other = _cli(tmp_path / "n")  # nvme's checkpoint 2 on the in-memory tier
    assert other.returncode == 0, other.stderr[-2000:]
    assert _final_loss(tmp_path / "n") == _final_loss(tmp_path / "ref")
    plain = _cli(tmp_path / "plain")  # the in-memory tier from scratch, then its checkpoint 2 on nvme
    assert plain.returncode == 0, plain.stderr[-2000:]
    shutil.copytree(tmp_path / "plain" / "checkpoints" / "2", tmp_path / "m" / "checkpoints" / "2")
    back = _cli(tmp_path / "m", *nvme)
    assert back.returncode == 0, back.stderr[-2000:]
    assert _final_loss(tmp_path / "m") == _final_loss(tmp_path / "plain") == _final_loss(tmp_path / "ref")


@pytest.mark.slow
@pytest.mark.serial
def test_full_disk_mid_swap_exit_4_last_checkpoint_intact(tmp_path):
    """ENOSPC while step 3 swaps out (the injected fault): one line naming the directory, exit 4, and
    checkpoint 2 intact."""
    nvme = ["offload.optimizer=nvme", f"offload.dir={tmp_path}", BUDGET]
    r = _cli(tmp_path / "run", *nvme, MESHRUN_FAULT_OFFLOAD_ENOSPC="3")
    assert r.returncode == 4, r.stderr[-2000:]
    line = one_error_line(r.stderr)
    assert str(tmp_path) in line and "No space left on device" in line
    assert [(e.step, e.status) for e in scan(tmp_path / "run")] == [(2, "complete")]


def test_in_place_pass_aliases_its_buffers_and_equals_the_copy_path(tmp_path):
    """The CPU backend's in-place pass: each chunk's update writes the new state into the very buffers
    the store read the chunk into (XLA aliases the donated halves) and the new params into the param
    row it read them from, rows replicated over devices (data 2, ZeRO-0) included; 3 steps equal the
    copy path's (the host buffers copied to the device and back, a GPU's path) exactly (the tests
    above compare the in-place pass with the in-memory step)."""
    over = ["mesh.data=2", "mesh.pipe=1", "mesh.tensor=2", "pipeline.microbatches=2"]
    results = []
    for in_place in (True, False):
        (tmp_path / str(in_place)).mkdir()
        cfg = load_config("configs/tiny_cpu.yaml", [*SMALL, *over, "offload.optimizer=nvme", BUDGET,
                                                    f"offload.dir={tmp_path / str(in_place)}"])  # fmt: skip
        mesh = build_mesh(cfg.mesh, devices=jax.devices()[:4])
        ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len,
                          global_batch=cfg.train.global_batch)  # fmt: skip
        ts = make_train_step(cfg, mesh)
        tier = ts.tier
        assert isinstance(tier.update, InPlaceUpdate) and len(tier.layout.first) < len(tier.layout.local)  # replicated
        if not in_place:
            tier.update = CopyUpdate(tier)
        aliased, update = [], tier.chunk_part_in_place

        def spy(g, p, slots, *rest, update=update, aliased=aliased):
            before = [x.unsafe_buffer_pointer() for s in slots for h in s for x in (h.addressable_data(0),)]
            before.append(p.addressable_data(0).unsafe_buffer_pointer())  # the new params: into the param row
            out = update(g, p, slots, *rest)
            aliased.extend(a == x.addressable_data(0).unsafe_buffer_pointer()
                           for a, x in zip(before, [h for s in out[0] for h in s] + [out[1]], strict=True))  # fmt: skip
            return out

        tier.chunk_part_in_place = spy
        state, losses = ts.init(), []
        for i in range(3):
            state, metrics = ts.step(state, *global_batch_arrays(ds, i, mesh, P(DP_AXES)))
            losses.append(float(metrics["loss"]))
        halves = 3 * tier.layout.n_chunks * (2 * tier.pattern.n_slots + 1)  # 3 steps' chunks' slots' halves, row
        assert tier.layout.n_chunks >= 3 and len(aliased) == (halves if in_place else 0)
        assert all(aliased)
        results.append((np.array(losses), jax.device_get(ts.to_model(state))))
    for got in results[1:]:
        np.testing.assert_array_equal(got[0], results[0][0])
        for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(results[0][1]), strict=True):
            np.testing.assert_array_equal(a, b)


def test_delayed_fp8_on_nvme_is_refused(tmp_path, capsys):
    """model.fp8=delayed with offload.optimizer=nvme trained silently wrong (the amax history went
    stale): exit 2, one line naming offload.optimizer, and no run directory written."""
    run_dir = tmp_path / "run"
    over = ["model.fp8=delayed", "offload.optimizer=nvme", f"offload.dir={tmp_path / 'nvme'}", "train.steps=1"]
    rc, _, err = train(capsys, run_dir, *over)
    line = one_error_line(err)
    assert rc == 2 and "offload.optimizer" in line and "amax history" in line, line
    assert not run_dir.exists()
    load_config(CONFIG, [*CLI_SMALL, "model.fp8=tensorwise", "offload.optimizer=nvme", "offload.dir=x"])
