"""LoRA adapters as the peft library stores them, in and out, and a LoRA model's merged weights.

peft writes `adapter_config.json` (r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` with, for every adapted linear layer of layer i,
`base_model.model.model.layers.{i}.<module>.lora_A.weight` (r, in) and `...lora_B.weight` (out, r);
the layer computes W x + (lora_alpha / r) B A x. jaxpar's adapter of the same target holds A as
(inputs..., r) and B as (r, outputs...) with the heads as their own dimensions, stacked over layers
(jaxpar.model.adapters): the same numbers, transposed and flattened in Hugging Face's order
(jaxpar.interop.hf_names flattens heads the same way).

Pure NumPy on the host; a layer's tensors at a time for the merged weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxpar.config.adapters import LoRAConfig
from jaxpar.config.model import ModelConfig
from jaxpar.errors import UserError
from jaxpar.interop.safetensors import SafetensorsFile, write_file

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers.{layer}."
# each target: the module peft names, where jaxpar's adapter sits in a block, its input dimensions
MODULES = {"q": ("self_attn.q_proj", ("attn", "lora_q"), 1), "k": ("self_attn.k_proj", ("attn", "lora_k"), 1),
           "v": ("self_attn.v_proj", ("attn", "lora_v"), 1), "o": ("self_attn.o_proj", ("attn", "lora_o"), 2),
           "gate": ("mlp.gate_proj", ("mlp", "lora_gate"), 1), "up": ("mlp.up_proj", ("mlp", "lora_up"), 1),
           "down": ("mlp.down_proj", ("mlp", "lora_down"), 1)}


def check_exportable(m: ModelConfig) -> None:
    """One sentence for a model whose adapters peft's files cannot hold (before anything is read)."""
    if not m.lora.enabled:
        raise UserError("this run trains every weight (model.lora.rank is 0), so it has no adapter to write; "
                        "export-hf without --adapter writes its weights.")
    if m.moe.experts:
        raise UserError("writing a mixture of experts' adapters in peft's format is not built yet; --merge "
                        "writes the merged weights.")


def adapted_targets(m: ModelConfig) -> list[str]:
    """The targets that carry adapters in a dense model of `m` (gate only where the MLP is gated)."""
    return [t for t in m.lora.target_set if t in MODULES and (t != "gate" or m.gated_mlp)]


def adapter_tensors(values: dict, m: ModelConfig) -> dict[str, np.ndarray]:
    """peft's tensors from jaxpar's adapter values ({path: stacked array}, host or device)."""
    tensors = {}
    for target in adapted_targets(m):
        module, at, _ = MODULES[target]
        a, b = (np.asarray(values[("blocks", *at, part)], np.float32) for part in ("a", "b"))
        r = a.shape[-1]
        for layer in range(a.shape[0]):
            name = PREFIX.format(layer=layer) + module
            tensors[name + ".lora_A.weight"] = np.ascontiguousarray(a[layer].reshape(-1, r).T)
            tensors[name + ".lora_B.weight"] = np.ascontiguousarray(b[layer].reshape(r, -1).T)
    return tensors


def adapter_config(m: ModelConfig, base: str) -> dict:
    """adapter_config.json for jaxpar's adapters on `base` (the checkpoint they were trained on)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": m.lora.rank,
            "lora_alpha": m.lora.alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "target_modules": sorted(MODULES[t][0].split(".")[1] for t in adapted_targets(m)),
            "inference_mode": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {}, "alpha_pattern": {}, "revision": None}


def write_adapter(folder: Path, values: dict, m: ModelConfig) -> list[str]:
    """adapter_config.json and adapter_model.safetensors (fp32) of jaxpar's adapter values into `folder`."""
    tensors = adapter_tensors(values, m)
    write_file(folder / WEIGHTS, [(name, t.shape) for name, t in tensors.items()], np.dtype(np.float32),
               tensors.__getitem__)
    (folder / CONFIG).write_text(json.dumps(adapter_config(m, m.from_hf), indent=2) + "\n")
    return [CONFIG, WEIGHTS]


def read_adapter(folder: str | Path, m: ModelConfig) -> dict[tuple, np.ndarray]:
    """jaxpar's adapter values ({path: stacked array}) from a peft adapter folder made for a model of `m`,
    checked against model.lora and the model's shapes first (one sentence for a mismatch)."""
    folder = Path(folder)
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise UserError(f"model.lora.from_peft='{folder}' holds no {CONFIG} and {WEIGHTS}.")
    config = json.loads((folder / CONFIG).read_text())
    _check_config(config, m.lora, folder)
    file, values = SafetensorsFile(folder / WEIGHTS), {}
    for target in adapted_targets(m):
        module, at, ins = MODULES[target]
        values[("blocks", *at, "a")], values[("blocks", *at, "b")] = _read_target(file, module, ins, m, folder)
    return values


def _check_config(config: dict, lora: LoRAConfig, folder: Path) -> None:
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("use_rslora"):
        raise UserError(f"{folder} is not a plain LoRA adapter (peft_type LORA, without DoRA or rsLoRA).")
    if config.get("r") != lora.rank or float(config.get("lora_alpha", -1)) != lora.alpha:
        raise UserError(f"{folder} has r={config.get('r')} and lora_alpha={config.get('lora_alpha')}, but "
                        f"model.lora has rank={lora.rank} and alpha={lora.alpha}; set them to the adapter's.")
    modules = config.get("target_modules") or []
    wanted = sorted(MODULES[t][0].split(".")[1] for t in lora.target_set if t in MODULES)
    if sorted(set(modules) & {MODULES[t][0].split(".")[1] for t in MODULES}) != wanted:
        raise UserError(f"{folder} adapts {', '.join(sorted(modules))}, but model.lora.targets={lora.targets} "
                        f"names {', '.join(wanted)}.")


def _read_target(file: SafetensorsFile, module: str, ins: int, m: ModelConfig, folder: Path):
    """One target's A (layers, inputs..., r) and B (layers, r, outputs...), every layer's checked."""
    H, G, K, D, F = m.n_heads, m.kv_heads, m.head_size, m.d_model, m.d_ff
    in_dims, out_dims = {"self_attn.q_proj": ((D,), (H, K)), "self_attn.k_proj": ((D,), (G, K)),
                         "self_attn.v_proj": ((D,), (G, K)), "self_attn.o_proj": ((H, K), (D,)),
                         "mlp.gate_proj": ((D,), (F,)), "mlp.up_proj": ((D,), (F,)),
                         "mlp.down_proj": ((F,), (D,))}[module]
    r, a_layers, b_layers = m.lora.rank, [], []
    for layer in range(m.n_layers):
        name = PREFIX.format(layer=layer) + module
        expected = {".lora_A.weight": (r, int(np.prod(in_dims))), ".lora_B.weight": (int(np.prod(out_dims)), r)}
        for suffix, shape in expected.items():
            found = _shape(file, name + suffix)
            if found != shape:
                raise UserError(f"{folder}: {name + suffix} is {'missing' if found is None else list(found)}, but "
                                f"this model's {module} needs {list(shape)}; the adapter is for another base model.")
        whole = lambda n, s: file.read(n, tuple((0, d) for d in s))  # noqa: E731
        a_layers.append(whole(name + ".lora_A.weight", expected[".lora_A.weight"]).T.reshape(*in_dims, r))
        b_layers.append(whole(name + ".lora_B.weight", expected[".lora_B.weight"]).T.reshape(r, *out_dims))
    return np.stack(a_layers).astype(np.float32), np.stack(b_layers).astype(np.float32)


def _shape(file: SafetensorsFile, name: str):
    return file.shape(name) if name in file.entries else None
