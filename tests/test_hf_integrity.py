"""Hugging Face import/export that is exactly right: verified reads, relative paths, the trained model's
config, padded vocabulary outside the softmax, contradictions and damaged files refused with exit 2.

Fixtures: tests/fixtures/hf (transformers' own configs, weights and fp32 logits, make_fixtures.py).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from meshrun_models.llama.config import LlamaConfig

from meshrun.checkpoint.state import Checkpointer
from meshrun.cli.main import main
from meshrun.config import CheckpointConfig, MeshConfig, ModelConfig, to_dict
from meshrun.hf.convert import model_config
from meshrun.hf.io import export_hf, import_hf, load_params
from meshrun.hf.safetensors_io import SafeTensors, read_header
from meshrun.runtime.mesh import build_mesh

FIX = Path(__file__).parent / "fixtures" / "hf"
TOL = 1e-4  # tests/test_hf.py: meshrun's logits vs transformers' at fp32


def _one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    run = tmp_path_factory.mktemp("llama") / "run"
    import_hf(FIX / "llama2", run, mesh=build_mesh(MeshConfig(data=8)))
    return run


def _trained(run: Path, tmp_path: Path, cfg: ModelConfig, steps: dict[int, float], name="trained") -> Path:
    """A run dir whose step checkpoints hold the import's params scaled by each step's factor (what a
    run started from `checkpoint.init_params` writes: state.params + checksums, meta model/init_params)."""
    _, params, _ = load_params(run, quiet=True)
    out = tmp_path / name
    meta = {"model": to_dict(cfg), "init_params": str(run / "hf_import")}
    with Checkpointer(out, CheckpointConfig(async_save=False, keep=10), meta=meta) as ck:
        for step, f in steps.items():
            ck.save(step, {"params": jax.tree.map(lambda a, f=f: a * f, params), "step": np.int32(step)}, force=True)
    return out


# ------------------------------------------------------------------ export reads what it verifies


def test_export_skips_a_checkpoint_that_fails_its_checksum(llama, tmp_path, capsys, monkeypatch):
    cfg, _, _ = load_params(llama, quiet=True)
    run = _trained(llama, tmp_path, cfg, {1: 2.0, 2: 3.0})
    meta_file = run / "checkpoints" / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    key = "params.layers.attn.q"
    assert key in meta["checksums"]  # the saved names are the ones export checks
    meta["checksums"][key] = [1, 2]  # = array data that no longer matches (OCDBT reads it back silently)
    meta_file.write_text(json.dumps(meta))
    monkeypatch.chdir(tmp_path)
    assert main(["export-hf", "trained", "out"]) == 0  # relative paths
    out, err = capsys.readouterr()
    assert "checkpoints/2 is damaged" in err and "does not match its checksum" in err and "checkpoint 1" in err
    assert json.loads(out)["source"] == str(run / "checkpoints" / "1")  # the step exported, not the newest
    # --step: that checkpoint or nothing (a damaged one is not replaced by another; a missing one is bad input)
    assert main(["export-hf", "trained", "out-s2", "--step", "2"]) == 5
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "older" not in err, err  # no other step is tried: none is announced
    assert "checkpoints/2 is damaged" in err and "does not match its checksum" in err, err
    assert not (tmp_path / "out-s2" / "config.json").exists()
    assert main(["export-hf", "trained", "out-s7", "--step", "7"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshrun export-hf: error: --step: no complete checkpoint at that step in ")
    assert "\n" not in err
    assert "(complete: 1, 2)" in err and not (tmp_path / "out-s7").exists()
    assert main(["export-hf", "trained", "out-s1", "--step", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["source"] == str(run / "checkpoints" / "1")
    src, out = SafeTensors(FIX / "llama2"), SafeTensors(tmp_path / "out")
    name = "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(out.get(name), 2.0 * np.asarray(src.get(name)))  # step 1's, not step 2's
    assert (tmp_path / "trained" / "checkpoints" / "2").is_dir()  # reported, never moved or deleted
    # every step damaged: exit 5, nothing exported from the untrained import
    meta1 = run / "checkpoints" / "1" / "meta" / "metadata"
    m = json.loads(meta1.read_text())
    m["checksums"] = {k: [0, 0] for k in m["checksums"]}
    meta1.write_text(json.dumps(m))
    assert main(["export-hf", "trained", "out2"]) == 5
    assert "no intact checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "out2" / "config.json").exists()


# ------------------------------------------------------------------ relative paths


def test_readme_commands_work_with_relative_paths(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = os.path.relpath(FIX / "llama2", tmp_path)
    assert main(["import-hf", src, "runs/llama", "mesh.data=8"]) == 0
    doc = yaml.safe_load((tmp_path / "runs" / "llama" / "config.yaml").read_text())
    assert doc["train"]["run_dir"] == str(tmp_path / "runs" / "llama")  # absolute: train from anywhere
    assert doc["checkpoint"]["init_params"] == str(tmp_path / "runs" / "llama" / "hf_import")
    capsys.readouterr()
    assert main(["export-hf", "runs/llama", "out/llama"]) == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "llama" / "config.json").is_file()
    cfg, _, _ = load_params(Path("runs/llama"), quiet=True)
    _trained(Path("runs/llama"), tmp_path, cfg, {1: 1.0}, name="runs/x")
    capsys.readouterr()
    assert main(["checkpoints", "runs/x", "--verify", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(c["step"], c["status"]) for c in doc["checkpoints"]] == [(1, "complete")]
    assert doc["verified"] == {"steps": [1], "damaged": [], "ok": True}
    assert main(["checkpoints", "runs/x", "--verify"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("step(s) 1 and compared its checksums: ok")


def test_checkpoints_verify_exits_5_on_a_damaged_checkpoint(llama, tmp_path, capsys):
    cfg, _, _ = load_params(llama, quiet=True)
    run = _trained(llama, tmp_path, cfg, {1: 1.0, 2: 1.0})
    m = json.loads((run / "checkpoints" / "2" / "meta" / "metadata").read_text())
    m["checksums"]["params.layers.attn.q"] = [1, 2]
    (run / "checkpoints" / "2" / "meta" / "metadata").write_text(json.dumps(m))
    assert main(["checkpoints", str(run)]) == 0  # a listing: metadata only
    capsys.readouterr()
    assert main(["checkpoints", str(run), "--verify"]) == 5
    out = capsys.readouterr().out
    assert "2  damaged" in out and "does not match its checksum" in out
    assert out.strip().splitlines()[-1].endswith("step(s) 1, 2 and compared its checksums: damaged 2")


# ------------------------------------------------------------------ the trained model's config


@pytest.mark.parametrize(
    "fam, over",
    [
        ("llama2", {"rope_theta": 123456.0}),
        ("llama2", {"sliding_window": 8}),  # a Llama with a window is a Mistral
        ("mixtral", {"top_k": 3}),  # top_k=1 is refused: test_export_refuses_a_model_hugging_face_cannot_express
        (
            "llama2",
            dict(
                rope_scaling="yarn",
                rope_scaling_factor=4.0,
                rope_original_max_seq_len=64,
                rope_beta_fast=16.0,
                rope_attention_factor=1.25,
            ),
        ),  # fmt: skip
        ("deepseek_v3", dict(rope_scaling="yarn", rope_scaling_factor=40.0, rope_mscale_all_dim=1.0)),
    ],
)
def test_export_writes_the_config_of_the_model_that_was_trained(tmp_path, fam, over):
    import dataclasses

    run = tmp_path / "imp"
    import_hf(FIX / fam, run, mesh=build_mesh(MeshConfig(data=8)))
    cfg0, _, _ = load_params(run, quiet=True)
    cfg = dataclasses.replace(cfg0, **over, remat="full", dtype="bfloat16")  # runtime settings are not model
    trained = _trained(run, tmp_path, cfg, {1: 1.0})
    export_hf(trained, tmp_path / "out", quiet=True)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    back = model_config(config, cfg.vocab)
    for k, v in over.items():
        assert getattr(back, k) == v, (k, config)
    assert config.get("eos_token_id") == json.loads((FIX / fam / "config.json").read_text()).get("eos_token_id")
    # and the exported directory imports back as the trained model
    import_hf(tmp_path / "out", tmp_path / "again", mesh=build_mesh(MeshConfig(data=8)))
    cfg2, _, _ = load_params(tmp_path / "again", quiet=True)
    assert dataclasses.replace(
        cfg2, moe_dispatch=cfg.moe_dispatch, capacity_factor=cfg.capacity_factor
    ) == dataclasses.replace(cfg, remat="none", dtype="float32")


MOE4 = dict(n_experts=4, capacity_factor=2.0)


@pytest.mark.parametrize(
    ("over", "field"),
    [
        (dict(MOE4, top_k=2, moe_every=2), "model.moe_every"),
        (dict(MOE4, top_k=1, moe_every=1), "model.top_k"),
        (dict(rope_scaling="yarn", rope_mscale_all_dim=1.0), "model.rope_mscale_all_dim"),
    ],
)
def test_export_refuses_a_model_hugging_face_cannot_express(llama, tmp_path, capsys, over, field):
    """MoE every other layer: no architecture; top-1: transformers' Mixtral renormalises the one gate
    to 1.0, meshrun scales the expert by its probability (their logits differed by 2.47); YaRN's
    softmax correction: DeepSeek-V3's only."""
    import dataclasses

    cfg, _, _ = load_params(llama, quiet=True)
    cfg = dataclasses.replace(cfg, **over)
    run = tmp_path / "moe"
    meta = {"model": to_dict(cfg), "init_params": str(llama / "hf_import")}
    from meshrun.family import registry

    params = jax.tree.map(
        lambda a: np.zeros(a.shape, a.dtype), registry.get(cfg.family).abstract_params(cfg).to_pure_dict()
    )
    with Checkpointer(run, CheckpointConfig(async_save=False), meta=meta) as ck:
        ck.save(1, {"params": params}, force=True)
    assert main(["export-hf", str(run), str(tmp_path / "out")]) == 2
    assert field in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ padded vocabulary


@pytest.mark.parametrize("fam", ["llama2", "qwen2"])
def test_first_loss_equals_transformers_loss(tmp_path, fam):
    """100 ids padded to 128: the padded logits take no part in the softmax, so meshrun's loss on the
    fixture tokens is transformers' loss on them (from transformers' own fp32 logits, the fixture)."""
    from meshrun_models import apply_layers, embed, head_loss

    import_hf(FIX / fam, tmp_path / "run", mesh=build_mesh(MeshConfig(data=8)))
    cfg, params, _ = load_params(tmp_path / "run", quiet=True)
    assert cfg.vocab == 128 and cfg.vocab_used == 100
    tokens = np.load(FIX / "tokens.npy")
    ref = np.load(FIX / fam / "logits.npy").astype(np.float64)[:, :-1]  # transformers: [B, L, 100]
    labels = tokens[:, 1:]
    lse = np.log(np.sum(np.exp(ref - ref.max(-1, keepdims=True)), -1)) + ref.max(-1)
    want = float(np.mean(lse - np.take_along_axis(ref, labels[..., None], -1)[..., 0]))

    def loss(p, t, lab):
        x, _ = apply_layers(p["layers"], embed(p, t, cfg), cfg)
        s, n = head_loss(p, x, lab, cfg)
        return s / n

    got = float(jax.jit(loss)(params, tokens[:, :-1], labels))
    assert abs(got - want) <= 2 * TOL  # |d loss| <= 2 max |d logit|; the padded softmax was +0.1 off


def test_vocab_used_is_validated():
    from meshrun.errors import ConfigError

    with pytest.raises(ConfigError, match="model.vocab_used"):
        LlamaConfig(vocab=128, vocab_used=129)
    with pytest.raises(ConfigError, match="model.vocab_used"):
        LlamaConfig(vocab_used=-1)


# ------------------------------------------------------------------ import refuses contradictions


def _copy(fam: str, tmp_path: Path) -> Path:
    d = tmp_path / f"{fam}-copy"
    shutil.copytree(FIX / fam, d)
    return d


def _import_rc(capsys, src: Path, run: Path) -> tuple[int, str]:
    rc = main(["import-hf", str(src), str(run), "mesh.data=8"])
    return rc, capsys.readouterr().err


def test_import_refuses_a_head_count_the_shapes_contradict(tmp_path, capsys):
    src = _copy("llama2", tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_attention_heads"] *= 2  # head_dim given: q_proj's rows no longer fit
    (src / "config.json").write_text(json.dumps(cfg))
    rc, err = _import_rc(capsys, src, tmp_path / "run")
    assert rc == 2 and "config.json" in _one_line(err) and "shape" in err
    assert not (tmp_path / "run").exists()


def test_import_refuses_a_vocab_size_the_embedding_contradicts(tmp_path, capsys):
    src = _copy("llama2", tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    cfg["vocab_size"] = 90
    (src / "config.json").write_text(json.dumps(cfg))
    rc, err = _import_rc(capsys, src, tmp_path / "run")
    assert rc == 2 and "vocab_size" in _one_line(err) and "rows" in err
    assert not (tmp_path / "run").exists()


def test_import_refuses_truncated_tensor_data_naming_the_file(tmp_path, capsys):
    src = _copy("llama2", tmp_path)
    f = src / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 100)
    rc, err = _import_rc(capsys, src, tmp_path / "run")
    assert rc == 2 and str(f) in _one_line(err) and "truncated" in err
    assert not (tmp_path / "run").exists()


def test_import_refuses_an_unsupported_dtype_naming_the_file(tmp_path, capsys):
    src = _copy("llama2", tmp_path)
    f = src / "model.safetensors"
    header, start = read_header(f)
    name = "model.norm.weight"
    header[name]["dtype"] = "F8_E4M3"
    header[name]["data_offsets"][1] = header[name]["data_offsets"][0] + int(np.prod(header[name]["shape"]))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    data = f.read_bytes()[start:]
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    rc, err = _import_rc(capsys, src, tmp_path / "run")
    assert rc == 2 and str(f) in _one_line(err) and "F8_E4M3" in err
    assert "I64" not in err and "F32, F16, BF16" in err and "dequantize" in err, err  # what a weight may be
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("bad", [{"num_hidden_layers": None}, {"hidden_size": "64"}, {"vocab_size": 0}])
def test_import_refuses_unusable_config_values(tmp_path, capsys, bad):
    src = _copy("llama2", tmp_path)
    cfg = json.loads((src / "config.json").read_text()) | bad
    (src / "config.json").write_text(json.dumps(cfg))
    rc, err = _import_rc(capsys, src, tmp_path / "run")
    assert rc == 2 and "config.json" in _one_line(err)
    assert not (tmp_path / "run").exists()


def test_import_refuses_a_top_1_mixtral(tmp_path, capsys):
    src = _copy("mixtral", tmp_path)
    cfg = json.loads((src / "config.json").read_text()) | {"num_experts_per_tok": 1}
    (src / "config.json").write_text(json.dumps(cfg))
    rc, err = _import_rc(capsys, src, tmp_path / "run")
    line = _one_line(err)
    assert rc == 2 and "model.top_k: a top-1 Mixtral computes differently in transformers" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "fam, change, text",
    [
        ("qwen3_moe", {"num_experts_per_tok": 1}, "model.top_k: a top-1 Qwen3-MoE computes differently"),
        ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}, "config.json: use_sliding_window"),
        ("qwen3_moe", {"attention_bias": True}, "config.json: attention_bias"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, "config.json: mlp_only_layers: the MoE layers of"),
        ("qwen3_moe", {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "config.json: rope_scaling"),
        ("qwen3_moe", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0}},
         "config.json: rope_scaling.mscale_all_dim"),
        ("deepseek_v3", {"rope_scaling": {"type": "yarn", "factor": 40.0, "truncate": False}},
         "config.json: rope_scaling.truncate"),
        ("deepseek_v3", {"rope_scaling": {"type": "yarn", "factor": 40.0, "beta_fast": 0.5}}, "model.rope_beta_fast"),
        ("deepseek_v3", {"rope_scaling": {"type": "yarn", "factor": -1.0}}, "model.rope_scaling_factor"),
        ("deepseek_v3", {"rope_interleave": False}, "config.json: rope_interleave"),
        ("deepseek_v3", {"rms_norm_eps": 1e-5}, "config.json: rms_norm_eps"),
        ("deepseek_v3", {"scoring_func": "softmax"}, "config.json: scoring_func"),
        ("deepseek_v3", {"n_shared_experts": 0}, "config.json: n_shared_experts"),
        ("deepseek_v3", {"attention_bias": True}, "config.json: attention_bias"),
        ("deepseek_v3", {"num_experts_per_tok": 1}, "model.top_k: a top-1 DeepSeek-V3 computes differently"),
    ],
    ids=["top-1", "sliding-window", "attention-bias", "moe-layer-pattern", "longrope", "yarn-mscale-all-dim",
         "yarn-no-truncate", "yarn-beta-fast-below-slow", "yarn-negative-factor",
         "deepseek-rope-not-interleaved", "deepseek-eps", "deepseek-softmax", "deepseek-no-shared",
         "deepseek-attention-bias", "deepseek-top-1"],
)  # fmt: skip
def test_import_refuses_a_config_meshrun_cannot_represent(tmp_path, capsys, fam, change, text):
    """One line, exit 2, nothing written: a layer pattern that is not first dense layers then groups of
    moe_every (MoE at layers 0 and 2 of 3), and the variants meshrun does not compute."""
    src = _copy(fam, tmp_path)
    cfg = json.loads((src / "config.json").read_text()) | change
    (src / "config.json").write_text(json.dumps(cfg))
    rc, err = _import_rc(capsys, src, tmp_path / "run")
    assert rc == 2 and text in _one_line(err), err
    assert not (tmp_path / "run").exists()


def test_deepseek_multi_token_prediction_layer_is_dropped_with_a_note(tmp_path, capsys):
    """A DeepSeek-V3 checkpoint with its multi-token-prediction layer (model.layers.{n}.*,
    num_nextn_predict_layers=1): imported without it, one note on stderr; the export's config.json
    says num_nextn_predict_layers=0 (no such layer written)."""
    from meshrun.hf.safetensors_io import write

    src = _copy("deepseek_v3", tmp_path)
    st = SafeTensors(src)
    tensors = {k: np.array(st.get(k)) for k in st.keys()}  # copies: the file is rewritten below
    del st
    mtp = {k.replace("layers.2.", "layers.3."): v for k, v in tensors.items() if k.startswith("model.layers.2.")}
    mtp["model.layers.3.eh_proj.weight"] = np.ones((32, 64), np.float32)
    write(src / "model.safetensors", tensors | mtp)
    cfg = json.loads((src / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (src / "config.json").write_text(json.dumps(cfg))
    rc, err = _import_rc(capsys, src, tmp_path / "run")
    note = [ln for ln in err.splitlines() if "note:" in ln]
    assert rc == 0 and len(note) == 1 and "num_nextn_predict_layers=1" in note[0] and "model.layers.3.*" in note[0]
    export_hf(tmp_path / "run", tmp_path / "out", quiet=True)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert SafeTensors(tmp_path / "out").keys() == sorted(tensors)


# ------------------------------------------------------------------ tokenizer travels


def test_export_writes_the_training_data_tokenizer(llama, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "tokenizer.json").write_text('{"model": {"type": "WordLevel"}}')
    (data / "manifest.json").write_text(json.dumps({"eos": "</s>"}))
    cfg, params, _ = load_params(llama, quiet=True)
    meta = {"model": to_dict(cfg), "init_params": str(llama / "hf_import")}
    meta["data"] = {"kind": "prepared", "path": str(data)}
    with Checkpointer(tmp_path / "run", CheckpointConfig(async_save=False), meta=meta) as ck:
        ck.save(1, {"params": params}, force=True)
    export_hf(tmp_path / "run", tmp_path / "out", quiet=True)
    assert (tmp_path / "out" / "tokenizer.json").read_text() == (data / "tokenizer.json").read_text()
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["eos_token"] == "</s>"


def test_padded_ids_are_never_data():
    """Synthetic data of a padded model (vocab 128, 100 ids used) draws only the 100 ids; token data
    holding a padded id is refused (loop.py passes model.vocab_used)."""
    from meshrun.config import DataConfig
    from meshrun.data.datasets import make_dataset

    ds = make_dataset(DataConfig(kind="synthetic"), vocab=128, vocab_used=100, seq_len=64, global_batch=64)
    tokens, labels = ds.batch(0)[:2]
    assert int(np.max(tokens)) < 100 and int(np.max(labels)) < 100
    assert int(np.max(tokens)) >= 90  # the whole used range is drawn


def test_a_transposed_tensor_is_named_not_config_json(tmp_path, capsys):
    src = _copy("llama2", tmp_path)
    f = src / "model.safetensors"
    header, start = read_header(f)
    name = "model.layers.0.mlp.down_proj.weight"
    rows, cols = header[name]["shape"]
    assert rows != cols
    header[name]["shape"] = [cols, rows]  # the same bytes, stored as the transpose
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    data = f.read_bytes()[start:]
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    rc, err = _import_rc(capsys, src, tmp_path / "run")
    line = _one_line(err)
    assert rc == 2 and name in line and "stored transposed" in line and "config.json:" not in line, line
    assert not (tmp_path / "run").exists()
