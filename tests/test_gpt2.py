"""The gpt2 family: one-device parity of losses, gradients and updated parameters over layouts
(pipe/data/tensor, ZeRO 0-3, schedules 1f1b/interleaved/zb-h1), the family's config checks."""

import dataclasses
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from meshrun_models.gpt2 import model as gpt2
from meshrun_models.gpt2.config import Gpt2Config
from meshrun_models.layers import arrays
from meshrun_models.llama.config import LlamaConfig
from test_train import SMALL, assert_same, first_grads, reference, run_steps

from meshrun.config import ModelConfig, load_config
from meshrun.errors import ConfigError
from meshrun.family import contract, registry
from meshrun.runtime.mesh import build_mesh

CONFIG = "tiny_gpt2_cpu.yaml"


def _cfg(over):
    return load_config(f"configs/{CONFIG}", [*SMALL, *over])


def _steps_match(over):
    assert_same(run_steps(_cfg(over)), reference(CONFIG))


# Default runtime: three representative layouts; the rest are marked slow.
@pytest.mark.parametrize("over", [
    [],  # data2 . pipe2 . tensor2, 1F1B, ZeRO-0
    ["mesh.pipe=1", "mesh.data=4", "train.zero=3"],
    ["pipeline.schedule=zb-h1", "train.zero=1"],
])  # fmt: skip
def test_training_matches_one_device(over):
    """3 optimizer steps on 8 devices equal one device: losses and every updated parameter."""
    _steps_match(over)


@pytest.mark.slow
@pytest.mark.parametrize("over", [
    ["train.zero=1"],
    ["train.zero=2"],
    ["train.zero=3", "pipeline.layers_per_stage=[3,1]"],
    ["pipeline.schedule=interleaved", "pipeline.virtual=2"],
    ["pipeline.schedule=zb-h1"],
    ["mesh.pipe=4", "mesh.data=1", "mesh.tensor=2"],
    ["mesh.pipe=1", "mesh.data=2", "mesh.tensor=4", "pipeline.microbatches=2"],
    ["mesh.pipe=1", "mesh.data=4", "train.zero=2", "model.remat=selective"],
    ["model.remat=full", "train.zero=3"],
])  # fmt: skip
def test_training_matches_one_device_more_layouts(over):
    _steps_match(over)


def full_batch_reference(cfg, tok, lab):
    """Plain `jax.value_and_grad` of the gpt2 loss on the whole batch, one device, no microbatches."""
    fns = registry.get("gpt2").model_fns(cfg.model)
    params = jax.device_put(arrays(gpt2.init_params(cfg.model, cfg.train.seed)), jax.devices()[0])
    loss_fn = lambda p: contract.loss_fn(fns, p, tok, lab)
    (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    return float(loss), jax.device_get(grads), jax.device_get(metrics)


@pytest.mark.parametrize("over", [[], ["mesh.pipe=1", "mesh.data=2", "mesh.tensor=2", "pipeline.microbatches=2"]])
def test_gradients_match_full_batch_value_and_grad(over):
    """The step's loss and every gradient (pipeline or microbatch scan) equal a full-batch value_and_grad."""
    cfg = _cfg(over)
    loss, grads, metrics, (tok, lab) = first_grads(cfg)
    ref_loss, ref, ref_metrics = full_batch_reference(cfg, tok, lab)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert set(metrics) == set(ref_metrics)
    assert jax.tree.structure(grads) == jax.tree.structure(ref)
    for (path, g), r in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref), strict=True):
        if jax.tree_util.keystr(path) == "['layers']['attn']['k_bias']":
            # Exactly zero in exact arithmetic (a key bias adds q.b_k to every logit of a query, which
            # the softmax cancels): both sides hold rounding noise only (~1e-11), so check that.
            assert np.abs(g).max() < 1e-9 and np.abs(r).max() < 1e-9
            continue
        scale = float(np.abs(r).max())
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6 * scale, err_msg=jax.tree_util.keystr(path))


def test_parameters_are_gpt2_shaped():
    cfg = _cfg([]).model
    p = arrays(gpt2.init_params(cfg, 0))
    assert set(p) == {"embed", "pos", "layers", "final_norm"}  # tied: no head
    assert p["pos"]["embedding"].shape == (cfg.max_seq_len, cfg.d_model)
    assert set(p["layers"]["attn"]) == {"q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias"}
    assert set(p["layers"]["mlp"]) == {"up", "up_bias", "down", "down_bias"}
    assert set(p["final_norm"]) == {"scale", "bias"}
    assert p["layers"]["ln_1"]["scale"].shape == (cfg.n_layers, cfg.d_model)


@pytest.mark.parametrize("field, value, msg", [
    ("rope_theta", 500000.0, "model.rope_theta: gpt2 has no such field (got 500000.0); remove it"),
    ("rope_theta", 10000.0, "model.rope_theta: gpt2 has no such field (got 10000.0)"),  # llama's default
    ("n_experts", 0, "model.n_experts: gpt2 has no such field (got 0)"),  # llama's default
    ("sliding_window", 8, "model.sliding_window: gpt2 has no such field"),
    ("mlp", "swiglu", "model.mlp: gpt2 has no such field (got 'swiglu'); remove it (gpt2's mlp is always 'gelu')"),
    ("tie_embeddings", False, "model.tie_embeddings: gpt2 has no such field (got False)"),
    ("mlp", "gelu", None),  # what gpt2 always does: an old config may state it
    ("tie_embeddings", True, None),
])  # fmt: skip
def test_a_field_gpt2_does_not_have_is_refused_naming_it(field, value, msg):
    over = [f"model.{field}={value}"]
    if msg is None:
        assert load_config(f"configs/{CONFIG}", over).model == load_config(f"configs/{CONFIG}").model
    else:
        with pytest.raises(ConfigError, match=re.escape(msg)):
            load_config(f"configs/{CONFIG}", over)


@pytest.mark.parametrize("field", ["model.mlp=swiglu", "model.tie_embeddings=false"])
def test_cli_refuses_llama_fields_on_gpt2(field, tmp_path, capsys):
    """`meshrun train configs/tiny_gpt2_cpu.yaml model.mlp=swiglu` trained the gelu model: now exit 2."""
    from meshrun.cli.main import main

    assert main(["train", f"configs/{CONFIG}", field, f"train.run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert f"{field.split('=')[0]}: gpt2 has no such field" in err and not list(tmp_path.iterdir())


def test_grouped_query_attention_is_refused_and_llama_accepts_its_fields():
    with pytest.raises(ConfigError, match=r"model.n_kv_heads: .*gpt2.* \(got 2\); set it to model.n_heads=4"):
        Gpt2Config(n_kv_heads=2)
    cfg = load_config(None, ["model.rope_theta=500000.0", "model.n_experts=4"]).model
    assert isinstance(cfg, LlamaConfig) and cfg.rope_theta == 500000.0 and cfg.context_attention
    assert type(load_config(f"configs/{CONFIG}").model) is Gpt2Config and not Gpt2Config.context_attention


def test_family_configs_hold_only_their_own_fields():
    """The config class carries what the planner and the start-up block read about the family."""
    gpt2_fields = {f.name for f in dataclasses.fields(Gpt2Config)}
    shared = {f.name for f in dataclasses.fields(ModelConfig)}
    llama_fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    assert gpt2_fields == shared and {"mlp", "rope_theta", "n_experts"} <= llama_fields
    cfg = load_config(f"configs/{CONFIG}").model
    assert (cfg.mlp, cfg.tie_embeddings, cfg.n_experts, cfg.is_moe) == ("gelu", True, 0, False)
    assert registry.get("gpt2").model_fns(cfg).context is cfg.context_attention is False
    with pytest.raises(TypeError, match="shared base"):
        ModelConfig()


# ---------------------------------------------------------------- Hugging Face GPT2LMHeadModel

HF_CONFIG = {
    "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 100, "n_embd": 32, "n_layer": 2,
    "n_head": 4, "n_inner": None, "n_positions": 64, "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True, "torch_dtype": "float32",
}  # fmt: skip


def make_hf_gpt2(directory, seed=0, transform=None):
    """A tiny GPT2LMHeadModel directory in transformers' layout (Conv1D weights [in, out], fused c_attn,
    lm_head tied so not saved, old-style attn.bias buffers present), every tensor random.
    `transform(tensors)`: the dict written instead (renamed, transposed, retyped)."""
    import json

    from meshrun.hf.safetensors_io import write_sharded

    c, rng = HF_CONFIG, np.random.default_rng(seed)
    d, f, v, n = c["n_embd"], 4 * c["n_embd"], c["vocab_size"], c["n_positions"]
    r = lambda *s, scale=0.08, base=0.0: (base + scale * rng.standard_normal(s)).astype(np.float32)
    t = {"transformer.wte.weight": r(v, d), "transformer.wpe.weight": r(n, d)}
    for i in range(c["n_layer"]):
        h = f"transformer.h.{i}."
        t |= {
            h + "ln_1.weight": r(d, scale=0.2, base=1.0), h + "ln_1.bias": r(d, scale=0.3),
            h + "attn.bias": np.tril(np.ones((1, 1, n, n), np.float32)),
            h + "attn.c_attn.weight": r(d, 3 * d), h + "attn.c_attn.bias": r(3 * d, scale=0.3),
            h + "attn.c_proj.weight": r(d, d), h + "attn.c_proj.bias": r(d, scale=0.3),
            h + "ln_2.weight": r(d, scale=0.2, base=1.0), h + "ln_2.bias": r(d, scale=0.3),
            h + "mlp.c_fc.weight": r(d, f), h + "mlp.c_fc.bias": r(f, scale=0.3),
            h + "mlp.c_proj.weight": r(f, d), h + "mlp.c_proj.bias": r(d, scale=0.3),
        }  # fmt: skip
    t |= {"transformer.ln_f.weight": r(d, scale=0.2, base=1.0), "transformer.ln_f.bias": r(d, scale=0.3)}
    write_sharded(directory, (transform(t) if transform else t).items(), 30_000)
    (directory / "config.json").write_text(json.dumps(c))
    return t


def numpy_gpt2_logits(t, tokens):
    """transformers' GPT2LMHeadModel forward written out in float64 numpy (modeling_gpt2: Conv1D
    x @ W + b, c_attn split into q, k, v, scores / sqrt(head_dim), causal softmax, gelu_new, pre-LN,
    ln_f, logits = h @ wte^T) -- an independent reference for when transformers is not installed."""
    c = HF_CONFIG
    n_head, eps = c["n_head"], c["layer_norm_epsilon"]
    g = {k: a.astype(np.float64) for k, a in t.items()}

    def ln(x, p):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * g[p + ".weight"] + g[p + ".bias"]

    b, s = tokens.shape
    x = g["transformer.wte.weight"][tokens] + g["transformer.wpe.weight"][:s][None]
    causal = np.tril(np.ones((s, s), bool))
    for i in range(c["n_layer"]):
        h = f"transformer.h.{i}."
        qkv = ln(x, h + "ln_1") @ g[h + "attn.c_attn.weight"] + g[h + "attn.c_attn.bias"]
        q, k, v = (a.reshape(b, s, n_head, -1).transpose(0, 2, 1, 3) for a in np.split(qkv, 3, axis=-1))
        w = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
        w = np.where(causal, w, -np.inf)
        w = np.exp(w - w.max(-1, keepdims=True))
        o = (w / w.sum(-1, keepdims=True)) @ v
        o = o.transpose(0, 2, 1, 3).reshape(b, s, -1)
        x = x + o @ g[h + "attn.c_proj.weight"] + g[h + "attn.c_proj.bias"]
        u = ln(x, h + "ln_2") @ g[h + "mlp.c_fc.weight"] + g[h + "mlp.c_fc.bias"]
        u = 0.5 * u * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (u + 0.044715 * u**3)))
        x = x + u @ g[h + "mlp.c_proj.weight"] + g[h + "mlp.c_proj.bias"]
    return ln(x, "transformer.ln_f") @ g["transformer.wte.weight"].T


def _gpt2_logits(cfg, params, tokens):
    fns = registry.get("gpt2").model_fns(cfg)
    x, _ = fns.apply_layers(params["layers"], fns.embed(params, tokens))
    return gpt2.logits(params, x, cfg)


def test_hf_import_matches_reference_and_export_round_trips_bit_exactly(tmp_path):
    from meshrun.config import MeshConfig
    from meshrun.hf.convert import family_of
    from meshrun.hf.io import export_hf, import_hf, load_params
    from meshrun.hf.safetensors_io import SafeTensors

    src = make_hf_gpt2(tmp_path / "hf")
    assert family_of(HF_CONFIG) == "gpt2"
    res = import_hf(tmp_path / "hf", tmp_path / "run", mesh=build_mesh(MeshConfig(tensor=2, data=4)))
    assert res["family"] == "gpt2" and res["vocab"] == 128
    cfg, params, _ = load_params(tmp_path / "run")
    assert cfg.family == "gpt2" and cfg.d_ff == 128 and cfg.n_kv_heads == cfg.n_heads == 4
    tokens = np.random.default_rng(1).integers(0, 100, (2, 16)).astype(np.int32)
    got = np.asarray(jax.jit(lambda p, t: _gpt2_logits(cfg, p, t))(params, tokens))
    ref = numpy_gpt2_logits(src, tokens)
    assert np.max(np.abs(got[..., :100] - ref)) <= 1e-4  # the llama fixtures' tolerance (tests/test_hf.py)
    assert np.all(got[..., 100:] == 0.0)  # padded vocab rows are zero

    export_hf(tmp_path / "run", tmp_path / "out", max_shard_bytes=30_000)
    out = SafeTensors(tmp_path / "out")
    want = {k for k in src if not k.endswith(".attn.bias")}  # the mask buffers are not weights
    assert set(out.keys()) == want
    for k in want:
        a, b = src[k], out.get(k)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), k
    import_hf(tmp_path / "out", tmp_path / "again", mesh=build_mesh(MeshConfig(data=8)))
    cfg2, params2, _ = load_params(tmp_path / "again")
    assert cfg2 == cfg
    for (k, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves_with_path(params2)
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), k


@pytest.mark.skipif(
    not all(__import__("importlib").util.find_spec(m) for m in ("torch", "transformers")),
    reason="torch/transformers not installed",
)
def test_hf_export_loads_in_transformers(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from meshrun.config import MeshConfig
    from meshrun.hf.io import export_hf, import_hf

    src = make_hf_gpt2(tmp_path / "hf")
    tokens = np.random.default_rng(1).integers(0, 100, (2, 16))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens).long()).logits.numpy()
    assert np.max(np.abs(ref - numpy_gpt2_logits(src, tokens))) <= 1e-4  # the numpy reference is transformers'
    import_hf(tmp_path / "hf", tmp_path / "run", mesh=build_mesh(MeshConfig(data=8)))
    export_hf(tmp_path / "run", tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        assert np.max(np.abs(model(torch.from_numpy(tokens).long()).logits.numpy() - ref)) <= 1e-5


def test_hf_config_errors_name_the_field():
    from meshrun.hf.convert import model_config

    with pytest.raises(ConfigError, match="activation_function: .*'relu'.*gelu_new"):
        model_config({**HF_CONFIG, "activation_function": "relu"})
    with pytest.raises(ConfigError, match="architectures: unsupported model architecture"):
        model_config({"architectures": ["BertModel"], "model_type": "bert"})


def test_gpt2_import_into_a_llama_config_names_both_families(tmp_path, capsys):
    """checkpoint.init_params of a gpt2 import with a llama model: one line naming both families
    (not a tensor 'with shape None'), exit 2, before the run dir exists."""
    from meshrun.cli.main import main
    from meshrun.config import MeshConfig
    from meshrun.hf.io import import_hf

    make_hf_gpt2(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "gpt2", mesh=build_mesh(MeshConfig(data=8)))
    capsys.readouterr()
    over = [f"checkpoint.init_params={tmp_path / 'gpt2' / 'hf_import'}", f"train.run_dir={tmp_path / 'run'}"]
    config = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml")
    assert main(["train", "--quiet", config, *over]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("meshrun train: error: checkpoint.init_params: it holds a gpt2 model, the config's ")
    assert "model.family is llama" in line and "set model.family=gpt2" in line
    assert not (tmp_path / "run").exists()


def test_gpt2_files_without_the_transformer_prefix_import_the_same(tmp_path):
    """GPT2Model's layout (`h.0.attn...`, `wte.weight`, plus `attn.masked_bias` buffers): same logits."""
    from meshrun.config import MeshConfig
    from meshrun.hf.io import import_hf, load_params

    def unprefixed(t):
        out = {k.removeprefix("transformer."): v for k, v in t.items()}
        return out | {f"h.{i}.attn.masked_bias": np.array(-1e4, np.float32) for i in range(HF_CONFIG["n_layer"])}

    src = make_hf_gpt2(tmp_path / "hf", transform=unprefixed)
    import_hf(tmp_path / "hf", tmp_path / "run", mesh=build_mesh(MeshConfig(data=8)))
    cfg, params, _ = load_params(tmp_path / "run")
    tokens = np.random.default_rng(1).integers(0, 100, (2, 16)).astype(np.int32)
    got = np.asarray(jax.jit(lambda p, t: _gpt2_logits(cfg, p, t))(params, tokens))
    assert np.max(np.abs(got[..., :100] - numpy_gpt2_logits(src, tokens))) <= 1e-4


@pytest.mark.parametrize("fault", ["c_attn_transposed", "norm_int8"])
def test_gpt2_import_refuses_a_transposed_or_integer_tensor(tmp_path, capsys, fault):
    from meshrun.cli.main import main

    def broken(t):
        t = dict(t)
        if fault == "c_attn_transposed":  # [3D, D] instead of Conv1D's [D, 3D], in every layer
            for k in [k for k in t if k.endswith("attn.c_attn.weight")]:
                t[k] = np.ascontiguousarray(t[k].T)
        else:
            t["transformer.ln_f.weight"] = t["transformer.ln_f.weight"].astype(np.int8)
        return t

    make_hf_gpt2(tmp_path / "hf", transform=broken)
    rc = main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "run"), "mesh.data=8"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "Traceback" not in err, err
    if fault == "c_attn_transposed":
        assert "transformer.h.0.attn.c_attn.weight" in err and "(96, 32)" in err, err
    else:
        assert "transformer.ln_f.weight is stored as int8, the model needs floating point" in err
    assert not (tmp_path / "run").exists()
