"""Hugging Face `config.json` <-> jaxpar's `model.*` keys, for the Llama, Mistral, Qwen 2/2.5 and Qwen 3
families and the Mixtral and Qwen3-MoE mixtures of experts here, and Gemma 3 (text), gpt-oss and
DeepSeek-V3 in jaxpar.config.hf_families. Pure Python (no jax): the CLI resolves `model.from_hf` while it
reads the config.

Reading: each supported field becomes a `model.*` value; a field jaxpar cannot honour (an output
bias, a non-SiLU activation, an unknown RoPE type, quantized weights) is refused in one sentence.
RoPE settings are read in both spellings (jaxpar.config.hf_rope), sliding windows as model.window
and model.attention_pattern (jaxpar.config.hf_windows). A field that is missing takes the family's
default in transformers.

Writing (`hf_config`): the source checkpoint's own config.json when the model came from one (its
token ids and other fields kept), else a new one in the published spelling.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxpar.config import Config, ConfigError, ModelConfig, apply_overrides, flatten_dict, hf_families
from jaxpar.config.hf_errors import CheckpointError
from jaxpar.config.hf_rope import rope_fields, rope_parameters, rope_settings
from jaxpar.config.hf_windows import window_fields, window_settings

CONFIG_FILE = "config.json"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# Mistral's architecture is Llama's with a window: its config.json stands for a model of either family
SAME_ARCHITECTURE = {"mistral": ("llama", "mistral")}
MOE_FAMILIES = ("mixtral", "qwen3_moe")
KNOWN = FAMILIES + hf_families.NEW_FAMILIES
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def read_config(folder: str | Path) -> dict:
    """DIR/config.json as a dict; raises CheckpointError (one sentence) when it is missing or not JSON."""
    path = Path(folder) / CONFIG_FILE
    try:
        is_folder, has_config = Path(folder).is_dir(), path.is_file()
    except OSError as e:  # a name the system cannot look up: too long, say
        why = e.strerror or type(e).__name__  # as data.source's error says it (jaxpar.data.corpus)
        raise CheckpointError(f"model.from_hf={str(folder)!r} cannot be looked up ({why}).") from None
    if not is_folder:
        raise CheckpointError(f"model.from_hf={str(folder)!r} is not a folder.")
    if not has_config:
        raise CheckpointError(f"model.from_hf={str(folder)!r} has no {CONFIG_FILE}; give the folder of a Hugging Face "
                              f"checkpoint (config.json and *.safetensors).")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read as JSON ({type(e).__name__}).") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path} does not hold a JSON object.")
    return hf


def moe_settings(hf: dict, where: Path) -> dict[str, object]:
    """The `model.moe.*` values of a Mixtral or Qwen3-MoE config. Both compute every routed token (no
    capacity: `dropless`), score by softmax and take the top k without noise; Mixtral renormalises the
    chosen weights, Qwen3-MoE when norm_topk_prob. router_aux_loss_coef is not read: it weighs Switch's
    balance loss (E x sum f_e P_e), not the CV^2 loss of jaxpar's top-k routers, so model.moe.aux_loss_weight
    stays a training setting."""
    mixtral = hf["model_type"] == "mixtral"
    # Qwen3-MoE's published files say num_experts; transformers 5 writes num_local_experts (Mixtral's name)
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    top_k = hf.get("num_experts_per_tok")
    width = hf["intermediate_size"] if mixtral else hf.get("moe_intermediate_size")
    if not (isinstance(experts, int) and isinstance(top_k, int) and 0 < top_k <= experts and isinstance(width, int)):
        raise CheckpointError(f"{where} needs integers num_experts (or num_local_experts) > 0, num_experts_per_tok "
                              f"between 1 and it{'' if mixtral else ' and moe_intermediate_size'}.")
    return hf_families.dropless_settings(
        experts, top_k, width, every=1 if mixtral else _moe_every(hf, where), mlp="swiglu", score="softmax",
        renormalize=mixtral or bool(hf.get("norm_topk_prob", False)), routed_scale=1.0, shared=0, balance="aux")


def _moe_every(hf: dict, where: Path) -> int:
    """Qwen3-MoE's sparse layers (each (i + 1)-th that decoder_sparse_step divides, less mlp_only_layers)
    as model.moe.every, which makes layers every-1, 2 x every-1, ... MoE; raises CheckpointError when
    they are no such pattern."""
    step, dense, layers = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or [], hf["num_hidden_layers"]
    if not isinstance(step, int) or step <= 0 or not isinstance(dense, list):
        raise CheckpointError(f"{where} needs a positive integer decoder_sparse_step and a list mlp_only_layers.")
    theirs = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    if layers % step or not theirs or theirs != [i for i in range(layers) if (i + 1) % step == 0]:
        raise CheckpointError(f"{where}'s experts are in layers {theirs} (decoder_sparse_step={step}, "
                              f"mlp_only_layers={dense}), which is not every k-th of its {layers} layers as "
                              f"model.moe.every needs.")
    return step


def model_settings(hf: dict, where: Path) -> dict[str, object]:
    """The `model.*` values a Hugging Face config gives; raises CheckpointError for what jaxpar cannot
    represent."""
    family = hf.get("model_type")
    if family == "qwen2_moe":
        raise CheckpointError(f"{where} is a Qwen2-MoE, whose shared expert is scaled by a sigmoid gate "
                              f"(shared_expert_gate) that jaxpar's shared experts do not have; jaxpar imports "
                              f"{', '.join(KNOWN)}.")
    if family == "gemma3":
        raise CheckpointError(f"{where} is a multimodal Gemma 3 (model_type gemma3); jaxpar imports the text-only "
                              f"gemma3_text, whose settings it keeps under text_config and tensors under "
                              f"language_model.")
    if family not in KNOWN:
        raise CheckpointError(f"{where} has model_type {family!r}; jaxpar imports {', '.join(KNOWN)}.")
    missing = [k for k in REQUIRED if not isinstance(hf.get(k), int)]
    if missing:
        raise CheckpointError(f"{where} lacks {', '.join(missing)} (integers every {family} config has).")
    quantized = hf.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "quantized") if isinstance(quantized, dict) else quantized
        raise CheckpointError(f"{where} holds {method} weights (quantization_config), and jaxpar reads float ones: "
                              f"dequantize it first (load it in transformers with its quantization config's "
                              f"dequantize=True, e.g. Mxfp4Config or FineGrainedFP8Config, and save_pretrained).")
    if family in hf_families.NEW_FAMILIES:
        return hf_families.model_settings(hf, where)
    return {**hf_families.OFF, **hf_families.MOE_OFF, **_dense_settings(hf, where), **window_settings(hf, where)}


def _dense_settings(hf: dict, where: Path) -> dict[str, object]:
    """The model.* values of a Llama, Mistral, Qwen or (with its experts) Mixtral or Qwen3-MoE config."""
    family = hf["model_type"]
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise CheckpointError(f"{where} uses hidden_act {hf['hidden_act']!r}; jaxpar's SwiGLU MLP needs silu.")
    if hf.get("mlp_bias"):
        raise CheckpointError(f"{where} has mlp_bias=true; jaxpar's MLP has no biases.")
    if family != "qwen2" and hf.get("attention_bias"):
        raise CheckpointError(f"{where} has attention_bias=true, which includes an output-projection bias that "
                              f"jaxpar's attention does not have.")
    head_dim = hf.get("head_dim") or (128 if family == "qwen3" else hf["hidden_size"] // hf["num_attention_heads"])
    qk_norm = family in ("qwen3", "qwen3_moe")
    return {
        **hf_families.shape_settings(hf, head_dim), "model.mlp": "swiglu",
        "model.norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "model.tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "model.qkv_bias": family == "qwen2", "model.qk_norm": qk_norm,
        **rope_settings(rope_parameters(hf), where),
        **(moe_settings(hf, where) if family in MOE_FAMILIES else {"model.moe.experts": 0}),
    }


def resolve(cfg: Config, given: set[str] = frozenset()) -> Config:
    """The config with the shape of `model.from_hf`'s config.json filled in (unchanged without one).

    A `model.*` key that differs from the checkpoint's is a contradiction, raised as one sentence,
    when it was given (`given`: the dotted keys a preset or the command line set) or when it is not
    the default. Idempotent: a resolved config resolves to itself."""
    folder = cfg.model.from_hf
    if not folder:
        return cfg
    where = Path(folder) / CONFIG_FILE
    hf = read_config(folder)
    wanted = model_settings(hf, where)
    now, defaults = flatten_dict(cfg.to_dict()), flatten_dict(Config().to_dict())
    clash = [k for k, v in wanted.items() if now[k] != v and (k in given or now[k] != defaults[k])]
    if clash:
        given = ", ".join(f"{k}={now[k]}" for k in clash)
        theirs = ", ".join(f"{k}={wanted[k]}" for k in clash)
        raise ConfigError(f"the config sets {given}, but model.from_hf={folder!r} has {theirs}; drop "
                          f"{'that key' if len(clash) == 1 else 'those keys'}, since the checkpoint's config.json "
                          f"fixes the model's shape.")
    return apply_overrides(cfg, wanted)


def family_of(m: ModelConfig) -> str:
    """The Hugging Face family a jaxpar model exports as; raises CheckpointError for one none of them
    can hold."""
    family = hf_families.family_of(m)  # Gemma 3, gpt-oss, DeepSeek-V3: a feature only they have
    if family is not None:
        return family
    moe = m.moe
    layer_kinds = bool(m.window and m.attention_pattern) and bool(moe.experts or not (m.qkv_bias or m.qk_norm))
    unsupported = {"model.mlp=gelu": m.mlp != "swiglu", "model.positions=learned": m.positions != "rope",
                   "model.qkv_bias with model.qk_norm": m.qkv_bias and m.qk_norm,
                   f"model.rope_scaling={m.rope_scaling}": m.rope_scaling == "yarn", "model.out_bias": m.out_bias,
                   f"model.attn_softcap={m.attn_softcap}": bool(m.attn_softcap),
                   f"model.attn_scale={m.attn_scale}": bool(m.attn_scale),
                   "model.moe.expert_groups": moe.expert_groups > 1 or moe.topk_groups > 1,
                   "model.moe.first_dense": bool(moe.experts and moe.first_dense),
                   f"model.attention_pattern={m.attention_pattern!r}": layer_kinds}
    if moe.experts:  # Mixtral and Qwen3-MoE: SwiGLU experts, top-k of softmax scores, nothing beside them
        unsupported.update({
            "model.moe.mlp=gelu": moe.mlp != "swiglu", f"model.moe.router={moe.router}": not moe.chooses_top_k,
            "model.moe.score=sigmoid": moe.score != "softmax", f"model.moe.shared={moe.shared}": moe.shared > 0,
            "model.moe.balance=bias": moe.balance != "aux", "model.qkv_bias with experts": m.qkv_bias,
            f"model.moe.routed_scale={moe.routed_scale}": moe.routed_scale != 1.0,
            "experts without model.qk_norm but with model.moe.every > 1 or model.moe.renormalize=false":
                not m.qk_norm and (moe.every != 1 or not moe.renormalize)})
    asked = [key for key, on in unsupported.items() if on]
    if asked:
        raise CheckpointError(f"a model with {' and '.join(asked)} has no Hugging Face family to export to "
                              f"({', '.join(FAMILIES[:4])} are SwiGLU, rotary, dense models, Mistral's with a window "
                              f"on every layer, Qwen's on any; {' and '.join(MOE_FAMILIES)} add SwiGLU experts "
                              f"chosen top-k by softmax scores).")
    if moe.experts:
        return "qwen3_moe" if m.qk_norm else "mixtral"
    return "qwen3" if m.qk_norm else "qwen2" if m.qkv_bias else "mistral" if m.window else "llama"


def hf_config(m: ModelConfig, dtype: str, source: dict | None = None) -> dict:
    """The config.json of an export: the source checkpoint's, with the dtype of the written weights,
    or a new one for the model's family."""
    family = family_of(m)
    kind = source.get("model_type") if source is not None else None
    if kind is not None and family in SAME_ARCHITECTURE.get(kind, (kind,)):
        out = dict(source)
    elif family in hf_families.NEW_FAMILIES:
        out = hf_families.new_config(m, family)
    else:
        out = {"architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": m.vocab_size,
               "hidden_size": m.d_model, "intermediate_size": m.d_ff, "num_hidden_layers": m.n_layers,
               "num_attention_heads": m.n_heads, "num_key_value_heads": m.kv_heads, "head_dim": m.head_size,
               "hidden_act": "silu", "rms_norm_eps": m.norm_eps, **rope_fields(m),
               "tie_word_embeddings": m.tie_embeddings, "max_position_embeddings": max(m.seq_len, 2048),
               "attention_bias": False, "mlp_bias": False, **window_fields(m, family)}
        if family == "qwen2":
            out.pop("attention_bias")
        out.update(_moe_fields(m, family))
    out.pop("dtype", None)
    out["torch_dtype"] = dtype
    return out


def _moe_fields(m: ModelConfig, family: str) -> dict:
    """A new Mixtral or Qwen3-MoE config's expert fields, in the published spelling (nothing for a dense family)."""
    moe = m.moe
    if family == "mixtral":
        return {"intermediate_size": m.expert_d_ff, "num_local_experts": moe.experts, "num_experts_per_tok": moe.top_k,
                "router_jitter_noise": 0.0}
    if family == "qwen3_moe":
        return {"num_experts": moe.experts, "num_experts_per_tok": moe.top_k, "moe_intermediate_size": m.expert_d_ff,
                "norm_topk_prob": moe.renormalize, "decoder_sparse_step": moe.every, "mlp_only_layers": []}
    return {}


def settings_of(folder: str | Path) -> dict[str, object]:
    """`model.*` values of a checkpoint folder (for the Python API, which builds its own config)."""
    return model_settings(read_config(folder), Path(folder) / CONFIG_FILE)


def config_for(folder: str | Path, **overrides) -> Config:
    """A Config for the checkpoint in `folder` (its shape resolved), with dotted overrides."""
    return resolve(apply_overrides(Config(), {"model.from_hf": str(folder), **overrides}))
