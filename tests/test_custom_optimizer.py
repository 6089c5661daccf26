"""An optimizer outside meshrun (examples/custom_optimizer): named as `package.module:SPEC`, it trains
through the CLI exactly as the same optimizer written inline (optax's SGD with momentum, registered
here), and a name that does not import is one line with exit 2."""

import json
import re
import sys
from pathlib import Path

import optax
import pytest

from meshrun import OptimizerSpec
from meshrun.cli.main import main
from meshrun.config import load_config
from meshrun.errors import ConfigError
from meshrun.optim import registry

ROOT = Path(__file__).resolve().parents[1]
SGD = "custom_optimizer.sgd:SGD"
# data2 x pipe2 x tensor2 with ZeRO-1: the momentum is sharded over 'data' like Adam's moments
RUN = ["model.n_layers=2", "train.seq_len=16", "model.max_seq_len=16", "train.global_batch=8", "train.steps=4",
       "pipeline.microbatches=2", "data.kind=synthetic", "train.zero=1",
       "optimizer.lr=0.05", "checkpoint.async_save=false", "--quiet"]  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def importable():
    sys.path.insert(0, str(ROOT / "examples"))
    yield
    sys.path.remove(str(ROOT / "examples"))


def _losses(tmp_path, name: str, *over: str) -> list[float]:
    run = tmp_path / re.sub(r"\W", "_", name)
    assert main(["train", "configs/tiny_cpu.yaml", *RUN, *over, f"optimizer.name={name}", f"train.run_dir={run}"]) == 0
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_trains_as_the_same_optimizer_written_inline(tmp_path, monkeypatch):
    from custom_optimizer.sgd import SgdConfig

    inline = OptimizerSpec("sgd_inline", build=lambda opt, schedule, _names: optax.sgd(schedule, momentum=opt.momentum),
                           moments=1, moments_other=1, elementwise=True, config=SgdConfig)  # fmt: skip
    monkeypatch.setitem(registry.OPTIMIZERS, "sgd_inline", inline)
    mine, ref = (_losses(tmp_path, n, "optimizer.momentum=0.8") for n in (SGD, "sgd_inline"))
    adamw = _losses(tmp_path, "adamw")
    assert len(mine) == 4 and mine == ref, (mine, ref)  # the same bits
    assert mine[1:] != adamw[1:]  # (the optimizer is the one that ran)
    assert registry.get(SGD) is registry.get(SGD) and registry.get(SGD).elementwise


def test_its_own_config_class():
    """optimizer.momentum is the example's own key (SgdConfig), checked by its class."""
    cfg = load_config(None, [f"optimizer.name={SGD}", "optimizer.momentum=0.5"])
    assert type(cfg.optimizer).__name__ == "SgdConfig" and cfg.optimizer.momentum == 0.5
    with pytest.raises(ConfigError, match=r"optimizer.momentum: .*\(got 1.0\); use a number in \[0, 1\)"):
        load_config(None, [f"optimizer.name={SGD}", "optimizer.momentum=1"])
    with pytest.raises(ConfigError, match=r"optimizer.ns_steps: muon's option, not custom_optimizer.sgd:SGD's"):
        load_config(None, [f"optimizer.name={SGD}", "optimizer.ns_steps=3"])


@pytest.mark.parametrize(
    "name, source, words",
    [
        ("raises_opt:SGD", "raise RuntimeError('no GPU')\n", "importing raises_opt failed (RuntimeError: no GPU)"),
        ("syntax_opt:SGD", "def broken(:\n", "importing syntax_opt failed (SyntaxError: "),
        ("plain_opt:SGD", "SGD = 3\n", "not an OptimizerSpec (int) (got 'plain_opt:SGD'); point at"),
        ("plain_opt:NOPE", "SGD = 3\n", "module plain_opt has no NOPE"),
        ("nowhere_pkg.opt:SGD", None, "no such module (got 'nowhere_pkg.opt:SGD'); make 'nowhere_pkg' importable"),
        (":SGD", None, "no module before ':'"),
        ("plain_opt:", "SGD = 3\n", "no name after ':'"),
    ],
)
def test_an_optimizer_that_cannot_be_imported_is_a_config_error(tmp_path, monkeypatch, name, source, words):
    monkeypatch.syspath_prepend(str(tmp_path))
    if source is not None:
        (tmp_path / f"{name.partition(':')[0]}.py").write_text(source)
    path = tmp_path / "run.yaml"
    path.write_text(f"optimizer:\n  name: '{name}'\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert e.value.field == "optimizer.name" and words in str(e.value), str(e.value)
    assert len(str(e.value).splitlines()) == 1


def test_the_cli_refuses_it_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "syntax_opt2.py").write_text("def broken(:\n")
    assert main(["train", "configs/tiny_cpu.yaml", "optimizer.name=syntax_opt2:SGD"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("meshrun train: error: optimizer.name: importing syntax_opt2 failed (SyntaxError: "), line
    assert main(["train", "configs/tiny_cpu.yaml", "optimizer.name=sgd"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "unknown optimizer (got 'sgd'); use one of adamw, muon, or your own as package.module:SPEC" in line, line
