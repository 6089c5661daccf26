import pytest
from meshrun_models.llama.config import LlamaConfig

from meshrun.config import MeshConfig, RunConfig, TrainConfig, load_config, load_section, to_dict
from meshrun.errors import ConfigError


def test_defaults_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("mesh: {pipe: 2, tensor: 2}\nmodel: {d_model: 32}\n")
    cfg = load_config(p, ["mesh.data=2", "train.zero=3", "mesh.order=tensor,data,pipe,expert"])
    assert isinstance(cfg, RunConfig)
    assert (cfg.mesh.pipe, cfg.mesh.tensor, cfg.mesh.data) == (2, 2, 2)
    assert cfg.mesh.order == ("context", "tensor", "data", "pipe", "expert")  # context added
    assert cfg.model.d_model == 32 and cfg.train.zero == 3
    assert to_dict(cfg)["mesh"]["order"] == ["context", "tensor", "data", "pipe", "expert"]


@pytest.mark.parametrize(
    "override, field, words",
    [
        ("mesh.tensr=2", "mesh.tensr", "did you mean 'tensor'"),
        ("mesh.tensor=2.5", "mesh.tensor", "not an integer"),
        ("mesh.tensor=abc", "mesh.tensor", "not an integer"),
        ("mesh.tensor=0", "mesh.tensor", "-1"),
        ("mesh.pipe=-2", "mesh.pipe", "positive"),
        ("train.zero=4", "train.zero", "0, 1, 2 or 3"),
        ("model.remat=some", "model.remat", "selective"),
        ("model.n_kv_heads=3", "model.n_kv_heads", "divisor"),
        ("modle.d_model=3", "modle", "did you mean 'model'"),
        ("mesh.allow_cross_host_tensor=maybe", "mesh.allow_cross_host_tensor", "true or false"),
        ("optimizer.lr=fast", "optimizer.lr", "not a number"),
        ("noequals", "noequals", "section.key=value"),
    ],
)
def test_bad_values_name_field_value_and_fix(override, field, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert e.value.field == field
    assert words in str(e.value)


def test_two_fill_axes_and_bad_order():
    with pytest.raises(ConfigError, match="at most one axis"):
        MeshConfig(data=-1, pipe=-1)
    with pytest.raises(ConfigError, match="permutation"):
        MeshConfig(order=("pipe", "data", "tensor"))


def test_moe_validation():
    with pytest.raises(ConfigError, match="top_k"):
        LlamaConfig(n_experts=2, top_k=3)
    with pytest.raises(ConfigError, match="moe_every"):
        LlamaConfig(n_experts=4, moe_every=3, n_layers=4)


def test_load_section_rejects_other_sections():
    assert load_section(MeshConfig, ["mesh.tensor=2"], "mesh").tensor == 2
    with pytest.raises(ConfigError, match="only mesh"):
        load_section(MeshConfig, ["train.steps=2"], "mesh")


def test_missing_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("mesh: [1, 2\n")
    with pytest.raises(ConfigError, match="YAML"):
        load_config(bad)
    assert TrainConfig().zero == 0


def test_configuration_reference_is_current():
    """docs/configuration.md is generated from the config dataclasses; every key has a meaning."""
    from pathlib import Path

    from meshrun import config_ref

    missing = [k.key for k in config_ref.keys() if not k.meaning]
    assert not missing, f"config fields without a comment (their meaning in `meshrun config`): {missing}"
    page = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    assert page.read_text() == config_ref.markdown(), (
        f"docs/configuration.md is out of date with meshrun/config/: run `{config_ref.REGENERATE}`"
    )


@pytest.mark.parametrize(
    "given, want",
    [("optimizer.learning_rate", "lr"), ("optimizer.epsilon", "eps"), ("train.max_steps", "steps")],
)
def test_other_frameworks_names_suggest_meshruns_key(given, want):
    with pytest.raises(ConfigError, match=rf"{given}: unknown key .*did you mean '{want}'\?"):
        load_config(None, [f"{given}=1"])
