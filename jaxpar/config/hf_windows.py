"""Which layers of a Hugging Face checkpoint attend through a sliding window, as jaxpar's model.window and
model.attention_pattern (one period of 'l' local and 'g' global letters, repeated over the layers), and
back. Pure Python (no jax).

The families say it differently (transformers 5.25): Mistral and Mixtral window every layer by
sliding_window (null: none; Mistral's default 4096); Qwen 2 and Qwen 3 window the layers their
layer_types name sliding_attention (by default those from max_window_layers on), and only when
use_sliding_window; Qwen3-MoE every layer when use_sliding_window; Gemma 3 and gpt-oss name each layer
in layer_types, else Gemma 3 makes every sliding_window_pattern-th layer global (6 when the field is
missing: transformers ignores the underscored `_sliding_window_pattern` that some files carry) and
gpt-oss alternates from a sliding first layer. A window that covers every position a query can see
still counts: the model keeps it, and so does its export.
"""

from __future__ import annotations

from pathlib import Path

from jaxpar.config.hf_errors import CheckpointError
from jaxpar.config.model import ModelConfig

SLIDING, FULL = "sliding_attention", "full_attention"
EVERY_LAYER = ("mistral", "mixtral", "qwen3_moe")


def _default_types(hf: dict, window: int | None) -> list[str]:
    """layer_types as the family's config fills them in when the file has none."""
    family, layers = hf["model_type"], hf["num_hidden_layers"]
    if family in ("qwen2", "qwen3"):
        first = hf.get("max_window_layers", 28)
        return [SLIDING if window is not None and i >= first else FULL for i in range(layers)]
    if family == "gemma3_text":
        period = hf.get("sliding_window_pattern", 6)
        return [SLIDING if (i + 1) % period else FULL for i in range(layers)]
    return [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]  # gpt-oss


def _window(hf: dict) -> int | None:
    family = hf["model_type"]
    if family in ("qwen2", "qwen3", "qwen3_moe"):  # a window only with use_sliding_window
        return hf.get("sliding_window", 4096) if hf.get("use_sliding_window") else None
    defaults = {"mistral": 4096, "gemma3_text": 4096, "gpt_oss": 128}
    return hf.get("sliding_window", defaults.get(family))


def window_settings(hf: dict, where: Path) -> dict[str, object]:
    """model.window and model.attention_pattern of a config.json; raises CheckpointError for layer kinds
    jaxpar does not have."""
    family, layers = hf["model_type"], hf["num_hidden_layers"]
    off = {"model.window": 0, "model.attention_pattern": ""}
    if family not in (*EVERY_LAYER, "qwen2", "qwen3", "gemma3_text", "gpt_oss"):
        return off  # Llama, DeepSeek-V3: full causal attention
    window = _window(hf)
    if family in EVERY_LAYER:
        types = [SLIDING] * layers
    else:
        types = hf.get("layer_types") or _default_types(hf, window)
    if not isinstance(types, list) or len(types) != layers or set(types) - {SLIDING, FULL}:
        raise CheckpointError(f"{where}'s layer_types must list {SLIDING} or {FULL} for each of its {layers} "
                              f"layers, as jaxpar reads it.")
    if window is None or SLIDING not in types:
        return off
    if not isinstance(window, int) or window <= 0:
        raise CheckpointError(f"{where} has sliding_window={window!r}; a window is a positive integer.")
    if FULL not in types:
        return {"model.window": window, "model.attention_pattern": ""}
    return {"model.window": window, "model.attention_pattern": _pattern([t == SLIDING for t in types])}


def _pattern(local: list[bool]) -> str:
    """The shortest period of the layers' kinds whose repeats make them all: jaxpar stacks the layers in units
    of that many blocks. A list that repeats nowhere is one unit of all the layers (gemma-3-1b's 26: five
    sliding, one global, four times, then two sliding)."""
    n = len(local)
    period = next(p for p in range(1, n + 1) if n % p == 0 and all(local[i] == local[i % p] for i in range(n)))
    return "".join("l" if is_local else "g" for is_local in local[:period])


def layer_types(m: ModelConfig) -> list[str]:
    """Each layer's kind, as layer_types lists it."""
    return [SLIDING if m.layer_is_local(i) else FULL for i in range(m.n_layers)]


def window_fields(m: ModelConfig, family: str) -> dict[str, object]:
    """A new config.json's window fields for a model of `family` (its window and pattern; family_of has
    checked that the family holds them)."""
    window = m.window or None
    if family in ("mistral", "mixtral"):
        return {"sliding_window": window}
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        fields: dict[str, object] = {"use_sliding_window": bool(window), "sliding_window": window}
        if family != "qwen3_moe":
            fields.update(max_window_layers=0 if window else m.n_layers, layer_types=layer_types(m))
        return fields
    if family in ("gemma3_text", "gpt_oss"):
        return {"sliding_window": window, "layer_types": layer_types(m)}
    return {}
