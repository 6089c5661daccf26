"""A model family outside meshrun (examples/custom_model): named as `package.module:FAMILY`, trained
on data2 x pipe2 x tensor2 with the one-device losses and parameters, its own parameter count in the
start-up block, and NNX State parameters with logical names accepted."""

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import jax
import pytest
from test_train import SMALL, assert_same, run_steps

from meshrun.config import load_config
from meshrun.errors import ConfigError
from meshrun.family import registry

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/custom_model/config.yaml"
FAMILY = "custom_model.model:FAMILY"


@pytest.fixture(autouse=True, scope="module")
def importable():
    sys.path.insert(0, str(ROOT / "examples"))
    yield
    sys.path.remove(str(ROOT / "examples"))


def _cfg(over=()):
    return load_config(CONFIG, [*SMALL, *over])


def test_trains_on_pipe_data_tensor_as_on_one_device():
    """3 optimizer steps on (data2, pipe2, tensor2) equal one device: losses and updated params."""
    ref = run_steps(_cfg(["mesh.data=1", "mesh.pipe=1", "mesh.tensor=1"]), n_devices=1)
    assert_same(run_steps(_cfg()), ref)


def _line(lines: list[str], label: str) -> str:
    (line,) = [x for x in lines if x.startswith(f"{label} ")]
    return line


def test_its_config_class_fields_and_count():
    from meshrun.report.startup import startup_lines
    from meshrun.train.plan import build_plan

    cfg = _cfg()
    assert type(cfg.model) is registry.config_class(FAMILY) and cfg.model.shift == 0.5
    with pytest.raises(ConfigError, match=rf"model.mlp: {FAMILY} has no such field"):
        _cfg(["model.mlp=gelu"])
    with pytest.raises(ConfigError, match=r"model.shift: .*use a weight in \[0, 1\]"):
        _cfg(["model.shift=2"])
    mesh = jax.make_mesh((1, 1, 1, 1, 1), ("pipe", "data", "expert", "context", "tensor"), devices=jax.devices()[:1])
    plan = build_plan(cfg, mesh)
    n = sum(math.prod(a.shape) for a in jax.tree.leaves(plan.abstract_params))
    m = cfg.model
    assert n == 2 * m.vocab * m.d_model + m.n_layers * (m.d_model + 2 * m.d_model * m.d_ff)
    lines = startup_lines(cfg, mesh, plan)
    assert f"{n / 1e6:.2f}M params" in lines[0] and "not predicted" in _line(lines, "memory")


def test_a_family_without_attention_has_no_head_fields():
    """The example family fixes the attention heads (ClassVar): model.n_heads is refused as a field it
    does not have, and the shared checks skip the fields a family lacks (no n_kv_heads error)."""
    with pytest.raises(ConfigError, match=rf"^model.n_heads: {FAMILY} has no such field"):
        _cfg(["model.n_heads=3"])
    with pytest.raises(ConfigError, match=r"^model.d_ff: "):  # its shared fields are still checked
        _cfg(["model.d_ff=0"])


def test_mfu_counts_the_familys_own_flops_or_none():
    """TFLOP/s and MFU count the FLOPs the family declares (`Family.flops_per_token`); a family that
    declares none and is not a transformer gets "n/a" in the start-up block and no TFLOP/s or MFU rows;
    a transformer family keeps the transformer formula."""
    from meshrun.analysis.flops import model_flops
    from meshrun.report.startup import startup_lines
    from meshrun.train.metrics import MetricRows
    from meshrun.train.plan import build_plan

    cfg = _cfg()
    m, t = cfg.model, cfg.train
    mesh = jax.make_mesh((1, 1, 1, 1, 1), ("pipe", "data", "expert", "context", "tensor"), devices=jax.devices()[:1])
    plan = build_plan(cfg, mesh)
    per_token = 6 * (m.n_layers * 2 * m.d_model * m.d_ff + m.d_model * m.vocab)
    tokens = t.global_batch * t.seq_len
    assert plan.family.model_flops(m, t.global_batch, t.seq_len) == per_token * tokens
    assert f"({per_token:,} per token, custom_mlp's flops_per_token)" in _line(startup_lines(cfg, mesh, plan), "flops")
    rows = MetricRows(cfg, 8, 0.0, lambda step: 1e-3, plan.family)
    rows.peak = 1e12  # as on a GPU whose peak is known
    row = rows.row({"loss": 1.0}, 0, 0.5)
    assert row["tflops_per_device"] == pytest.approx(per_token * tokens / 0.5 / 8 / 1e12, rel=1e-12)
    assert row["mfu"] == pytest.approx(row["tflops_per_device"], rel=1e-12)

    bare = replace(plan.family, flops_per_token=None)
    assert bare.model_flops(m, t.global_batch, t.seq_len) is None
    assert "flops     n/a: family custom_mlp declares no flops (no TFLOP/s, MFU n/a)" in startup_lines(
        cfg, mesh, replace(plan, family=bare)
    )
    rows = MetricRows(cfg, 8, 0.0, lambda step: 1e-3, bare)
    rows.peak = 1e12
    row = rows.row({"loss": 1.0}, 0, 0.5)
    assert "tflops_per_device" not in row and "mfu" not in row and row["tokens_per_s"] == tokens / 0.5

    llama = load_config(ROOT / "configs/tiny_cpu.yaml")
    got = registry.get("llama").model_flops(llama.model, 16, 64)
    assert got == model_flops(llama.model, 16, 64) and got > 0


def test_explain_compiles_it_and_the_planner_refuses_it(capsys):
    """`meshrun explain` on a family whose module imports jax: a fresh process sets up its devices
    before the module loads (it reaches the --cluster check, not "this process has 1 CPU devices");
    in process, compiled columns only, the predicted ones empty with a note; `meshrun plan` refuses
    the family in one line."""
    from meshrun.cli.main import main

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "examples"), str(ROOT)]), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "meshrun.cli.main", "explain", str(CONFIG), "--cluster", "h100-80g:1x8"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"meshrun explain: error: --cluster: model.family={FAMILY} has no predicted step time (predictable = False) "
        "(got 'h100-80g:1x8'); leave it out for this family"
    ], r.stderr
    assert main(["explain", str(CONFIG), *SMALL, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rep["compiled"] and rep["memory"]["compiled"]["total"] > 0 and rep["collectives"]["compiled"]["pipe"] > 0
    assert rep["memory"]["predicted"] == rep["collectives"]["predicted"] == {} and "predictable = False" in rep["note"]
    assert main(["plan", "--model", str(CONFIG), "--cluster", "h100-80g:1x8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"meshrun plan: error: --model: model.family={FAMILY} sets predictable")


def test_param_names_missing_or_mismatched_is_a_config_error(tmp_path, monkeypatch):
    """A family whose ModelFns has no param_names, names in another tree than its parameters, or a
    logical axis without a mesh rule is refused naming the family (not an AttributeError or KeyError
    from deep in the sharding code)."""
    from meshrun.train.plan import build_plan

    mesh = jax.make_mesh((1, 1, 1, 1, 1), ("pipe", "data", "expert", "context", "tensor"), devices=jax.devices()[:1])
    monkeypatch.syspath_prepend(str(tmp_path))
    ok = {"embed": ("vocab", "embed"), "head": ("embed", "vocab"), "layers": {"scale": ("layers", "norm"),
          "w_in": ("layers", "embed", "mlp"), "w_out": ("layers", "mlp", "embed")}}  # fmt: skip
    cases = {
        "none": (None, "ModelFns has no param_names"),
        "other": ({"embed": ("vocab",)}, "ModelFns.param_names is"),
        "axis": ({**ok, "head": ("embed", "hidden")}, "parameters use the logical axis 'hidden', which has no"),
    }
    for name, (names, match) in cases.items():
        (tmp_path / f"badnames_{name}.py").write_text(
            "from dataclasses import replace\nfrom custom_model import model\n"
            f"FAMILY = replace(model.FAMILY, model_fns=lambda c: replace(model.model_fns(c), param_names={names!r}))\n"
        )
        with pytest.raises(ConfigError, match=rf"model.family: custom_mlp's {match}"):
            build_plan(_cfg([f"model.family=badnames_{name}:FAMILY"]), mesh)


def test_unknown_module_is_a_config_error():
    with pytest.raises(ConfigError, match="model.family: no such module .*make 'no_such_pkg' importable"):
        load_config(None, ["model.family=no_such_pkg.model:FAMILY"])


def test_custom_loop_matches_one_device():
    """examples/custom_loop.py's Pipeline (public API, data2 x pipe2 x tensor2): the one-device loss and
    gradients of the family's own functions."""
    import custom_loop
    import numpy as np
    from custom_model.model import FAMILY, MLPConfig

    from meshrun import MeshConfig, PipelineConfig
    from meshrun.family.contract import loss_fn

    cfg = MLPConfig(d_model=32, n_layers=4, d_ff=64, max_seq_len=16)
    pc = PipelineConfig(schedule="1f1b", microbatches=4)
    pipe, params = custom_loop.build(cfg, MeshConfig(data=2, pipe=2, tensor=2), pc)
    tok, lab = custom_loop.batch(cfg, 0, rows=16, seq=16)
    loss, grads, _ = pipe(params, tok, lab)
    ref = jax.device_put(FAMILY.init_params(cfg, 0), jax.devices()[0])
    fns = FAMILY.model_fns(cfg)
    (ref_loss, _), ref_grads = jax.value_and_grad(lambda p: loss_fn(fns, p, tok, lab), has_aux=True)(ref)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for (path, g), r in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def test_meshrun_checkpoints_shows_the_familys_fields():
    """The checkpoint table names the family and shows the fields its class lists and its own (shift),
    not the transformer's heads; the built-in family keeps the transformer's fields."""
    from dataclasses import asdict

    from meshrun.cli.checkpoints import model_summary

    mlp = model_summary(asdict(_cfg().model))
    assert mlp.startswith(f"family={FAMILY} vocab=") and "shift=0.5" in mlp and "n_heads" not in mlp, mlp
    llama = model_summary(asdict(load_config(ROOT / "configs/tiny_cpu.yaml").model))
    assert "n_heads=" in llama and "n_kv_heads=" in llama and "shift" not in llama, llama
    unknown = model_summary({"family": "nowhere.mod:FAMILY", "d_model": 8, "n_heads": 2})
    assert unknown == "family=nowhere.mod:FAMILY d_model=8 n_heads=2", unknown


def test_meshrun_checkpoints_says_when_it_cannot_import_the_family():
    from meshrun.checkpoint.store import StepInfo
    from meshrun.cli.checkpoints import format_table

    model = {"family": "nowhere.mod:FAMILY", "d_model": 8, "n_heads": 2}
    table = format_table("run", [StepInfo(1, "complete", "1", model), StepInfo(2, "complete", "2", model)])
    notes = [ln for ln in table.splitlines() if "could not import" in ln]
    assert notes == [
        "model.family nowhere.mod:FAMILY: could not import it here (no such module), so the shared fields are "
        "shown; add its folder to PYTHONPATH to see its own"
    ], table
    assert "could not import" not in format_table("run", [StepInfo(1, "complete", "1", {"family": "llama"})])


@pytest.mark.parametrize(
    "name, source, words",
    [
        ("raises", "raise RuntimeError('no GPU here')\n", "importing raises_mod failed (RuntimeError: no GPU here)"),
        ("syntax", "def broken(:\n", "importing syntax_mod failed (SyntaxError: "),
        ("empty", None, "no module before ':'"),
    ],
)
def test_a_family_module_that_cannot_be_imported_is_a_config_error(tmp_path, monkeypatch, name, source, words):
    monkeypatch.syspath_prepend(str(tmp_path))
    if source is not None:
        (tmp_path / f"{name}_mod.py").write_text(source)
    family = f"{name}_mod:FAMILY" if source is not None else ":FAMILY"
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"model.family={family}"])
    assert e.value.field == "model.family" and words in str(e.value), str(e.value)
    assert len(str(e.value).splitlines()) == 1


def test_a_meshrun_folder_that_shadows_the_package_is_named(tmp_path):
    """A folder named meshrun on PYTHONPATH (a checkout beside the user's package): one line naming it."""
    (tmp_path / "meshrun").mkdir()
    (tmp_path / "meshrun" / "__init__.py").write_text("")
    (tmp_path / "mine.py").write_text("from meshrun import Family\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    bin_dir = os.path.dirname(sys.executable)
    r = subprocess.run([os.path.join(bin_dir, "meshrun"), "train", str(ROOT / "configs/tiny_cpu.yaml"),
                        "model.family=mine:FAMILY", f"train.run_dir={tmp_path / 'r'}"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert f"meshrun is imported from {tmp_path / 'meshrun'}, not the installed package" in line, line
