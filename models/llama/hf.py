"""The llama family's Hugging Face tables: transformers Llama 2/3/3.1, Mistral, Qwen2, Mixtral, Qwen3-MoE and
DeepSeek-V3 config.json <-> ModelConfig, and tensor names <-> meshrun parameter paths (the generic reading,
placement and writing is meshrun/hf/). The adapter on `FAMILY.hf`.

Layout facts, checked against transformers' forward by tests/test_hf.py:
- RoPE: transformers' checkpoints are already in the rotate-half layout (their conversion script
  permuted Meta's interleaved q/k rows), which is what models/layers.rope uses: no permutation;
  DeepSeek-V3 keeps interleaved RoPE rows (rope_interleave), reordered on import ('t_rope', 'col_rope').
- GQA: query head n uses kv head n // G in both (transformers' repeat_kv; meshrun's [K, G] split).
- Linear weights are [out, in] in transformers, [in, ...] here; heads split out of the out dim.
- MoE imports route dropless, capacity_factor = n_experts / top_k (nothing dropped if switched).
"""

from __future__ import annotations

import math
from typing import Any

from meshrun_models.llama.config import LlamaConfig

from meshrun.config import ModelConfig
from meshrun.errors import ConfigError

FAMILIES = {  # transformers architecture -> model_type
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
ARCH = {v: k for k, v in FAMILIES.items()}
ARCHITECTURES, MODEL_TYPES = tuple(FAMILIES), tuple(ARCH)  # what this family imports
FIELD = "MODEL_DIR/config.json"


def family_of(hf: dict) -> str:
    """The checkpoint's own family name (llama, mistral, qwen2, mixtral): by architecture, else model_type."""
    for a in hf.get("architectures") or []:
        if a in FAMILIES:
            return FAMILIES[a]
    return hf["model_type"]


def _rope(hf: dict) -> dict[str, Any]:
    """rope_theta / rope_scaling (transformers 4.x keys) or rope_parameters (5.x) -> ModelConfig fields."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if kind == "llama3":
        out |= {
            "rope_scaling": "llama3",
            "rope_scaling_factor": float(scaling["factor"]),
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
            "rope_original_max_seq_len": int(scaling["original_max_position_embeddings"]),
        }
    elif kind == "yarn":
        out |= _yarn(scaling, hf)
    elif kind != "default":
        raise ConfigError(f"{FIELD}: rope_scaling", kind, "meshrun supports rope types default, llama3 and yarn")
    return out


def _yarn(scaling: dict, hf: dict) -> dict[str, Any]:
    """YaRN's parameters (transformers' defaults for the unset ones: original_max = max_position_embeddings,
    beta_fast 32, beta_slow 1); its attention factor m(mscale) / m(mscale_all_dim) when both are set, m(x) =
    0.1 x ln(factor) + 1 (DeepSeek-V3: 1.0), else the given one or 0 (meshrun derives m(1), as transformers)."""
    if scaling.get("truncate", True) is not True:
        raise ConfigError(f"{FIELD}: rope_scaling.truncate", scaling["truncate"], "meshrun's YaRN truncates: use true")
    if scaling.get("attention_factor") is not None and not scaling["attention_factor"] > 0:
        raise ConfigError(f"{FIELD}: rope_scaling.attention_factor", scaling["attention_factor"], "use a positive one")
    get = lambda k, default: float(scaling.get(k) or default)
    f, ms, ma = float(scaling["factor"]), get("mscale", 0), get("mscale_all_dim", 0)
    m = lambda x: 1.0 if f <= 1 else 0.1 * x * math.log(f) + 1.0
    a = scaling.get("attention_factor")
    a = float(a) if a is not None else float(m(ms) / m(ma)) if ms and ma else 0.0
    n0 = scaling.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 4096)
    return {
        "rope_scaling": "yarn", "rope_scaling_factor": f, "rope_original_max_seq_len": int(n0),
        "rope_beta_fast": get("beta_fast", 32), "rope_beta_slow": get("beta_slow", 1), "rope_attention_factor": a,
        "rope_mscale_all_dim": ma,
    }  # fmt: skip


def _window(hf: dict, fam: str) -> int:
    """Sliding window of every layer (0: full causal). transformers 5 lists `layer_types`; 4.x Qwen2
    slides in layers >= max_window_layers when use_sliding_window. Mixed layers are not supported."""
    w = hf.get("sliding_window") or 0
    types = set(hf.get("layer_types") or ())
    if not types and fam == "qwen2":
        n = hf["num_hidden_layers"]
        first = min(hf.get("max_window_layers", 0), n) if hf.get("use_sliding_window") and w else n
        types = ({"full_attention"} if first > 0 else set()) | ({"sliding_attention"} if first < n else set())
    if not types:
        return int(w)
    if types == {"full_attention"}:
        return 0
    if types == {"sliding_attention"} and w:
        return int(w)
    raise ConfigError(
        f"{FIELD}: layer_types",
        sorted(types),
        "meshrun applies one attention kind to every layer: all full or all sliding_attention",
        "layers mix full and sliding-window attention",
    )


def model_config(hf: dict, vocab_multiple: int = 128) -> ModelConfig:
    """ModelConfig of a transformers config.json dict (vocab padded to a multiple of `vocab_multiple`)."""
    fam = family_of(hf)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{FIELD}: hidden_act", act, "meshrun's SwiGLU uses silu")
    for k in ("attention_bias", "mlp_bias"):
        if fam in ("llama", "mistral", "qwen3_moe", "deepseek_v3") and hf.get(k):
            raise ConfigError(f"{FIELD}: {k}", True, "meshrun has q/k/v biases only (Qwen2); use a model without")
    n_heads = hf["num_attention_heads"]
    fields: dict[str, Any] = dict(
        vocab=-(-hf["vocab_size"] // vocab_multiple) * vocab_multiple,
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        d_ff=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 4096),
        mlp="swiglu",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=fam == "qwen2",
        sliding_window=int(_window(hf, fam)),
        **_rope(hf),
    )
    if fields.get("rope_mscale_all_dim") and fam != "deepseek_v3":
        raise ConfigError(
            f"{FIELD}: rope_scaling.mscale_all_dim", fields["rope_mscale_all_dim"], "import it without mscale_all_dim",
            f"meshrun's mscale_all_dim also scales the softmax (DeepSeek-V3), which transformers' {ARCH[fam]} does not",
        )  # fmt: skip
    if fam == "mixtral":
        aux = hf.get("router_aux_loss_coef", 0.02)
        fields |= _moe_fields(hf["num_local_experts"], hf["num_experts_per_tok"], True, aux)
    elif fam == "qwen3_moe":
        fields |= _qwen3_moe_fields(hf)
    elif fam == "deepseek_v3":
        fields |= _deepseek_v3_fields(hf) | _mla_fields(hf)
    return LlamaConfig(**fields)


def _moe_fields(e: int, k: int, norm_topk: bool, aux: float, arch: str = "Mixtral") -> dict[str, Any]:
    """Routed-expert fields shared by the MoE architectures: dropless (transformers drops no token)."""
    if k == 1 and norm_topk:  # models/router.py renormalises the gates only when k > 1
        raise ConfigError(
            "model.top_k", 1, f"use top_k >= 2 for a model exchanged with transformers as a {arch}",
            f"a top-1 {arch} computes differently in transformers (its one gate is renormalised to 1.0) "
            "and in meshrun (the expert is scaled by its gate probability)",
        )  # fmt: skip
    return dict(
        n_experts=e,
        top_k=k,
        router_norm_topk=norm_topk,
        moe_dispatch="dropless",
        capacity_factor=float(e) / k,  # used only if a user switches to capacity routing: nothing dropped
        moe_every=1,
        aux_loss_coef=float(aux),
        z_loss_coef=0.0,
    )


def _qwen3_moe_fields(hf: dict) -> dict[str, Any]:
    """Qwen3-MoE: q/k head norms, narrow experts; layer i is MoE unless in mlp_only_layers or
    (i + 1) % decoder_sparse_step != 0, which meshrun holds as first_dense_layers + moe_every."""
    if hf.get("use_sliding_window"):
        raise ConfigError(f"{FIELD}: use_sliding_window", True, "import a Qwen3-MoE without sliding windows")
    n, step, only = hf["num_hidden_layers"], int(hf.get("decoder_sparse_step", 1)), hf.get("mlp_only_layers") or []
    e = int(hf["num_experts"])
    moe = [i not in only and e > 0 and (i + 1) % step == 0 for i in range(n)]
    for k in range(1, n + 1):
        for f in range(n):
            if (n - f) % k == 0 and moe == [i >= f and (i - f) % k == k - 1 for i in range(n)]:
                norm, aux = bool(hf.get("norm_topk_prob", False)), hf.get("router_aux_loss_coef", 0.001)
                fields = _moe_fields(e, hf["num_experts_per_tok"], norm, aux, "Qwen3-MoE")
                return fields | dict(qk_norm=True, moe_d_ff=hf["moe_intermediate_size"], first_dense_layers=f,
                                     moe_every=k)  # fmt: skip
    raise ConfigError(
        f"{FIELD}: mlp_only_layers", only,
        "meshrun's layers are some dense ones, then groups of (decoder_sparse_step - 1) dense layers and an MoE one",
        f"the MoE layers of decoder_sparse_step={step} with these dense layers form no such pattern",
    )  # fmt: skip


def _deepseek_v3_fields(hf: dict) -> dict[str, Any]:
    """DeepSeek-V3's MoE: sigmoid scores, e_score_correction_bias (= balance=bias), groups, shared experts."""
    for key, want, why in (
        ("rope_interleave", True, "meshrun reads DeepSeek's interleaved RoPE rows (the published layout)"),
        ("rms_norm_eps", 1e-6, "transformers' DeepSeek-V3 latent norms use 1e-6 whatever it says; meshrun one eps"),
        ("scoring_func", "sigmoid", "DeepSeek-V3 scores the experts with a sigmoid"),
    ):
        if hf.get(key, want) != want:
            raise ConfigError(f"{FIELD}: {key}", hf[key], f"use {key}={want}", why)
    if not hf.get("n_shared_experts"):
        raise ConfigError(f"{FIELD}: n_shared_experts", hf.get("n_shared_experts"), "use 1 or more (DeepSeek-V3: 1)")
    g, m = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    norm, aux = bool(hf.get("norm_topk_prob", True)), hf.get("aux_loss_alpha", 0.0001)
    return _moe_fields(hf["n_routed_experts"], hf["num_experts_per_tok"], norm, aux, "DeepSeek-V3") | dict(
        moe_d_ff=hf["moe_intermediate_size"],
        n_shared_experts=int(hf["n_shared_experts"]),
        first_dense_layers=int(hf.get("first_k_dense_replace", 0)),
        router_score="sigmoid",
        routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
        balance="bias",
        route_groups=g if g > 1 else 0,
        route_group_limit=m if g > 1 else 0,
    )


def _mla_fields(hf: dict) -> dict[str, Any]:
    """Multi-head latent attention (every head its own k and v: n_kv_heads = n_heads, head_dim unused)."""
    dims = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    return {k: int(hf[k]) for k in dims} | dict(
        attention="mla",
        q_lora_rank=int(hf.get("q_lora_rank") or 0),
        n_kv_heads=hf["num_attention_heads"],
        head_dim=int(hf["qk_rope_head_dim"]),
    )


def cfg_family(cfg: ModelConfig) -> str:
    """The transformers architecture a meshrun model is written as (export_config then checks that
    it reads back as the same model)."""
    if cfg.is_moe:
        deepseek = (
            cfg.attention == "mla" or cfg.router_score == "sigmoid" or cfg.n_shared_experts or cfg.balance == "bias"
        )
        return "deepseek_v3" if deepseek else "qwen3_moe" if cfg.qk_norm else "mixtral"
    return "qwen2" if cfg.qkv_bias else "mistral" if cfg.sliding_window else "llama"


def hf_config(cfg: ModelConfig, vocab: int, dtype: str) -> dict[str, Any]:
    """A transformers config.json for a meshrun model (used when the run was not imported)."""
    fam = cfg_family(cfg)
    bad = [(f, v) for f, v in (("mlp", "swiglu"), ("attention", "mla")) if fam == "deepseek_v3" or f == "mlp"]
    bad = [(f, want) for f, want in bad if getattr(cfg, f) != want]
    if fam in ("mixtral", "deepseek_v3") and cfg.moe_every != 1:
        bad.append(("moe_every", 1))
    if fam != "deepseek_v3" and cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim:  # DeepSeek's softmax factor
        bad.append(("rope_mscale_all_dim", 0.0))
    if bad:
        f, want = bad[0]
        raise ConfigError(
            f"model.{f}", getattr(cfg, f), f"use {f}={want} for a model exported as {ARCH[fam]}",
            "export-hf writes Llama/Qwen2/Mixtral/Qwen3-MoE and DeepSeek-V3 (latent attention, every layer MoE "
            "after the first dense ones); no Hugging Face architecture for this model",
        )  # fmt: skip
    out: dict[str, Any] = {
        "architectures": [ARCH[fam]],
        "model_type": fam,
        "vocab_size": vocab,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.d_ff,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_scaling(cfg),
        "torch_dtype": dtype,
    }
    return out | _family_config(cfg, fam)


def _rope_scaling(cfg: ModelConfig) -> dict[str, Any] | None:
    if cfg.rope_scaling == "yarn":
        opt = {"attention_factor": cfg.rope_attention_factor, "mscale_all_dim": cfg.rope_mscale_all_dim}
        return {
            "rope_type": "yarn", "factor": cfg.rope_scaling_factor,
            "original_max_position_embeddings": cfg.rope_original_max_seq_len, "beta_fast": cfg.rope_beta_fast,
            "beta_slow": cfg.rope_beta_slow,
        } | {k: v for k, v in opt.items() if v}  # fmt: skip
    if cfg.rope_scaling != "llama3":
        return None
    return {
        "rope_type": "llama3",
        "factor": cfg.rope_scaling_factor,
        "low_freq_factor": cfg.rope_low_freq_factor,
        "high_freq_factor": cfg.rope_high_freq_factor,
        "original_max_position_embeddings": cfg.rope_original_max_seq_len,
    }


def _family_config(cfg: ModelConfig, fam: str) -> dict[str, Any]:
    """config.json's architecture-specific keys."""
    out: dict[str, Any] = {}
    if fam in ("mistral", "mixtral"):
        out["sliding_window"] = cfg.sliding_window or None
    if fam == "mixtral":
        out |= {"num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k}
    if fam in ("mixtral", "qwen3_moe"):
        out["router_aux_loss_coef"] = cfg.aux_loss_coef
    if fam == "qwen3_moe":  # every dense layer listed: any first_dense_layers / moe_every pattern
        dense = [i for _, ids, moe in stacks(cfg) if not moe for i in _flat(ids)]
        out |= {
            "num_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k, "moe_intermediate_size": cfg.expert_d_ff,
            "norm_topk_prob": cfg.router_norm_topk, "decoder_sparse_step": 1, "mlp_only_layers": sorted(dense),
            "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
        }  # fmt: skip
    if fam == "deepseek_v3":
        out |= _deepseek_v3_config(cfg)
    if fam == "qwen2":  # transformers' Qwen2 slides in layers >= max_window_layers
        w = cfg.sliding_window
        out |= {
            "use_sliding_window": bool(w),
            "sliding_window": w or None,
            "max_window_layers": 0 if w else cfg.n_layers,
        }
    return out


def _deepseek_v3_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "num_key_value_heads": cfg.n_heads, "head_dim": cfg.qk_rope_head_dim, "q_lora_rank": cfg.q_lora_rank or None,
        "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim, "rope_interleave": True,
        "n_routed_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k, "n_shared_experts": cfg.n_shared_experts,
        "moe_intermediate_size": cfg.expert_d_ff, "first_k_dense_replace": cfg.first_dense_layers,
        "routed_scaling_factor": cfg.routed_scaling, "n_group": max(cfg.route_groups, 1),
        "topk_group": cfg.route_group_limit or 1, "norm_topk_prob": cfg.router_norm_topk,
        "aux_loss_alpha": cfg.aux_loss_coef, "num_nextn_predict_layers": 0, "attention_bias": False,
    }  # fmt: skip


def _flat(ids) -> list[int]:
    return [j for i in ids for j in (_flat(i) if isinstance(i, tuple) else [i])]


MIXTRAL_ROUTING = {  # the MoE fields a Mixtral checkpoint has at these values only
    "moe_d_ff": 0, "n_shared_experts": 0, "first_dense_layers": 0, "router_score": "softmax",
    "router_norm_topk": True, "routed_scaling": 1.0, "balance": "aux_loss", "route_groups": 0,
}  # fmt: skip


def check_shapes(cfg: ModelConfig) -> None:
    """ConfigError for multi-head latent attention in a dense model (DeepSeek-V3 is the architecture)."""
    if getattr(cfg, "attention", "gqa") != "gqa" and not cfg.is_moe:
        raise ConfigError(
            "model.attention", cfg.attention, "use attention=gqa for a dense model exchanged with Hugging Face",
            "meshrun exchanges multi-head latent attention as DeepSeek-V3 (an MoE model) only",
        )  # fmt: skip


def stacks(cfg: ModelConfig) -> list[tuple[tuple[str, ...], Any, bool]]:
    """(meshrun path prefix, transformers layer index of each entry, MoE?) of every stack of blocks:
    model.first_dense_layers ('first'), then the units: dense blocks ('layers'), or per group of
    moe_every the moe_every - 1 dense blocks ('layers', 'dense') and the MoE block ('layers', 'moe')."""
    f, k = cfg.first_dense_layers, cfg.moe_every
    out = [(("first",), tuple(range(f)), False)] if f else []
    if not cfg.is_moe:
        return out + [(("layers",), tuple(range(cfg.n_layers)), False)]
    units = range(cfg.n_units)
    if k > 1:
        out.append((("layers", "dense"), tuple(tuple(f + u * k + j for j in range(k - 1)) for u in units), False))
    return out + [(("layers", "moe"), tuple(f + u * k + k - 1 for u in units), True)]


def _mla_map(cfg: ModelConfig, pre: tuple[str, ...], at: str) -> dict:
    """DeepSeek-V3's attention; the RoPE rows of q and of the shared k reordered from interleaved."""
    a, h, dr = pre + ("attn",), cfg.n_heads, cfg.qk_rope_head_dim
    m = {
        a + ("kv_down",): (at + "kv_a_proj_with_mqa.weight", "t_rope", dr),
        a + ("kv_norm",): (at + "kv_a_layernorm.weight", "id", 0),
        a + ("kv_up",): (at + "kv_b_proj.weight", "col", h),
        a + ("o",): (at + "o_proj.weight", "row", h),
    }
    if not cfg.q_lora_rank:
        return m | {a + ("q",): (at + "q_proj.weight", "col_rope", (h, dr))}
    return m | {
        a + ("q_down",): (at + "q_a_proj.weight", "t", 0),
        a + ("q_norm",): (at + "q_a_layernorm.weight", "id", 0),
        a + ("q_up",): (at + "q_b_proj.weight", "col_rope", (h, dr)),
    }


def _attn_map(cfg: ModelConfig, pre: tuple[str, ...]) -> dict:
    at = "model.layers.{l}.self_attn."
    norms = {
        pre + ("attn_norm", "scale"): ("model.layers.{l}.input_layernorm.weight", "id", 0),
        pre + ("mlp_norm", "scale"): ("model.layers.{l}.post_attention_layernorm.weight", "id", 0),
    }
    if cfg.attention == "mla":
        return norms | _mla_map(cfg, pre, at)
    m = norms | {
        pre + ("attn", "q"): (at + "q_proj.weight", "col", cfg.n_heads),
        pre + ("attn", "k"): (at + "k_proj.weight", "col", cfg.n_kv_heads),
        pre + ("attn", "v"): (at + "v_proj.weight", "col", cfg.n_kv_heads),
        pre + ("attn", "o"): (at + "o_proj.weight", "row", cfg.n_heads),
    }
    if cfg.qkv_bias:
        m |= {
            pre + ("attn", "q_bias"): (at + "q_proj.bias", "bias", cfg.n_heads),
            pre + ("attn", "k_bias"): (at + "k_proj.bias", "bias", cfg.n_kv_heads),
            pre + ("attn", "v_bias"): (at + "v_proj.bias", "bias", cfg.n_kv_heads),
        }
    if cfg.qk_norm:  # Qwen3
        m |= {pre + ("attn", "q_norm"): (at + "q_norm.weight", "id", 0)}
        m |= {pre + ("attn", "k_norm"): (at + "k_norm.weight", "id", 0)}
    return m


def _mlp_map(pre: tuple[str, ...], name: str, mlp: str = "model.layers.{l}.mlp.") -> dict:
    return {
        pre + (name, "gate"): (mlp + "gate_proj.weight", "t", 0),
        pre + (name, "up"): (mlp + "up_proj.weight", "t", 0),
        pre + (name, "down"): (mlp + "down_proj.weight", "t", 0),
    }


def _moe_map(cfg: ModelConfig, pre: tuple[str, ...]) -> dict:
    if cfg_family(cfg) == "mixtral":
        moe = "model.layers.{l}.block_sparse_moe."
        return {
            pre + ("moe", "router"): (moe + "gate.weight", "t", 0),
            pre + ("moe", "gate"): (moe + "experts.{e}.w1.weight", "t", 0),
            pre + ("moe", "up"): (moe + "experts.{e}.w3.weight", "t", 0),
            pre + ("moe", "down"): (moe + "experts.{e}.w2.weight", "t", 0),
        }
    moe = "model.layers.{l}.mlp."  # Qwen3-MoE, DeepSeek-V3
    m = {pre + ("moe", "router"): (moe + "gate.weight", "t", 0)} | _mlp_map(pre, "moe", moe + "experts.{e}.")
    if cfg.n_shared_experts:
        m |= _mlp_map(pre, "shared", moe + "shared_experts.")
    if cfg.balance == "bias":  # its load (zeros) is meshrun's own state
        m[pre + ("moe", "balance", "bias")] = (moe + "gate.e_score_correction_bias", "id", 0)
        m[pre + ("moe", "balance", "load")] = ("", "zeros", cfg.n_experts)
    return m


def layer_map(cfg: ModelConfig) -> dict[tuple[str, ...], tuple]:
    """meshrun leaf path -> (hf name template with {l} and {e}, transform, heads, part, parts, the
    transformers layer of each stack entry) for stacked leaves."""
    check_shapes(cfg)
    out = {}
    for pre, ids, moe in stacks(cfg):
        m = _attn_map(cfg, pre) | (_moe_map(cfg, pre) if moe else _mlp_map(pre, "mlp"))
        out |= {path: (*v, 0, 1, ids) for path, v in m.items()}
    return out


def top_map(cfg: ModelConfig) -> dict[tuple[str, ...], tuple[str, str]]:
    """meshrun leaf path -> (hf name, kind) for the unstacked leaves; kind: id | vocab (rows padded to
    cfg.vocab) | vocab_t (lm_head [V, D] -> kernel [D, V], columns padded)."""
    out = {
        ("embed", "embedding"): ("model.embed_tokens.weight", "vocab"),
        ("final_norm", "scale"): ("model.norm.weight", "id"),
    }
    if not cfg.tie_embeddings:
        out[("head", "kernel")] = ("lm_head.weight", "vocab_t")
    return out


def ignored(cfg: ModelConfig, name: str) -> bool:
    """Checkpoint tensors the model has no use for (buffers, the tied lm_head copy)."""
    if name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "lm_head.weight"):
        return True
    layer = name.split(".")[2] if name.startswith("model.layers.") else ""
    return cfg.attention == "mla" and layer.isdigit() and int(layer) >= cfg.n_layers  # DeepSeek's MTP layers
