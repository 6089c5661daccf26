"""Bad command-line input: refused with exit 2 and one line naming the flag, within seconds, before
anything is written; zero is a value (never "not given"); the corpus' invalid UTF-8 is counted."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from meshrun.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs/tiny_cpu.yaml")


def _refused(capsys, argv: list[str], flag: str, seconds: float = 5.0) -> str:
    t0 = time.perf_counter()
    rc = main(argv)
    took = time.perf_counter() - t0
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert flag in lines[0], lines[0]
    assert took < seconds, f"{argv}: {took:.1f} s"
    return lines[0]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["mesh", "--devices", "0"], "--devices"),
        (["mesh", "--devices", "100000"], "--devices"),
        (["mesh", "--devices", "8", "--hosts", "0"], "--hosts"),
        (["mesh", "mesh.data=100000000"], "mesh.data"),
        (["schedule", "--pipe", "100000", "--microbatches", "100000"], "--pipe"),
        (["schedule", "--pipe", "64", "--microbatches", "4096"], "--microbatches"),
        (["plan", "--model", "llama-7b", "--cluster", "h100-80g:1x8", "--global-batch", str(10**21)], "--global-batch"),
        (["plan", "--model", "llama-7b", "--cluster", "h100-80g:1x8", "--top", str(10**9)], "--top"),
        (["import-hf", "x", "y", "--devices", "0"], "--devices"),
        (["import-hf", "x", "y", "--vocab-multiple", "0"], "--vocab-multiple"),
        (["profile", str(ROOT / "configs/tiny_cpu.yaml"), "--steps", str(10**12)], "--steps"),
        (["profile", str(ROOT / "configs/tiny_cpu.yaml"), "--devices", "0"], "--devices"),
        (["explain", TINY, "model.fp8=tensorwise", "--cluster", "v100-32g:1x8"], "--cluster"),  # no fp8 GEMMs
        (["mesh", "=3"], "=3"),
        (["mesh", "mesh..data=2"], "mesh..data"),
    ],
)
def test_out_of_range_arguments_exit_2_quickly(capsys, argv, flag):
    _refused(capsys, argv, flag)


@pytest.mark.parametrize(
    "over, fix",
    [
        (["mesh.data=8", "mesh.zero_group=3", "train.zero=3"], "use a divisor of mesh.data=8 (2, 4), or 0"),
        (["mesh.data=-1", "mesh.zero_group=3", "train.zero=3"], "use a divisor of mesh.data=8 (2, 4), or 0"),
        (["mesh.data=8", "mesh.zero_group=16", "train.zero=3"], "use at most mesh.data=8"),
        (["mesh.data=8", "mesh.zero_group=4", "train.zero=0"], "set train.zero to 1, 2 or 3 with it"),
    ],
    ids=["not-a-divisor", "not-a-divisor-of-the-filled-axis", "larger-than-data", "zero0"],
)
def test_a_zero_group_the_mesh_cannot_split_exits_2_naming_it(capsys, tmp_path, over, fix):
    """HSDP's group (mesh.zero_group): one line naming the field, its value and the fix, nothing written."""
    mesh = ["mesh.pipe=1", "mesh.tensor=1", "pipeline.microbatches=2"]
    argv = ["train", str(ROOT / "configs/tiny_cpu.yaml"), *mesh, *over, f"train.run_dir={tmp_path / 'run'}"]
    line = _refused(capsys, argv, "mesh.zero_group", seconds=30)
    assert fix in line and over[1].split("=")[1] in line, line
    assert not (tmp_path / "run").exists()


def test_supervise_launcher_is_checked_before_anything_starts(capsys, tmp_path):
    cfg = str(ROOT / "configs" / "tiny_cpu.yaml")
    over = f"train.run_dir={tmp_path / 'run'}"
    _refused(capsys, ["supervise", cfg, over, "--launcher", "", "--processes", "2"], "--launcher")
    _refused(capsys, ["supervise", cfg, over, "--launcher", "launch/local.sh 'x", "--processes", "2"], "--launcher")
    assert not (tmp_path / "run").exists()


def test_config_directory_is_not_no_such_file(capsys, tmp_path):
    line = _refused(capsys, ["train", str(tmp_path)], "config")
    assert "a directory" in line and "no such file" not in line


def _corpus(tmp_path: Path) -> str:
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_bytes(b"alpha beta \xff\xfe gamma")
    (tmp_path / "corpus" / "b.txt").write_bytes("delta épsilon".encode())
    return str(tmp_path / "corpus" / "*.txt")


def test_prepare_data_refuses_before_creating_out(capsys, tmp_path):
    glob, out = _corpus(tmp_path), tmp_path / "data"
    (tmp_path / "binary.json").write_bytes(bytes(range(256)) * 4)
    argv = ["prepare-data", "--glob", glob, "--out", str(out)]
    _refused(capsys, [*argv, "--tokenizer", str(tmp_path / "binary.json")], "--tokenizer")
    _refused(capsys, [*argv, "--train-bpe", "300", "--workers", "0"], "--workers")
    _refused(capsys, [*argv, "--train-bpe", "10"], "--train-bpe")
    assert not out.exists()


def test_prepare_data_counts_and_reports_invalid_utf8(capsys, tmp_path):
    glob, out = _corpus(tmp_path), tmp_path / "data"
    assert main(["prepare-data", "--glob", glob, "--out", str(out), "--train-bpe", "300", "--workers", "1"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out.strip().splitlines()[-1])["invalid_utf8_bytes"] == 2
    assert "2 bytes of the corpus are not valid UTF-8" in cap.err
    assert json.loads((out / "manifest.json").read_text())["invalid_utf8_bytes"] == 2


@pytest.mark.parametrize("tamper", ["manifest_not_json", "dtype_edited", "shard_odd_length", "no_shards"])
def test_tampered_prepared_data_is_an_io_error_naming_the_path(capsys, tmp_path, tamper):
    from meshrun.data.prepared import Corpus
    from meshrun.errors import DataError

    glob, out = _corpus(tmp_path), tmp_path / "data"
    assert main(["prepare-data", "--glob", glob, "--out", str(out), "--train-bpe", "300", "--workers", "1"]) == 0
    mf = out / "manifest.json"
    m = json.loads(mf.read_text())
    if tamper == "manifest_not_json":
        mf.write_text("{not json")
    elif tamper == "dtype_edited":
        mf.write_text(json.dumps(m | {"dtype": "int7"}))
    elif tamper == "no_shards":
        mf.write_text(json.dumps(m | {"shards": []}))
    else:
        b = out / m["shards"][0]["bin"]
        with open(b, "r+b") as f:
            f.truncate(b.stat().st_size - 1)
    with pytest.raises(DataError, match="data.path="):
        Corpus(str(out))


@pytest.mark.parametrize(
    "content",
    [b'{"step": "two", "loss": 1.0}\n', b'{"step": null}\n', b"\xff\xfe{not utf-8}\n", b"", b"garbage\n{}\n"],
)
def test_plot_of_a_metrics_file_without_rows_exits_2_and_writes_nothing(capsys, tmp_path, content):
    pytest.importorskip("matplotlib")
    (tmp_path / "metrics.jsonl").write_bytes(content)
    line = _refused(capsys, ["plot", str(tmp_path)], "RUN_DIR")
    assert "holds no metrics row" in line
    assert not (tmp_path / "metrics.png").exists()


def test_plot_skips_bad_lines_between_good_rows(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    rows = [b'{"step": 1, "loss": 2.0}', b'{"step": "two", "loss": 1.0}', b"\xff\xfe", b'{"step": 3, "loss": 1.5}']
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(rows) + b"\n")
    assert main(["plot", str(tmp_path)]) == 0
    assert "(2 steps)" in capsys.readouterr().err and (tmp_path / "metrics.png").stat().st_size > 1000


def test_export_of_only_damaged_checkpoints_exits_5(capsys, tmp_path):
    """A run dir whose one checkpoint has unreadable metadata: exit 5 (no intact checkpoint), not
    exit 2 'train it first'."""
    step = tmp_path / "run" / "checkpoints" / "3"
    (step / "state").mkdir(parents=True)
    (step / "meta").mkdir()
    (step / "meta" / "metadata").write_bytes(b"\x00not json")
    rc = main(["export-hf", str(tmp_path / "run"), str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 5 and "\n" not in err and "no intact checkpoint" in err and "damaged: 3" in err, err
    assert not (tmp_path / "out").exists()
