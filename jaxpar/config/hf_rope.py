"""RoPE settings of a Hugging Face config.json <-> jaxpar's `model.rope_*` keys. Pure Python (no jax).

transformers reads them as one dict: `rope_scaling` where the file has one (the published spelling, its
type under `rope_type`, or `type` in older files such as DeepSeek-V3's), else `rope_parameters` (written
by transformers 5), with rope_theta inside it or beside it. The types: default (none), linear (every
frequency divided by factor), llama3, and yarn (gpt-oss, DeepSeek-V3); each family says which it takes.
"""

from __future__ import annotations

import math
from pathlib import Path

from jaxpar.config.hf_errors import CheckpointError
from jaxpar.config.model import ModelConfig

JAXPAR_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}
HF_TYPES = {kind: name for name, kind in JAXPAR_TYPES.items()}
# each type's required fields: Hugging Face's name -> jaxpar's model.* key
FIELDS = {"linear": {"factor": "rope_factor"},
          "llama3": {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
                     "high_freq_factor": "rope_high_freq_factor",
                     "original_max_position_embeddings": "rope_original_context"},
          "yarn": {"factor": "rope_factor", "original_max_position_embeddings": "rope_original_context"}}
# yarn's optional fields -> (jaxpar's key, the value transformers takes when the field is missing or null:
# beta 32 and 1; mscale and mscale_all_dim off, the attention factor then 0.1 ln(factor) + 1)
YARN_OPTIONAL = {"beta_fast": ("rope_beta_fast", 32.0), "beta_slow": ("rope_beta_slow", 1.0),
                 "mscale": ("rope_mscale", 0.0), "mscale_all_dim": ("rope_mscale_all_dim", 0.0)}
ORIGINAL = "original_max_position_embeddings"


def rope_parameters(hf: dict, default_theta: float = 10000.0, default: dict | None = None) -> dict:
    """The RoPE settings as transformers reads them (rope_scaling, else rope_parameters, else `default`),
    with rope_theta and rope_type inside; a value that is not a dict comes back as it is (refused by
    rope_settings)."""
    found = hf.get("rope_scaling") or hf.get("rope_parameters") or default or {}
    if not isinstance(found, dict):
        return found
    parameters = dict(found)
    parameters.setdefault("rope_theta", hf.get("rope_theta", default_theta))
    parameters.setdefault("rope_type", parameters.get("type", "default"))
    if parameters["rope_type"] in ("llama3", "yarn"):  # a top-level value wins, as transformers has it (Phi-3)
        if ORIGINAL in hf:
            parameters[ORIGINAL] = hf[ORIGINAL]
        parameters.setdefault(ORIGINAL, hf.get("max_position_embeddings"))
    return parameters


def rope_settings(parameters, where: Path, allowed: tuple[str, ...] = ("default", "linear", "llama3")) -> dict:
    """The model.rope_* keys of one RoPE dict (rope_parameters' result); raises CheckpointError for a type
    outside `allowed` or settings jaxpar cannot take."""
    kind = parameters.get("rope_type") if isinstance(parameters, dict) else parameters
    if kind not in allowed:
        raise CheckpointError(f"{where} uses rope scaling of type {kind!r}; jaxpar supports {', '.join(allowed)}.")
    if parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"{where} rotates part of each head (partial_rotary_factor="
                              f"{parameters['partial_rotary_factor']}); jaxpar rotates whole heads.")
    if kind == "yarn" and parameters.get("attention_factor") is not None:
        raise CheckpointError(f"{where}'s yarn rope sets attention_factor={parameters['attention_factor']}, which "
                              f"jaxpar derives from factor, mscale and mscale_all_dim alone; remove the key if it "
                              f"equals that, since jaxpar cannot take another value.")
    fields = FIELDS.get(kind, {})
    try:
        keys: dict[str, object] = {"model.rope_theta": float(parameters["rope_theta"]),
                                   "model.rope_scaling": JAXPAR_TYPES[kind]}
        for field, key in fields.items():
            number = int if key == "rope_original_context" else float
            keys[f"model.{key}"] = number(parameters[field])
        if kind == "yarn":
            for field, (key, default) in YARN_OPTIONAL.items():
                keys[f"model.{key}"] = float(parameters.get(field) or default)
            keys["model.rope_truncate"] = bool(parameters.get("truncate", True))
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{where}'s {kind} rope settings need a numeric rope_theta and "
                              f"{', '.join(fields) or 'nothing else'}.") from None
    return keys


def rope_fields(m: ModelConfig) -> dict:
    """The model's RoPE settings in the published spelling: rope_theta, and rope_scaling (null for none)."""
    if m.rope_scaling == "none":
        return {"rope_theta": m.rope_theta, "rope_scaling": None}
    scaling: dict[str, object] = {"rope_type": HF_TYPES[m.rope_scaling], "factor": m.rope_factor}
    if m.rope_scaling == "llama3":
        scaling.update(low_freq_factor=m.rope_low_freq_factor, high_freq_factor=m.rope_high_freq_factor)
    if m.rope_scaling in ("llama3", "yarn"):
        scaling[ORIGINAL] = m.rope_original_context
    if m.rope_scaling == "yarn":
        scaling.update(beta_fast=m.rope_beta_fast, beta_slow=m.rope_beta_slow, truncate=m.rope_truncate)
        if m.rope_mscale_all_dim:  # jaxpar's ratio needs both; transformers takes mscale alone as no mscale
            scaling["mscale_all_dim"] = m.rope_mscale_all_dim
            if m.rope_mscale:
                scaling["mscale"] = m.rope_mscale
    return {"rope_theta": m.rope_theta, "rope_scaling": scaling}


def latent_softmax_scale(parameters: dict, head_width: int) -> float:
    """What DeepSeek-V3's attention multiplies q.k by (transformers' yarn_apply_mscale): head_width^-0.5
    (nope + rope dimensions), times yarn's mscale(factor, mscale_all_dim) squared under any scaling that
    sets mscale_all_dim; computed in the same order, so the same double."""
    scaling = head_width ** (-0.5)
    if parameters.get("rope_type", "default") != "default" and parameters.get("mscale_all_dim", 0):
        factor = parameters["factor"]
        mscale = 0.1 * parameters["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scaling = scaling * mscale * mscale
    return scaling


def model_latent_scale(m: ModelConfig) -> float:
    """latent_softmax_scale of a jaxpar model's own settings (what its export's config.json implies)."""
    parameters = {"rope_type": HF_TYPES[m.rope_scaling], "factor": m.rope_factor,
                  "mscale_all_dim": m.rope_mscale_all_dim if m.rope_scaling == "yarn" else 0}
    return latent_softmax_scale(parameters, m.mla.qk_dim)
