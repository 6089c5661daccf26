"""Hugging Face import/export against transformers' own forward (fixtures: tests/fixtures/hf/make_fixtures.py).

Per family: import-hf -> meshrun logits on the fixture tokens vs transformers' fp32 logits (max abs
<= 1e-4); export-hf -> the safetensors hold bit-for-bit the tensors that were imported; with
transformers installed, the exported directory loads there and gives the reference logits again.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from meshrun_models import apply_layers, embed, logits
from meshrun_models.llama.config import LlamaConfig

from meshrun.checkpoint.params import restore_params
from meshrun.cli.main import main
from meshrun.config import MeshConfig, ModelConfig, load_config
from meshrun.errors import ConfigError
from meshrun.hf.convert import model_config
from meshrun.hf.io import export_hf, import_hf, load_params
from meshrun.hf.safetensors_io import SafeTensors
from meshrun.runtime.mesh import build_mesh

FIX = Path(__file__).parent / "fixtures" / "hf"
FAMILIES = ("llama2", "llama31", "mistral", "qwen2", "mixtral", "qwen3_moe", "deepseek_v3", "deepseek_v3_yarn",
            "qwen3_moe_yarn")  # fmt: skip
MOE = ("mixtral", "qwen3_moe", "deepseek_v3", "deepseek_v3_yarn", "qwen3_moe_yarn")
HAVE_TRANSFORMERS = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
TOL = 1e-4


def _forward(cfg: ModelConfig, params, tokens):
    x, _ = apply_layers(params["layers"], embed(params, tokens, cfg), cfg)
    return logits(params, x, cfg)


def _load(run: Path) -> tuple[ModelConfig, dict]:
    """The imported params of `run` on one device, and their ModelConfig."""
    cfg, params, _ = load_params(run)
    return cfg, params


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Every family imported once (mesh: tensor 2 x data 4, so each weight is really split on import)."""
    mesh = build_mesh(MeshConfig(tensor=2, data=4))
    out = {}
    for fam in FAMILIES:
        run = tmp_path_factory.mktemp(fam)
        res = import_hf(FIX / fam, run, mesh=mesh)
        out[fam] = (run, res)
    return out


@pytest.mark.parametrize("fam", FAMILIES)
def test_logits_match_transformers(imported, fam):
    run, res = imported[fam]
    cfg, params = _load(run)
    assert cfg.vocab == 128 and res["vocab"] == 128  # 100 padded on import
    tokens = np.load(FIX / "tokens.npy")
    ref = np.load(FIX / fam / "logits.npy")
    got = np.asarray(jax.jit(lambda p, t: _forward(cfg, p, t))(params, tokens))
    err = float(np.max(np.abs(got[..., :100] - ref)))
    print(f"{fam}: max |logit - transformers| = {err:.2e}")
    assert err <= TOL
    assert np.all(got[..., 100:] == 0.0)  # padded vocab rows are zero


@pytest.mark.parametrize("fam", MOE)
def test_sharded_logits_match_transformers(imported, fam):
    """The MoE imports run split over tensor 2 x expert 2 (heads, expert widths and the
    experts themselves sharded, the all_to_all dispatch) give transformers' logits too."""
    from meshrun.family import registry
    from meshrun.hf.io import flat_tree, nest_tree
    from meshrun.parallel.sharding import compute_rules, param_rules, tree_shardings, use_rules

    cfg, params = _load(imported[fam][0])
    mesh = build_mesh(MeshConfig(data=1, tensor=2, expert=2), jax.devices()[:4])  # 2 sequences: 2 batch shards
    shardings = flat_tree(tree_shardings(registry.get(cfg.family).abstract_params(cfg), mesh, param_rules(zero=3)))
    placed = nest_tree({k: jax.device_put(v, shardings[k]) for k, v in flat_tree(params).items()})
    tokens = np.load(FIX / "tokens.npy")
    with use_rules(mesh, compute_rules(False)):
        got = np.asarray(jax.jit(lambda p, t: _forward(cfg, p, t))(placed, tokens))
    err = float(np.max(np.abs(got[..., :100] - np.load(FIX / fam / "logits.npy"))))
    print(f"{fam} on tensor 2 x expert 2: max |logit - transformers| = {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("fam", FAMILIES)
def test_export_round_trips_bit_exactly(imported, fam, tmp_path):
    run, _ = imported[fam]
    res = export_hf(run, tmp_path / "out", max_shard_bytes=30_000)
    src, out = SafeTensors(FIX / fam), SafeTensors(tmp_path / "out")
    tied = json.loads((FIX / fam / "config.json").read_text()).get("tie_word_embeddings")
    want = [k for k in src.keys() if not (tied and k == "lm_head.weight")]
    assert out.keys() == want
    for k in want:
        a, b = src.get(k), out.get(k)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), k
    assert len(res["files"]) > 1 and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    # and back in: the re-imported parameters are the first import's, bit for bit
    import_hf(tmp_path / "out", tmp_path / "again", mesh=build_mesh(MeshConfig(data=8)))
    (cfg1, p1), (cfg2, p2) = _load(run), _load(tmp_path / "again")
    assert cfg1 == cfg2
    flat1, flat2 = jax.tree_util.tree_leaves_with_path(p1), jax.tree_util.tree_leaves_with_path(p2)
    assert [k for k, _ in flat1] == [k for k, _ in flat2]
    for (k, a), (_, b) in zip(flat1, flat2):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), k


def test_v4_config_keys_read_like_v5():
    """transformers 4.x writes rope_theta/rope_scaling at the top level, 5.x nests rope_parameters (the
    fixtures carry both)."""
    both = json.loads((FIX / "llama31" / "config.json").read_text())
    v5 = {k: v for k, v in both.items() if k not in ("rope_theta", "rope_scaling")}
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    rp = dict(v5["rope_parameters"])
    v4["rope_theta"] = rp.pop("rope_theta")
    v4["rope_scaling"] = rp
    assert model_config(v4) == model_config(v5) == model_config(both)
    assert model_config(v5).rope_scaling == "llama3" and model_config(v5).rope_original_max_seq_len == 256
    qwen = json.loads((FIX / "qwen2" / "config.json").read_text())
    legacy = {k: v for k, v in qwen.items() if k != "layer_types"} | {"sliding_window": 8, "use_sliding_window": True}
    assert model_config(legacy | {"max_window_layers": 0}).sliding_window == 8  # every layer slides
    assert model_config(legacy | {"max_window_layers": 2}).sliding_window == 0  # none does
    with pytest.raises(ConfigError, match="mix full and sliding"):
        model_config(legacy | {"max_window_layers": 1})


@pytest.mark.parametrize("fam", ["deepseek_v3_yarn", "qwen3_moe_yarn"])
def test_yarn_frequencies_and_factors_match_transformers(fam):
    """YaRN's RoPE frequencies are transformers' (inv_freq.npy: every band, which the fixture's 16
    positions barely turn); its factors are DeepSeek-V3's softmax correction m(1)^2 = (0.1 ln 40 + 1)^2
    with cos/sin unscaled (mscale = mscale_all_dim), and Qwen's derived attention factor 0.1 ln 4 + 1
    on cos/sin; transformers 5's rope_parameters read alike."""
    from meshrun_models.layers import rope_freqs

    hf = json.loads((FIX / fam / "config.json").read_text())
    cfg = model_config(hf)
    assert cfg.rope_scaling == "yarn"
    want = np.load(FIX / fam / "inv_freq.npy")
    np.testing.assert_allclose(np.asarray(rope_freqs(cfg, 2 * len(want))), want, rtol=1e-6)
    a, s = cfg.yarn_scales()
    m = lambda f: 0.1 * np.log(f) + 1
    assert (a, s) == pytest.approx((1.0, m(40) ** 2) if fam.startswith("deepseek") else (m(4), 1.0), rel=1e-12)
    v5 = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_theta")}
    assert model_config(v5 | {"rope_parameters": hf["rope_scaling"] | {"rope_theta": hf["rope_theta"]}}) == cfg


@pytest.mark.parametrize(
    "bad",
    [dict(rope_beta_fast=0.5), dict(rope_beta_slow=0.0), dict(rope_mscale_all_dim=-1.0), dict(rope_scaling_factor=0.0)],
)
def test_yarn_fields_are_checked(bad):
    field = next(iter(bad))
    with pytest.raises(ConfigError, match=f"model.{field}"):
        LlamaConfig(rope_scaling="yarn", **bad)
    LlamaConfig(**bad)  # unused without rope_scaling=yarn: accepted


def test_hub_id_and_bad_dirs_exit_2(tmp_path, capsys):
    assert main(["import-hf", "meta-llama/Llama-3-8B", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hub id" in err[0] and "never the network" in err[0]
    assert main(["import-hf", str(tmp_path / "none"), str(tmp_path / "r")]) == 2
    assert main(["export-hf", str(tmp_path / "none"), str(tmp_path / "o")]) == 2
    bad = tmp_path / "gelu"
    bad.mkdir()
    cfg = json.loads((FIX / "llama2" / "config.json").read_text()) | {"hidden_act": "gelu"}
    (bad / "config.json").write_text(json.dumps(cfg))
    assert main(["import-hf", str(bad), str(tmp_path / "r")]) == 2
    assert "hidden_act" in capsys.readouterr().err


def _word_tokenizer(path: Path, words: list[str]) -> None:
    """A tokenizer.json a model directory could ship (word level, within the tiny model's vocab)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["</s>", "<unk>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))


def test_import_prepare_data_train_with_val_loss(imported, tmp_path):
    """docs/checkpoints.md's commands on files made here: import-hf (the fixture), prepare-data with the
    model's tokenizer, then `meshrun train` from the imported params on another mesh (tensor 2, 2
    devices) with a held-out split and val_loss. Step 0 start, and the first loss is the imported
    model's loss on that batch (a random init would give ~log(vocab))."""
    from meshrun.config import load_config
    from meshrun.data.datasets import global_batch_arrays
    from meshrun.data.tokenize import prepare as prepare_data
    from meshrun.train.loop import prepare, run

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    rng = np.random.default_rng(0)
    (tmp_path / "corpus").mkdir()
    for i in range(12):  # twelve documents of 20-60 words
        (tmp_path / "corpus" / f"d{i}.txt").write_text(" ".join(rng.choice(words, int(rng.integers(20, 60)))))
    _word_tokenizer(tmp_path / "tok", words)
    corpus, data = str(tmp_path / "corpus" / "*.txt"), str(tmp_path / "data")
    summary = prepare_data(corpus, data, tokenizer=str(tmp_path / "tok"), workers=1, quiet=True)
    assert summary["n_docs"] == 12

    src, _ = imported["llama2"]
    over = [
        "mesh.tensor=2",
        "mesh.data=1",
        "train.steps=1",
        "train.global_batch=4",
        "train.seq_len=16",
        f"train.run_dir={tmp_path / 'run'}",
        "data.kind=prepared",
        f"data.path={tmp_path / 'data'}",
        "data.val_fraction=0.25",
        "train.eval_every=1",
        "train.eval_batches=1",
    ]
    cfg = load_config(src / "config.yaml", over)
    assert cfg.checkpoint.init_params == str(src / "hf_import")
    devices = jax.devices()[:2]
    with pytest.raises(ConfigError, match="checkpoint.init_params: .* the model needs"):
        prepare(load_config(src / "config.yaml", [*over, "model.d_ff=32"]), devices)  # before anything is written
    assert not (tmp_path / "run").exists()
    mesh, fns, ds = prepare(cfg, devices)
    tokens, labels = global_batch_arrays(ds, 0, mesh, jax.sharding.PartitionSpec())
    params = restore_params(src / "hf_import", fns.abstract_state.params)
    x = jax.jit(lambda p, t: _forward(cfg.model, p, t))(params, tokens)[..., :100]  # the padded ids take no part
    assert cfg.model.vocab_used == 100
    lse = jax.nn.logsumexp(x, axis=-1)
    want = float(np.mean(lse - np.take_along_axis(np.asarray(x), np.asarray(labels)[..., None], -1)[..., 0]))
    result = run(cfg, devices=devices, quiet=True)
    assert result["step"] == 1
    np.testing.assert_allclose(result["first_loss"], want, rtol=1e-5)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if "val_loss" in r]
    assert len(val) == 1 and np.isfinite(val[0]["val_loss"]) and val[0]["val_loss"] == result["val_loss"]
    np.testing.assert_allclose(val[0]["val_perplexity"], np.exp(val[0]["val_loss"]), rtol=1e-5)
    # a real run's checkpoint exports with its checksums verified (the names export checks are the saved ones)
    from meshrun.hf.io import _restore

    meta = json.loads((tmp_path / "run" / "checkpoints" / "1" / "meta" / "metadata").read_text())
    assert any(k.startswith("params.") for k in meta["checksums"])
    _restore("step", tmp_path / "run" / "checkpoints" / "1", cfg.model, meta["checksums"])
    res = export_hf(tmp_path / "run", tmp_path / "exported", quiet=True)
    assert res["source"].endswith("checkpoints/1")


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="torch/transformers not installed")
@pytest.mark.parametrize("fam", FAMILIES)
def test_exported_loads_in_transformers(imported, fam, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    export_hf(imported[fam][0], tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", torch_dtype=torch.float32).eval()
    tokens = torch.from_numpy(np.load(FIX / "tokens.npy")).long()
    with torch.no_grad():
        got = model(tokens).logits.numpy()
    assert np.max(np.abs(got - np.load(FIX / fam / "logits.npy"))) <= 1e-5


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="torch/transformers not installed")
def test_fixture_script_reproduces_fixtures(tmp_path):
    subprocess.run([sys.executable, str(FIX / "make_fixtures.py"), str(tmp_path)], check=True, capture_output=True)
    for fam in FAMILIES:
        np.testing.assert_allclose(np.load(tmp_path / fam / "logits.npy"), np.load(FIX / fam / "logits.npy"), atol=1e-6)


MIXTRAL = dict(n_experts=4, top_k=2, capacity_factor=2.0, moe_every=1, z_loss_coef=0.0, moe_dispatch="dropless")
NATIVE = {
    "dense": dict(tie_embeddings=True, qkv_bias=True),  # Qwen2
    "moe": dict(MIXTRAL, n_layers=2),  # Mixtral: dropless on import
    # Qwen3-MoE: head norms, narrow experts without renormalisation, a dense layer first and every
    # other layer after it MoE (written as mlp_only_layers [0, 1, 3])
    "qwen3_moe": dict(
        MIXTRAL, n_layers=5, qk_norm=True, moe_d_ff=16, router_norm_topk=False, first_dense_layers=1, moe_every=2
    ),
    # DeepSeek-V3: latent attention without a q latent, sigmoid scores in 2 of 4 groups, a shared
    # expert, balance biases (the balance 'load' state is meshrun's own: zeros, not exported)
    "deepseek_v3": dict(
        MIXTRAL,
        n_layers=3,
        attention="mla",
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        head_dim=4,
        n_kv_heads=4,
        n_experts=8,
        capacity_factor=4.0,
        moe_d_ff=8,
        n_shared_experts=1,
        first_dense_layers=1,
        router_score="sigmoid",
        routed_scaling=2.5,
        balance="bias",
        route_groups=4,
        route_group_limit=2,
    ),  # fmt: skip
}


@pytest.mark.parametrize("kind", NATIVE)
def test_native_model_exports_and_imports_back(tmp_path, kind):
    """A model meshrun made (no Hugging Face config to copy): export-hf writes a config of its own
    (Qwen2 for q/k/v biases, Mixtral or Qwen3-MoE for MoE) that imports back to the same ModelConfig
    and params; with transformers installed it also gives meshrun's logits there."""
    from meshrun_models import abstract_params
    from meshrun_models.layers import arrays

    from meshrun.checkpoint.params import save_params
    from meshrun.config import to_dict

    cfg = LlamaConfig(**{
        **dict(vocab=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=64,
               norm_eps=1e-6, rope_theta=500000.0, rope_scaling="llama3", rope_original_max_seq_len=256),
        **NATIVE[kind],
    })  # fmt: skip
    rng = np.random.default_rng(0)  # every leaf random (biases and norm scales too)
    params = jax.tree.map(lambda a: rng.normal(0.0, 0.1, a.shape).astype(np.float32), arrays(abstract_params(cfg)))
    params = jax.tree_util.tree_map_with_path(
        lambda p, a: np.zeros_like(a) if "'load'" in jax.tree_util.keystr(p) else a, params
    )
    save_params(tmp_path / "run" / "hf_import", params, {"model": to_dict(cfg)})
    export_hf(tmp_path / "run", tmp_path / "out")
    import_hf(tmp_path / "out", tmp_path / "again", vocab_multiple=128)
    cfg2, params2 = _load(tmp_path / "again")
    assert cfg2 == cfg
    for (k, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves_with_path(params2)
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), k
    if HAVE_TRANSFORMERS:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", torch_dtype=torch.float32).eval()
        tokens = np.load(FIX / "tokens.npy")
        with torch.no_grad():
            ref = model(torch.from_numpy(tokens).long()).logits.numpy()
        got = np.asarray(jax.jit(lambda p, t: _forward(cfg, p, t))(params, tokens))
        assert np.max(np.abs(got - ref)) <= TOL


def test_cli_import_export(tmp_path, capsys):
    assert main(["import-hf", str(FIX / "qwen2"), str(tmp_path / "run"), "mesh.data=8"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["family"] == "llama" and res["architecture"] == "qwen2" and res["vocab"] == 128  # as config.yaml
    assert load_config(res["config"]).model.family == res["family"]
    assert res["next"] == f"meshrun train {res['config']} data.kind=synthetic train.steps=10"  # vocab 100 < 256
    assert res["next"] in (tmp_path / "run" / "config.yaml").read_text()
    assert main(["import-hf", str(FIX / "qwen2"), str(tmp_path / "run")]) == 2  # already imported there
    assert "already holds an import" in capsys.readouterr().err
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "out"), "--max-shard-size", "20KB"]) == 0
    files = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["files"]
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is True


def test_bfloat16_checkpoint_round_trips(tmp_path):
    """Real checkpoints are bfloat16: read exactly into float32 masters, written back bit for bit."""
    import ml_dtypes

    from meshrun.hf.safetensors_io import write

    src = SafeTensors(FIX / "llama2")
    bf = {k: np.asarray(src.get(k)).astype(ml_dtypes.bfloat16) for k in src.keys()}
    (tmp_path / "bf").mkdir()
    write(tmp_path / "bf" / "model.safetensors", bf)
    cfg = json.loads((FIX / "llama2" / "config.json").read_text()) | {"dtype": "bfloat16"}
    (tmp_path / "bf" / "config.json").write_text(json.dumps(cfg))
    import_hf(tmp_path / "bf", tmp_path / "run", mesh=build_mesh(MeshConfig(data=8)))
    assert export_hf(tmp_path / "run", tmp_path / "out")["dtype"] == "bfloat16"
    out = SafeTensors(tmp_path / "out")
    assert out.keys() == sorted(bf)
    for k, a in bf.items():
        assert out.get(k).dtype == a.dtype and out.get(k).tobytes() == a.tobytes(), k


def test_checkpoints_written_before_the_new_model_fields_still_resume(tmp_path):
    """qkv_bias, rope_scaling*, sliding_window did not exist before: an older checkpoint's meta lacks
    them and is read as holding their defaults (a real difference is still refused)."""
    from meshrun.checkpoint.state import Checkpointer
    from meshrun.config import CheckpointConfig, to_dict

    new = {"qkv_bias", "sliding_window", "rope_scaling", "rope_scaling_factor", "rope_low_freq_factor"}
    new |= {"rope_high_freq_factor", "rope_original_max_seq_len"}
    old = {k: v for k, v in to_dict(LlamaConfig()).items() if k not in new}
    state = {"w": jax.numpy.zeros(4)}
    with Checkpointer(tmp_path, CheckpointConfig(async_save=False), meta={"model": old}) as ck:
        ck.save(1, state, force=True)
    with Checkpointer(tmp_path, CheckpointConfig(), meta={"model": to_dict(LlamaConfig())}) as ck:
        ck.check_compatible(1, state)
    with Checkpointer(tmp_path, CheckpointConfig(), meta={"model": to_dict(LlamaConfig(qkv_bias=True))}) as ck:
        with pytest.raises(ConfigError, match="model.qkv_bias"):
            ck.check_compatible(1, state)


def test_import_onto_a_mesh_larger_than_the_devices_names_devices(tmp_path):
    """import-hf mesh.tensor=2 on one CPU device without --devices: the line names --devices and the
    degree asked, not mesh.data."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    fixture = Path(__file__).resolve().parent / "fixtures" / "hf" / "llama2"
    r = subprocess.run([sys.executable, "-m", "meshrun.cli", "import-hf", str(fixture), str(tmp_path / "run"),
                        "mesh.tensor=2"], capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("meshrun import-hf: error: --devices: ") and "mesh.tensor=2" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_run_exports_its_master_weights(tmp_path, capsys, recipe):
    """A run trained with model.fp8 exports: the master weights in the dtype asked (the fp8 scaling
    state is not a weight), the same config.json as without fp8, and one note on stderr that
    transformers computes without fp8."""
    import ml_dtypes
    from meshrun_models import abstract_params
    from meshrun_models.layers import arrays

    from meshrun.checkpoint.params import save_params
    from meshrun.config import to_dict

    base = LlamaConfig(vocab=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64)
    cfg = LlamaConfig(**{**to_dict(base), "fp8": recipe, "fp8_first_last_bf16": True})
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.normal(0.0, 0.1, a.shape).astype(np.float32), arrays(abstract_params(cfg)))
    assert "fp8" in params["layers"]  # the run's scaling state rides along with the weights
    save_params(tmp_path / "run" / "hf_import", params, {"model": to_dict(cfg)})
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    err = capsys.readouterr().err
    assert err.count("transformers computes it without fp8") == 1 and f"model.fp8={recipe}" in err
    weights = {k: v for k, v in params.items() if k != "layers"}
    weights["layers"] = {k: v for k, v in params["layers"].items() if k != "fp8"}
    save_params(tmp_path / "plain" / "hf_import", weights, {"model": to_dict(base)})
    export_hf(tmp_path / "plain", tmp_path / "ref", dtype="bfloat16")
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads(
        (tmp_path / "ref" / "config.json").read_text()
    )
    got, ref = SafeTensors(tmp_path / "out"), SafeTensors(tmp_path / "ref")
    assert got.keys() == ref.keys()
    for k in ref.keys():
        assert got.get(k).dtype == ml_dtypes.bfloat16 and got.get(k).tobytes() == ref.get(k).tobytes(), k


@pytest.mark.slow
def test_fp8_fine_tune_of_an_import_creates_its_scaling_state(imported, tmp_path, capsys):
    """A Hugging Face import fine-tuned with model.fp8=delayed and fp8_first_last_bf16: the scaling
    state the import lacks (amax history, histogram, on/off masks: no random numbers) is created
    fresh with one note, and the run equals one started from the import's weights with the init's
    scaling state put in by hand; export-hf --step of its checkpoint writes the import's config.json."""
    from meshrun.checkpoint.params import save_params
    from meshrun.config import to_dict
    from meshrun.family import registry
    from meshrun.train.loop import run

    src, _ = imported["llama2"]
    fp8 = ["model.fp8=delayed", "model.fp8_first_last_bf16=true"]
    over = ["mesh.data=2", "mesh.tensor=1", "train.steps=2", "train.global_batch=4", "train.seq_len=16",
            "data.kind=synthetic", *fp8]  # fmt: skip
    cfg = load_config(src / "config.yaml", [*over, f"train.run_dir={tmp_path / 'run'}"])
    capsys.readouterr()
    run(cfg, devices=jax.devices()[:2])
    err = capsys.readouterr().err
    assert err.count("note: checkpoint.init_params has no") == 1, err
    assert "layers.fp8.hist" in err and "layers.fp8.on" in err and "layers.wq" not in err

    _, params = _load(src)  # the reference: the init's scaling state put in by hand
    params["layers"]["fp8"] = registry.get("llama").init_params(cfg.model, 0)["layers"]["fp8"]
    save_params(tmp_path / "hand", params, {"model": to_dict(cfg.model)})
    ref = load_config(src / "config.yaml", [*over, f"train.run_dir={tmp_path / 'ref'}",
                                             f"checkpoint.init_params={tmp_path / 'hand'}"])  # fmt: skip
    run(ref, devices=jax.devices()[:2], quiet=True)
    rows = lambda d: [json.loads(s) for s in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
    losses = lambda d: [(r["step"], r["loss"], r["grad_norm"]) for r in rows(d) if "loss" in r]
    assert len(losses("run")) == 2 and losses("run") == losses("ref")

    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "out"), "--step", "2"]) == 0
    assert "transformers computes it without fp8" in capsys.readouterr().err
    export_hf(src, tmp_path / "import_out", quiet=True)
    read = lambda d: json.loads((tmp_path / d / "config.json").read_text())
    assert read("out") == read("import_out")
