"""Gemma 3 (text), gpt-oss and DeepSeek-V3 config.json <-> jaxpar's `model.*` keys, as transformers 5.25
reads them (hf_config dispatches here; what each family computes: docs/open-weights.md). Pure Python.

Reading gives every key the checkpoint fixes, or refuses in one sentence what jaxpar cannot represent
(quantized weights are refused for every family in hf_config). `family_of` names the family of a jaxpar
model that uses a feature only these three have, or refuses the model in one sentence; `new_config`
writes its config.json in the published spelling.
"""

from __future__ import annotations

from numbers import Real
from pathlib import Path

from jaxpar.config.hf_errors import CheckpointError
from jaxpar.config.hf_rope import latent_softmax_scale, model_latent_scale, rope_fields, rope_parameters, rope_settings
from jaxpar.config.hf_windows import window_fields, window_settings
from jaxpar.config.model import ModelConfig

NEW_FAMILIES = ("gemma3_text", "gpt_oss", "deepseek_v3")
ARCHITECTURES = {"gemma3_text": "Gemma3ForCausalLM", "gpt_oss": "GptOssForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}
# What a checkpoint of any family fixes besides its own fields: these features off, unless its family turns
# them on. So a config that sets one beside model.from_hf is refused as a contradiction, not silently kept
# (MTP included: transformers reads no MTP weights, so an imported model has none).
OFF = {"model.window": 0, "model.attention_pattern": "", "model.sinks": False, "model.out_bias": False,
       "model.attn_softcap": 0.0, "model.final_softcap": 0.0, "model.attn_scale": 0.0, "model.norm_offset": False,
       "model.sandwich_norm": False, "model.embed_scale": False, "model.rope_local_theta": 0.0,
       "model.mla.kv_rank": 0, "model.mla.q_rank": 0, "model.mla.rope_dim": 0, "model.mla.nope_dim": 0,
       "model.mla.v_dim": 0, "model.mtp.depth": 0}
MOE_OFF = {"model.moe.logit_bias": False, "model.moe.expert_groups": 1, "model.moe.topk_groups": 1,
           "model.moe.first_dense": 0}
# gpt-oss's rope when a config.json has none (GptOssConfig's default)
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
LATENT_NORM_EPS = 1e-6  # DeepSeek-V3's q_a_layernorm and kv_a_layernorm, whatever rms_norm_eps says


def model_settings(hf: dict, where: Path) -> dict[str, object]:
    """The model.* values of a gemma3_text, gpt_oss or deepseek_v3 config.json."""
    read = {"gemma3_text": _gemma, "gpt_oss": _gpt_oss, "deepseek_v3": _deepseek}[hf["model_type"]]
    return {**OFF, **MOE_OFF, **read(hf, where)}


def shape_settings(hf: dict, head_dim: int, heads_kv: int | None = None) -> dict[str, object]:
    """The sizes every family has (hf_config's families too); model.head_dim 0 where the heads split the
    model width."""
    heads = hf["num_attention_heads"]
    return {"model.vocab_size": hf["vocab_size"], "model.d_model": hf["hidden_size"],
            "model.d_ff": hf["intermediate_size"], "model.n_layers": hf["num_hidden_layers"], "model.n_heads": heads,
            "model.n_kv_heads": heads_kv if heads_kv is not None else hf.get("num_key_value_heads") or heads,
            "model.head_dim": head_dim if head_dim * heads != hf["hidden_size"] else 0, "model.positions": "rope"}


def _gemma(hf: dict, where: Path) -> dict[str, object]:
    if hf.get("use_bidirectional_attention"):
        raise CheckpointError(f"{where} attends both ways (use_bidirectional_attention=true); jaxpar's attention "
                              f"is causal.")
    activation = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise CheckpointError(f"{where} uses hidden_activation {activation!r}; jaxpar's GeGLU is "
                              f"gelu_pytorch_tanh's (the tanh approximation).")
    bias = bool(hf.get("attention_bias", False))  # on the query, key, value and output projections
    return {**shape_settings(hf, hf.get("head_dim") or 256), "model.mlp": "geglu",
            "model.norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "model.tie_embeddings": bool(hf.get("tie_word_embeddings", True)), "model.qkv_bias": bias,
            "model.out_bias": bias, "model.qk_norm": True, "model.norm_offset": True, "model.sandwich_norm": True,
            "model.embed_scale": True, "model.final_softcap": float(hf.get("final_logit_softcapping") or 0.0),
            # attn_logit_softcapping is not read: transformers 5.25's Gemma3Attention stores it but passes no
            # softcap to the attention (Gemma 2's does), so jaxpar leaves model.attn_softcap at 0 as well
            "model.attn_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
            **_gemma_rope(hf, where), **window_settings(hf, where), "model.moe.experts": 0}


def _gemma_rope(hf: dict, where: Path) -> dict[str, object]:
    """Gemma 3's two rotations: the global layers' (rope_theta, and rope_scaling's), the sliding layers'
    unscaled one (rope_local_base_freq), or transformers 5's rope_parameters nested by layer type."""
    nested = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    full = dict(nested.get("full_attention") or {"rope_type": "default"})
    full.update(hf.get("rope_scaling") or {})
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    full.setdefault("rope_type", full.get("type", "default"))
    local = dict(nested.get("sliding_attention") or {"rope_type": "default"})
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise CheckpointError(f"{where} scales the sliding layers' rope ({local.get('rope_type')}); jaxpar's local "
                              f"layers rotate by a base of their own alone (model.rope_local_theta).")
    return {**rope_settings(full, where, ("default", "linear")), "model.rope_local_theta": float(local["rope_theta"])}


def dropless_settings(experts, top_k, width, **keys) -> dict[str, object]:
    """The model.moe.* values of a dropless top-k mixture (every routed token computed, no noise; every
    layer's MLP the experts unless `every` says otherwise)."""
    return {"model.moe.experts": experts, "model.moe.every": 1, "model.moe.router": "dropless",
            "model.moe.top_k": top_k, "model.moe.d_ff": width, "model.moe.noise": False,
            **{f"model.moe.{k}": v for k, v in keys.items()}}


def _integers(where: Path, **values) -> None:
    bad = [k for k, v in values.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0]
    if bad:
        raise CheckpointError(f"{where} needs whole numbers for {', '.join(bad)}.")


def _gpt_oss(hf: dict, where: Path) -> dict[str, object]:
    experts, top_k = hf.get("num_local_experts", hf.get("num_experts", 128)), hf.get("num_experts_per_tok", 4)
    _integers(where, num_local_experts=experts, num_experts_per_tok=top_k)
    limit, alpha = hf.get("swiglu_limit", 7.0), hf.get("swiglu_alpha", 1.702)
    if not all(isinstance(v, Real) and not isinstance(v, bool) and v > 0 for v in (limit, alpha)):
        raise CheckpointError(f"{where} has swiglu_limit={limit!r} and swiglu_alpha={alpha!r}; gpt-oss's clamped "
                              f"SwiGLU needs both positive numbers (published: 7.0 and 1.702).")
    bias = bool(hf.get("attention_bias", True))
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    parameters = rope_parameters(hf, 150_000.0, GPT_OSS_ROPE)
    return {**shape_settings(hf, head_dim), "model.mlp": "swiglu",
            "model.norm_eps": float(hf.get("rms_norm_eps", 1e-5)),
            "model.tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "model.qkv_bias": bias,
            "model.out_bias": bias, "model.qk_norm": False, "model.sinks": True,
            **rope_settings(parameters, where, ("default", "linear", "yarn")), **window_settings(hf, where),
            **dropless_settings(experts, top_k, hf["intermediate_size"], mlp="gpt_oss", score="softmax",
                                renormalize=True, logit_bias=True, swiglu_limit=float(limit),
                                swiglu_alpha=float(alpha), routed_scale=1.0, shared=0, balance="aux")}


# Published keys transformers' DeepSeek-V3 does not read (it always scores by sigmoid with the correction
# bias, group-limited, every layer after the dense ones an MoE): any other value describes another model.
DEEPSEEK_FIXED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


def _deepseek_refusals(hf: dict, where: Path) -> None:
    for key, value in DEEPSEEK_FIXED.items():
        if hf.get(key, value) != value:
            raise CheckpointError(f"{where} has {key}={hf[key]!r}, but DeepSeek-V3 as transformers (and jaxpar) "
                                  f"runs it has {key}={value!r}.")
    if not hf.get("rope_interleave", True):
        raise CheckpointError(f"{where} has rope_interleave=false (rotary rows stored half-split); jaxpar reads "
                              f"DeepSeek-V3's published form, its rotary rows interleaved.")
    if hf.get("attention_bias"):
        raise CheckpointError(f"{where} has attention_bias=true; jaxpar's latent attention has no biases.")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where} uses hidden_act {hf['hidden_act']!r}; jaxpar's SwiGLU MLP needs silu.")
    if hf.get("num_key_value_heads") not in (None, hf["num_attention_heads"]):
        raise CheckpointError(f"{where} has num_key_value_heads={hf['num_key_value_heads']} beside "
                              f"num_attention_heads={hf['num_attention_heads']}; latent attention rebuilds a key "
                              f"and a value for every head, so they must be equal.")
    if float(hf.get("rms_norm_eps", 1e-6)) != LATENT_NORM_EPS:
        raise CheckpointError(f"{where} has rms_norm_eps={hf['rms_norm_eps']}, but transformers keeps DeepSeek-V3's "
                              f"latent norms at {LATENT_NORM_EPS} whatever it says, and jaxpar's take model.norm_eps; "
                              f"jaxpar imports DeepSeek-V3 with rms_norm_eps {LATENT_NORM_EPS} only.")


def _deepseek(hf: dict, where: Path) -> dict[str, object]:
    _deepseek_refusals(hf, where)
    get = {"kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
           "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
           "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3}
    sizes = {k: hf.get(k, default) for k, default in get.items()}
    sizes["q_lora_rank"] = sizes["q_lora_rank"] or 0  # null: queries projected from the model width
    _integers(where, **sizes)
    parameters = rope_parameters(hf, 10_000.0)
    width = sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"]
    return {**shape_settings(hf, 0, heads_kv=0), "model.mlp": "swiglu",
            "model.norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "model.tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "model.qkv_bias": False,
            "model.qk_norm": False, **rope_settings(parameters, where, ("default", "linear", "yarn")),
            "model.attn_scale": latent_softmax_scale(parameters, width),
            "model.mla.kv_rank": sizes["kv_lora_rank"], "model.mla.q_rank": sizes["q_lora_rank"],
            "model.mla.rope_dim": sizes["qk_rope_head_dim"], "model.mla.nope_dim": sizes["qk_nope_head_dim"],
            "model.mla.v_dim": sizes["v_head_dim"],
            **dropless_settings(sizes["n_routed_experts"], sizes["num_experts_per_tok"], sizes["moe_intermediate_size"],
                                mlp="swiglu", score="sigmoid", renormalize=bool(hf.get("norm_topk_prob", True)),
                                routed_scale=float(hf.get("routed_scaling_factor", 2.5)),
                                shared=sizes["n_shared_experts"], balance="bias", expert_groups=sizes["n_group"],
                                topk_groups=sizes["topk_group"], first_dense=sizes["first_k_dense_replace"],
                                logit_bias=False)}


def family_of(m: ModelConfig) -> str | None:
    """gemma3_text, gpt_oss or deepseek_v3 for a model that uses a feature only that family has (None: the
    model uses none; hf_config's families may hold it); raises CheckpointError where the family cannot hold
    the rest of the model."""
    moe = m.moe
    if m.mla.enabled:
        family, unsupported = "deepseek_v3", _deepseek_misfits(m)
    elif m.sinks or moe.logit_bias or (moe.experts and moe.mlp == "gpt_oss"):
        family, unsupported = "gpt_oss", _gpt_oss_misfits(m)
    elif m.norm_offset or m.sandwich_norm or m.embed_scale or m.mlp == "geglu" or m.rope_local_theta or (
            m.final_softcap):
        family, unsupported = "gemma3_text", _gemma_misfits(m)
    else:
        return None
    asked = [key for key, on in unsupported.items() if on]
    if asked:
        raise CheckpointError(f"a model with {' and '.join(asked)} has no Hugging Face family to export to (its "
                              f"other settings are {family}'s, which {FITS[family]}).")
    return family


FITS = {"gemma3_text": "has (1 + w) and sandwich norms, scaled embeddings, a GeGLU MLP, query/key norms and no "
                       "experts",
        "gpt_oss": "has sinks, experts of its clamped SwiGLU in every layer chosen top-k by softmax with a router "
                   "bias, and no norms beside the plain ones",
        "deepseek_v3": "has latent attention, SwiGLU experts chosen by sigmoid scores with a correction bias "
                       "(model.moe.balance=bias) after dense first layers, and shared experts"}


def _common_misfits(m: ModelConfig) -> dict[str, bool]:
    return {"model.positions=learned": m.positions != "rope", f"model.attn_softcap={m.attn_softcap}": bool(
        m.attn_softcap), "model.qkv_bias without model.out_bias (or the reverse)": m.qkv_bias != m.out_bias}


def query_scalar(m: ModelConfig) -> int | None:
    """Gemma 3's query_pre_attn_scalar: the whole number whose -0.5 power model.attn_scale is (None: none)."""
    if not m.attn_scale:
        return m.head_size
    scalar = round(m.attn_scale ** -2)
    return scalar if scalar > 0 and scalar ** -0.5 == m.attn_scale else None


def _gemma_misfits(m: ModelConfig) -> dict[str, bool]:
    without = [key for key in ("norm_offset", "sandwich_norm", "embed_scale", "qk_norm") if not getattr(m, key)]
    return {**_common_misfits(m), "experts": m.moe.experts > 0, "model.sinks": m.sinks,
            f"model.mlp={m.mlp}": m.mlp != "geglu", f"model.rope_scaling={m.rope_scaling}": m.rope_scaling not in (
                "none", "linear"),
            "scaled rotations without model.rope_local_theta": m.rope_scaling != "none" and not m.rope_local_theta,
            f"model.attn_scale={m.attn_scale} (not 1/sqrt of a whole number)": query_scalar(m) is None,
            f"no model.{' or model.'.join(without)}": bool(without)}


def _gpt_oss_misfits(m: ModelConfig) -> dict[str, bool]:
    moe = m.moe
    return {**_common_misfits(m), "no model.sinks": not m.sinks, "no experts": not moe.experts,
            f"model.moe.mlp={moe.mlp}": moe.mlp != "gpt_oss", "no model.moe.logit_bias": not moe.logit_bias,
            f"model.moe.router={moe.router}": not moe.chooses_top_k, "model.moe.every > 1": moe.every != 1,
            f"model.moe.score={moe.score}": moe.score != "softmax", "no model.moe.renormalize": not moe.renormalize,
            f"model.moe.shared={moe.shared}": moe.shared > 0, f"model.moe.balance={moe.balance}": moe.balance != "aux",
            f"model.moe.routed_scale={moe.routed_scale}": moe.routed_scale != 1.0,
            "model.moe.first_dense or expert groups": moe.first_dense > 0 or moe.expert_groups > 1,
            "Gemma's norms, embedding scale or soft-cap": m.norm_offset or m.sandwich_norm or m.embed_scale or bool(
                m.final_softcap),
            "model.qk_norm": m.qk_norm, f"model.attn_scale={m.attn_scale}": bool(m.attn_scale),
            "model.rope_local_theta": bool(m.rope_local_theta),
            f"model.rope_scaling={m.rope_scaling}": m.rope_scaling == "llama3"}


def _deepseek_misfits(m: ModelConfig) -> dict[str, bool]:
    moe = m.moe
    scale = model_latent_scale(m)
    scales = {scale, 0.0} if scale == m.mla.qk_dim ** -0.5 else {scale}  # 0: 1/sqrt(head width), the same
    return {**_common_misfits(m), "no experts": not moe.experts, f"model.moe.mlp={moe.mlp}": moe.mlp != "swiglu",
            f"model.mlp={m.mlp}": m.mlp != "swiglu", f"model.moe.router={moe.router}": not moe.chooses_top_k,
            "model.moe.every > 1": moe.every != 1, f"model.moe.score={moe.score}": moe.score != "sigmoid",
            f"model.moe.balance={moe.balance}": moe.balance != "bias", "no model.moe.shared": not moe.shared,
            "model.moe.logit_bias": moe.logit_bias,
            "Gemma's norms, embedding scale or soft-cap": m.norm_offset or m.sandwich_norm or m.embed_scale or bool(
                m.final_softcap),
            f"model.norm_eps={m.norm_eps} (its latent norms' is {LATENT_NORM_EPS})": m.norm_eps != LATENT_NORM_EPS,
            f"model.attn_scale={m.attn_scale} (its rope settings imply {scale})": m.attn_scale not in scales,
            f"model.rope_scaling={m.rope_scaling}": m.rope_scaling == "llama3"}


def new_config(m: ModelConfig, family: str) -> dict:
    """A new config.json for a model of `family`, in the published spelling."""
    out = {"architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": m.vocab_size,
           "hidden_size": m.d_model, "intermediate_size": m.d_ff, "num_hidden_layers": m.n_layers,
           "num_attention_heads": m.n_heads, "num_key_value_heads": m.kv_heads, "rms_norm_eps": m.norm_eps,
           **rope_fields(m), "tie_word_embeddings": m.tie_embeddings, "max_position_embeddings": _positions(m),
           "attention_bias": m.qkv_bias, **window_fields(m, family)}
    moe = m.moe
    if family == "gemma3_text":
        out.update(head_dim=m.head_size, hidden_activation="gelu_pytorch_tanh",
                   rope_local_base_freq=m.rope_local_theta or m.rope_theta, query_pre_attn_scalar=query_scalar(m),
                   final_logit_softcapping=m.final_softcap or None, attn_logit_softcapping=None)
    elif family == "gpt_oss":
        out.update(head_dim=m.head_size, intermediate_size=m.expert_d_ff, num_local_experts=moe.experts,
                   num_experts_per_tok=moe.top_k, swiglu_limit=moe.swiglu_limit, swiglu_alpha=moe.swiglu_alpha,
                   hidden_act="silu")
    else:
        mla = m.mla
        out.update(num_key_value_heads=m.n_heads, q_lora_rank=mla.q_rank or None, kv_lora_rank=mla.kv_rank,
                   qk_rope_head_dim=mla.rope_dim, qk_nope_head_dim=mla.nope_dim, v_head_dim=mla.v_dim,
                   moe_intermediate_size=m.expert_d_ff, n_routed_experts=moe.experts, num_experts_per_tok=moe.top_k,
                   n_shared_experts=moe.shared, n_group=moe.expert_groups, topk_group=moe.topk_groups,
                   first_k_dense_replace=moe.first_dense, routed_scaling_factor=moe.routed_scale,
                   norm_topk_prob=moe.renormalize, scoring_func="sigmoid", topk_method="noaux_tc",
                   hidden_act="silu", num_nextn_predict_layers=0)
    return out


def _positions(m: ModelConfig) -> int:
    """max_position_embeddings: yarn's extended context (the ratio transformers checks), else the model's."""
    if m.rope_scaling == "yarn":
        return int(m.rope_original_context * m.rope_factor)
    return max(m.seq_len, 2048)
