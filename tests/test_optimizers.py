"""The optimizer section and registry: muon trains on every layout as on one device, is checkpointed
and refuses a resume under another optimizer; bfloat16 moments halve the moments' bytes (compiled
and in the planner); the planner reads each optimizer's state from the registry."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from test_train import _cfg, assert_same, reference, run_steps

from meshrun.cli.main import main
from meshrun.config import load_config
from meshrun.errors import ConfigError
from meshrun.optim import registry
from meshrun.optim.optimizer import elementwise_transform, make_optimizer, muon_dims
from meshrun.planner.cost import precision_of
from meshrun.planner.layout import Layout
from meshrun.report import explain
from meshrun.runtime.mesh import build_mesh
from meshrun.train.step import make_train_step

MUON = ["optimizer.name=muon"]
NO_PIPE = ["mesh.pipe=1"]
# One-device parity of 3 muon steps (losses and updated params, rtol 1e-5), one layout per kind of axis.
LAYOUTS = {
    "data2-pipe2-tensor2-zero1": ["train.zero=1"],
}
SLOW_LAYOUTS = {
    "data4-tensor2-zero3": [*NO_PIPE, "mesh.data=4", "train.zero=3"],
    "pipe2-uneven-3+1-zero3": ["train.zero=3", "pipeline.layers_per_stage=[3,1]"],
    "pipe2-interleaved": ["pipeline.schedule=interleaved", "pipeline.virtual=2"],
    "data8-zero1-m2": [*NO_PIPE, "mesh.data=8", "mesh.tensor=1", "train.zero=1", "pipeline.microbatches=2"],
    "context2-tensor2-data2-zero1": [*NO_PIPE, "mesh.data=2", "mesh.tensor=2", "mesh.context=2", "train.zero=1"],
}  # fmt: skip


@pytest.mark.parametrize(
    "over",
    [*LAYOUTS.values(), *(pytest.param(v, marks=pytest.mark.slow) for v in SLOW_LAYOUTS.values())],
    ids=[*LAYOUTS, *SLOW_LAYOUTS],
)
def test_muon_matches_one_device(over):
    got = run_steps(_cfg("tiny_cpu.yaml", [*MUON, *over]))
    assert_same(got, reference("tiny_cpu.yaml", MUON))


@pytest.mark.slow
def test_muon_moe_data_expert_tensor_matches_one_device():
    """Experts' [E, fan_in, fan_out] weights: each expert's matrix orthogonalized on its own."""
    got = run_steps(_cfg("tiny_moe_cpu.yaml", MUON))
    assert_same(got, reference("tiny_moe_cpu.yaml", MUON))


def test_muon_treats_hidden_matrices_apart():
    """Hidden-layer weights are matrices ('embed' on one side, the stacked axes batch); embeddings,
    head, norm scales, biases and the router go to Adam. The state: one moment per matrix element."""
    assert muon_dims(("layers", "embed", "heads", "head_dim")) == ((-3,), (-2, -1))
    assert muon_dims(("layers", "heads", "head_dim", "embed")) == ((-3, -2), (-1,))
    assert muon_dims(("layers", "expert", "mlp", "embed")) == ((-2,), (-1,))
    for names in [("vocab", "embed"), ("embed", "vocab"), ("layers", "norm"), ("layers", "embed", None),
                  ("layers", "kv_heads", "head_dim")]:  # fmt: skip
        assert muon_dims(names) is None, names
    cfg = load_config("configs/tiny_cpu.yaml", MUON)
    ts = make_train_step(cfg, build_mesh(cfg.mesh, devices=jax.devices()[:8]))
    n = {"matrix": 0, "other": 0}
    for names, p in zip(jax.tree.leaves(ts.plan.model_fns.param_names, is_leaf=lambda x: isinstance(x, tuple)),
                        jax.tree.leaves(ts.abstract_state.params), strict=True):  # fmt: skip
        n["matrix" if muon_dims(names) else "other"] += p.size
    state = sum(x.size for x in jax.tree.leaves(ts.abstract_state.opt_state) if x.ndim > 0 and x.size > 15)
    spec = registry.get("muon")
    assert state == spec.moments * n["matrix"] + spec.moments_other * n["other"]


@pytest.mark.slow
def test_resume_with_another_optimizer_is_refused(tmp_path, capsys):
    """A muon checkpoint restores into muon (same numbers as an uninterrupted run); resuming it with
    adamw exits 2 with one line naming optimizer.name, and leaves the run dir as it was."""
    over = [*MUON, "mesh.pipe=1", "mesh.data=-1", "mesh.tensor=1", "model.n_layers=2", "train.seq_len=16",
            "model.max_seq_len=16", "train.global_batch=8", "pipeline.microbatches=1", "data.kind=synthetic",
            "checkpoint.async_save=false",
            f"train.run_dir={tmp_path}", "--quiet"]  # fmt: skip
    assert main(["train", "configs/tiny_cpu.yaml", *over, "train.steps=2"]) == 0
    assert main(["train", "configs/tiny_cpu.yaml", *over, "train.steps=3"]) == 0  # resumed: muon state restored
    resumed = capsys.readouterr().out
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    config = (tmp_path / "config.yaml").read_text()
    assert main(["train", "configs/tiny_cpu.yaml", *over, "train.steps=4", "optimizer.name=adamw"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("meshrun train: error: optimizer.name:") and "muon" in err[-1]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
    assert (tmp_path / "config.yaml").read_text() == config
    straight = tmp_path / "straight"
    assert main(["train", "configs/tiny_cpu.yaml", *over, "train.steps=3", f"train.run_dir={straight}"]) == 0
    loss = lambda out: out.strip().splitlines()[-1].split('"loss": ')[1].split(",")[0]
    assert loss(resumed) == loss(capsys.readouterr().out)


def test_old_train_keys_name_their_new_place(tmp_path, capsys):
    old = tmp_path / "old.yaml"
    old.write_text("train:\n  steps: 2\n  lr: 0.003\n")
    assert main(["train", str(old)]) == 2
    assert capsys.readouterr().err.strip() == (
        "meshrun train: error: train.lr: moved to optimizer.lr (got 0.003); write it as optimizer.lr "
        "(its `optimizer:` section)"
    )
    assert main(["train", "configs/tiny_cpu.yaml", "train.adam_eps=1e-4"]) == 2
    assert "train.adam_eps: moved to optimizer.eps" in capsys.readouterr().err


@pytest.mark.slow
def test_muons_options_are_its_own(tmp_path, capsys):
    """optimizer.momentum and ns_steps are MuonConfig's: adamw refuses them in one line naming muon,
    unless they state the defaults that every run's config.yaml recorded when all optimizers shared
    them; such an old config.yaml resumes without a warning about them."""
    cfg = load_config(None, [*MUON, "optimizer.momentum=0.9", "optimizer.ns_steps=3"])
    assert type(cfg.optimizer) is registry.MuonConfig and (cfg.optimizer.momentum, cfg.optimizer.ns_steps) == (0.9, 3)
    assert main(["train", "configs/tiny_cpu.yaml", "optimizer.momentum=0.9"]) == 2
    assert capsys.readouterr().err.strip() == (
        "meshrun train: error: optimizer.momentum: muon's option, not adamw's (got 0.9); remove it, or set "
        "optimizer.name=muon"
    )
    over = ["mesh.pipe=1", "mesh.data=-1", "mesh.tensor=1", "model.n_layers=2", "train.seq_len=16",
            "model.max_seq_len=16", "train.global_batch=8", "pipeline.microbatches=1", "data.kind=synthetic",
            "checkpoint.async_save=false", f"train.run_dir={tmp_path}", "--quiet"]  # fmt: skip
    assert main(["train", "configs/tiny_cpu.yaml", *over, "train.steps=2"]) == 0
    saved = tmp_path / "config.yaml"
    old = yaml.safe_load(saved.read_text())
    assert "momentum" not in old["optimizer"]
    old["optimizer"] |= {"momentum": 0.95, "ns_steps": 5}  # as every run wrote it before
    saved.write_text(yaml.safe_dump(old, sort_keys=False))
    capsys.readouterr()
    assert main(["train", str(saved), "train.steps=3", "--quiet"]) == 0
    (differs,) = [ln for ln in capsys.readouterr().err.splitlines() if "differs" in ln]
    assert differs.endswith("config.yaml: train.steps 2 -> 3"), differs  # the steps only, no optimizer keys


# ---------------------------------------------------------------- state bytes: registry, planner, compiled

BF16 = ["model.param_dtype=bfloat16", "model.dtype=bfloat16", *NO_PIPE, "mesh.data=4", "mesh.tensor=2", "train.zero=1"]


def _state_bytes_per_param(cfg) -> float:
    """Bytes of the optimizer state (moments + master) per parameter, counted on the abstract state."""
    ts = make_train_step(cfg, build_mesh(cfg.mesh, devices=jax.devices()[:8]))
    n = sum(x.size for x in jax.tree.leaves(ts.abstract_state.params))
    opt = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(ts.abstract_state.opt_state) if x.size > 15)
    return opt / n


def test_bfloat16_moments_take_8_bytes_per_param_with_the_master():
    """adamw, bf16 params: master (fp32) + m, v: 12 bytes per parameter; with bfloat16 moments 8, in
    the registry, the planner and the state the step holds (and in its compiled arguments: test below)."""
    spec = registry.get("adamw")
    assert spec.state_bytes("float32", master=True) == 12 and spec.state_bytes("bfloat16", master=True) == 8
    model = load_config("configs/tiny_cpu.yaml", BF16).model
    assert precision_of(model, layout=Layout()).opt == 12
    assert precision_of(model, layout=Layout(state_dtype="bfloat16")).opt == 8
    assert _state_bytes_per_param(load_config("configs/tiny_cpu.yaml", BF16)) == pytest.approx(12)
    bf = load_config("configs/tiny_cpu.yaml", [*BF16, "optimizer.state_dtype=bfloat16"])
    assert _state_bytes_per_param(bf) == pytest.approx(8)


def test_bfloat16_moments_compiled_and_planned():
    """The compiled step's arguments (params + optimizer state per device) shrink by 4 bytes per
    parameter / (data x tensor) with bfloat16 moments, as the planner predicts (+-2%)."""
    arg = {}
    for dt in ("float32", "bfloat16"):
        rep = explain.explain(load_config("configs/tiny_cpu.yaml", [*BF16, f"optimizer.state_dtype={dt}"]))
        arg[dt] = {k: rep["memory"][k]["argument"] for k in ("predicted", "compiled")}
        assert arg[dt]["predicted"] == pytest.approx(arg[dt]["compiled"], rel=0.02)
    saved = {k: arg["float32"][k] - arg["bfloat16"][k] for k in ("predicted", "compiled")}
    assert saved["predicted"] == pytest.approx(saved["compiled"], rel=0.02)
    assert saved["compiled"] > 0.19 * arg["float32"]["compiled"]  # 4 of 2 + 12/(d t) bytes per param


def test_muon_planned_memory_matches_compiled():
    """The planner's memory of a muon step (state from the registry: one moment per matrix element)
    within +-15% of the compiled step's, its arguments within +-2%."""
    rep = explain.explain(load_config("configs/tiny_cpu.yaml", [*MUON, *NO_PIPE, "mesh.data=4"]))
    pm, cm = rep["memory"]["predicted"], rep["memory"]["compiled"]
    assert pm["argument"] == pytest.approx(cm["argument"], rel=0.02)
    assert pm["total"] == pytest.approx(cm["total"], rel=0.15), (pm, cm)


def test_planner_never_gives_another_optimizer_adams_figures(capsys):
    """Every registered optimizer's state bytes reach the planner's memory; an unknown name is a
    ConfigError naming optimizer.name (`--optimizer` when the flag gave it); `meshrun plan --optimizer`
    costs the one asked for."""
    model = load_config("configs/tiny_cpu.yaml").model
    adam = precision_of(model, layout=Layout())
    muon = precision_of(model, layout=Layout(optimizer="muon"))
    assert (adam.opt, adam.opt_rest) == (8, 8) and (muon.opt, muon.opt_rest) == (4, 8)
    with pytest.raises(ConfigError, match="optimizer.name"):
        precision_of(model, layout=Layout(optimizer="lion"))
    args = ["plan", "--model", "llama-7b", "--cluster", "h100-80g:1x8", "--global-batch", "8", "--seq-len", "2048",
            "--evaluate", "data=8,zero=1", "--json"]  # fmt: skip
    mem = {}
    for opt in ("adamw", "muon", "adamw --state-dtype bfloat16"):
        assert main([*args, "--optimizer", *opt.split()]) == 0
        mem[opt] = json.loads(capsys.readouterr().out)["configs"][0]["memory_parts_gb"]["optimizer"]
    assert mem["muon"] < mem["adamw"] and mem["adamw --state-dtype bfloat16"] < mem["adamw"]
    assert main([*args, "--optimizer", "lion"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error: --optimizer: unknown optimizer (got 'lion')" in err[0], err


def test_elementwise_transform_is_the_step_optimizer_without_clipping():
    """What a streamed per-chunk update runs: the entry in its state dtype; chunks updated one by one
    equal the whole update; muon (whole matrices) is refused."""
    cfg = load_config("configs/tiny_cpu.yaml", ["optimizer.state_dtype=bfloat16", "optimizer.grad_clip=0"])
    tx = elementwise_transform(cfg)
    w, g = jnp.linspace(-1, 1, 64).reshape(8, 8), jnp.linspace(0.5, -0.5, 64).reshape(8, 8)
    whole, state = make_optimizer(cfg).update({"w": g}, make_optimizer(cfg).init({"w": w}), {"w": w})
    assert jax.tree.leaves(state)[1].dtype == jnp.bfloat16
    parts = [tx.update({"w": g[i : i + 4]}, tx.init({"w": w[i : i + 4]}), {"w": w[i : i + 4]})[0]["w"] for i in (0, 4)]
    np.testing.assert_array_equal(np.concatenate(parts), whole["w"])
    with pytest.raises(ConfigError, match="optimizer.name"):
        elementwise_transform(load_config("configs/tiny_cpu.yaml", MUON))
    assert isinstance(tx, optax.GradientTransformation)


def test_warmup_zero_starts_at_the_peak_lr_and_ends_at_the_floor():
    """optimizer.warmup_steps=0 means no warmup: the first step runs at optimizer.lr (a warmup of one
    step would run it at 0 and move nothing), and the cosine reaches min_lr_ratio·lr at train.steps;
    a warmup of 2 still starts at 0 and peaks at its end."""
    from meshrun.optim.optimizer import lr_schedule

    base = ["optimizer.lr=0.01", "optimizer.min_lr_ratio=0.1", "train.steps=10"]
    cold = lr_schedule(load_config("configs/tiny_cpu.yaml", [*base, "optimizer.warmup_steps=0"]))
    warm = lr_schedule(load_config("configs/tiny_cpu.yaml", [*base, "optimizer.warmup_steps=2"]))
    np.testing.assert_allclose([float(cold(0)), float(cold(10)), float(cold(20))], [0.01, 0.001, 0.001], rtol=1e-6)
    assert 0.001 < float(cold(5)) < 0.01
    np.testing.assert_allclose([float(warm(0)), float(warm(1)), float(warm(2)), float(warm(10))],
                               [0.0, 0.005, 0.01, 0.001], rtol=1e-6)  # fmt: skip
