"""Per-family model configs: the family's own class, what the planner asks of it, old metadata read,
and pipeline.balance=auto costed on the run's GPU (issue 37)."""

import json
import re
from pathlib import Path

import pytest
from meshrun_models.gpt2.config import Gpt2Config
from meshrun_models.llama.config import LlamaConfig

from meshrun.config import ModelConfig, from_dict, load_config, saved_model, to_dict
from meshrun.errors import ConfigError
from meshrun.family import registry
from meshrun.planner.hardware import GPUS, gpu_of_kind, parse_cluster
from meshrun.planner.search import search

ROOT = Path(__file__).resolve().parents[1]
GPT2 = ROOT / "configs/tiny_gpt2_cpu.yaml"


def run_plan(argv, capsys):
    from meshrun.cli.main import main

    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_config_names_no_family():
    """The family names live in meshrun/family/registry.py only (import-linter also forbids
    meshrun.config from importing meshrun.family or the models)."""
    for path in sorted((ROOT / "meshrun/config").glob("*.py")):
        text = path.read_text()
        for name in registry.FAMILIES:
            assert not re.search(rf"\b{name}\b", text, re.IGNORECASE), (path.name, name)


def test_every_family_declares_a_config_class_that_matches_its_functions():
    for name in registry.FAMILIES:
        cls, fam = registry.config_class(name), registry.get(name)
        assert issubclass(cls, ModelConfig) and fam.config is cls and cls().family == name
        assert fam.model_fns(cls(n_kv_heads=4)).context is cls.context_attention


def test_the_model_section_builds_the_family_class_and_round_trips():
    cfg = load_config(GPT2)
    assert type(cfg.model) is Gpt2Config and "mlp" not in to_dict(cfg.model)
    assert from_dict(ModelConfig, to_dict(cfg.model)) == cfg.model
    assert type(load_config(None).model) is LlamaConfig  # model.family left out: the default family
    with pytest.raises(ConfigError, match=r"model.family: .*\(got 'gpt3'\); use one of gpt2, llama"):
        load_config(None, ["model.family=gpt3"])


def test_old_gpt2_metadata_with_llama_fields_is_readable():
    """Checkpoints written when all families shared one config recorded Llama's fields for gpt2."""
    old = {**to_dict(LlamaConfig()), **to_dict(load_config(GPT2).model), "mlp": "swiglu"}
    old.pop("init_std")  # a field added since: its default
    assert from_dict(ModelConfig, saved_model(old)) == load_config(GPT2).model
    assert saved_model({"d_model": 32})["family"] == "llama"  # metadata from before families


def test_plan_refuses_context_for_gpt2_as_train_does(capsys):
    rc, _, err = run_plan(["--model", str(GPT2), "--cluster", "h100-80g:1x8", "--evaluate", "context=2"], capsys)
    assert rc == 2 and "--evaluate context: model.family=gpt2 has no context-parallel attention (got 2)" in err
    with pytest.raises(ConfigError, match="mesh.context: model.family=gpt2 has no context-parallel attention"):
        load_config(GPT2).model.check_context(2)


@pytest.mark.parametrize(
    "key, value", [("fp8", "tensorwise"), ("fp8_amax_history", "4"), ("fp8_first_last_bf16", "true")]
)
def test_gpt2_refuses_fp8_naming_the_family(key, value, capsys):
    """The fp8 keys are the base config's; a family without fp8 GEMMs refuses them, in one line."""
    from meshrun.cli.main import main

    assert main(["train", str(GPT2), f"model.{key}={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"model.{key}: model.family=gpt2 has no fp8 GEMMs" in err and len(err.splitlines()) == 1, err
    assert LlamaConfig.fp8_gemms and not Gpt2Config.fp8_gemms and Gpt2Config().fp8 == "none"
    rc, _, err = run_plan(["--model", str(GPT2), "--cluster", "h100-80g:1x8", "--fp8", "tensorwise"], capsys)
    assert rc == 2 and "--fp8: model.family=gpt2 has no fp8 GEMMs" in err


def test_fp8_is_read_without_fallbacks():
    """model.fp8 is a base field: no code reads it through getattr with a default."""
    pattern = re.compile(r"(getattr|hasattr)\([^)]*fp8")
    for path in [*ROOT.glob("meshrun/**/*.py"), *ROOT.glob("models/**/*.py"), *ROOT.glob("bench/**/*.py")]:
        assert not pattern.search(path.read_text()), path


@pytest.mark.parametrize("seq", [None, 65536])
def test_plan_proposes_no_context_parallelism_for_gpt2(seq, capsys):
    argv = ["--model", str(GPT2), "--cluster", "h100-80g:1x8", "--json", "--top", "3"]
    gpt2 = load_config(GPT2).model
    if seq:
        argv += ["--seq-len", str(seq), "--global-batch", "8"]
        # the same search on the llama twin does use context parallelism at this length
        twin = LlamaConfig(**{k: v for k, v in to_dict(gpt2).items() if k != "family"}, mlp="gelu")
        assert any(r.layout.context > 1 for r in search(twin, parse_cluster("h100-80g:1x8"), 8, seq, top=3))
    rc, out, err = run_plan(argv, capsys)
    assert rc == 0, err
    layouts = json.loads(out)["configs"]
    assert layouts and all(r["context"] == 1 for r in layouts)


@pytest.mark.parametrize("kind, name", [
    ("NVIDIA H100 80GB HBM3", "h100-80g"), ("NVIDIA H200", "h200"), ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA A100-SXM4-40GB", "a100-40g"), ("NVIDIA A100-SXM4-80GB", "a100-80g"),
    ("NVIDIA A100 80GB PCIe", "a100-80g-pcie"), ("NVIDIA H100 PCIe", None), ("cpu", None), ("NVIDIA H800", "h800"),
])  # fmt: skip
def test_gpu_of_device_kind(kind, name):
    assert gpu_of_kind(kind) == name and (name is None or name in GPUS)


def test_balance_auto_costs_with_the_run_gpu_and_says_which():
    from types import SimpleNamespace

    import numpy as np

    from meshrun.train.plan import balance_gpu, unit_costs

    h100 = SimpleNamespace(devices=np.array([SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")]))
    assert balance_gpu(h100) == ("h100-80g", "this run's NVIDIA H100 80GB HBM3")
    cpu = SimpleNamespace(devices=np.array([SimpleNamespace(device_kind="cpu")]))
    assert balance_gpu(cpu)[0] == "a100-80g" and "default" in balance_gpu(cpu)[1]
    model = LlamaConfig(d_model=4096, n_layers=8, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=14336, vocab=128256)
    a100, h100_costs = unit_costs(model, 4096, "a100-80g"), unit_costs(model, 4096, "h100-80g")
    assert h100_costs[0] < a100[0]  # a faster GPU: a layer costs fewer seconds
