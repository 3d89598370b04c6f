"""Hugging Face checkpoints in and out: `load` and `save` from Python, `export_run` for `jaxpar export-hf`.

    model, cfg = jaxpar.interop.hf.load("Llama-3.2-1B")      # a Transformer and its Config
    logits_BLV = model(tokens_BL)                             # fp32 logits (B, L, V)
    jaxpar.interop.hf.save(model, cfg, "out")                 # config.json, safetensors, tokenizer

Training from a checkpoint is `model.from_hf=DIR` on any `jaxpar train`, `verify` or `plan`: the
trainer reads each device's slices onto its layout (jaxpar.interop.hf_weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxpar.config import MESH_AXES, Config, ParallelConfig
from jaxpar.config.hf_config import config_for, family_of
from jaxpar.data.folders import is_free, new_folder
from jaxpar.data.token_folder import tokenizer_folder
from jaxpar.errors import UserError
from jaxpar.features import with_derived
from jaxpar.interop.hf_weights import load_params, open_checkpoint, save_params
from jaxpar.interop.peft import CONFIG as ADAPTER_CONFIG
from jaxpar.interop.peft import MODULES as PEFT_MODULES
from jaxpar.interop.peft import check_exportable, read_adapter, write_adapter
from jaxpar.interop.saved_run import SavedRun
from jaxpar.model.adapters import Frozen, freeze_state, merged_weights
from jaxpar.model.axes import is_variable, path_names
from jaxpar.model.transformer import Transformer
from jaxpar.parallel.layout import Layout
from jaxpar.runtime.devices import make_mesh

DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
NUMPY_DTYPES = {"float32": np.float32, "bfloat16": jax.numpy.bfloat16}
ONE_DEVICE = dict.fromkeys(MESH_AXES, 1)


def _dtype_name(dtype: str) -> str:
    """'float32' or 'bfloat16' for any of their spellings; raises UserError for another dtype."""
    if dtype not in DTYPE_NAMES:
        raise UserError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}.")
    return DTYPE_NAMES[dtype]


def load(folder: str | Path, dtype: str = "float32", progress: bool = False, adapter: str | Path | None = None,
         **overrides) -> tuple[Transformer, Config]:
    """The checkpoint in `folder` as a jaxpar Transformer on the first device, with its weights in
    `dtype` ('float32' or 'bfloat16'), and its Config (`overrides`: other dotted keys, such as
    **{"model.seq_len": 4096}). Calling the model on int tokens (B, L) returns fp32 logits (B, L, V).
    `adapter`: a peft LoRA adapter folder for this checkpoint, put on the model (its rank, alpha and
    targets from its adapter_config.json): the model's base weights are then frozen, its adapters train."""
    wanted = NUMPY_DTYPES[_dtype_name(dtype)]
    if adapter is not None:
        overrides = {**adapter_settings(adapter), **overrides}
    cfg = with_derived(config_for(folder, **overrides), ONE_DEVICE)  # an MoE's routing group size filled in
    checkpoint = open_checkpoint(cfg.model)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: one_device, abstract)
    if adapter is None:
        params, _ = load_params(checkpoint, cfg.model, shardings, wanted, progress)
        return nnx.merge(graphdef, params), cfg
    frozen, adapters = nnx.split_state(shardings, Frozen, nnx.LoRAParam)
    base = freeze_state(load_params(checkpoint, cfg.model, frozen, np.float32, progress)[0])
    values = read_adapter(adapter, cfg.model)
    adapters = jax.tree_util.tree_map_with_path(
        lambda p, v: v.replace(jax.device_put(values[path_names(p)], one_device)), adapters, is_leaf=is_variable)
    return nnx.merge(graphdef, nnx.merge_state(base, adapters)), cfg


def adapter_settings(folder: str | Path) -> dict:
    """The model.lora settings of a peft adapter folder (its rank, alpha and target modules)."""
    config_file = Path(folder) / ADAPTER_CONFIG
    if not config_file.is_file():
        raise UserError(f"'{folder}' holds no {ADAPTER_CONFIG}: not a peft adapter folder.")
    config = json.loads(config_file.read_text())
    modules = config.get("target_modules") or []
    targets = [t for t, (module, _, _) in PEFT_MODULES.items() if module.split(".")[1] in modules]
    return {"model.lora.rank": config.get("r", 0), "model.lora.alpha": float(config.get("lora_alpha", 0)),
            "model.lora.targets": ",".join(targets)}


def split_over_devices(cfg: Config):
    """Shardings that split a model of `cfg` over every local device (ZeRO-3 over a data axis): where an
    export puts the weights it restores, so no device holds the whole model."""

    devices = jax.local_devices()
    sizes = {**dict.fromkeys(MESH_AXES, 1), "data": len(devices)}
    mesh = make_mesh(sizes, devices, dict.fromkeys(sizes, 1))
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))
    layout = Layout.build(mesh, abstract, Transformer.STACKED_AT, ParallelConfig(zero=3))
    return layout.named(layout.param_specs(abstract))


def _write(params, cfg: Config, out: Path, dtype: str, progress: bool) -> list[str]:
    family_of(cfg.model)  # one sentence for a model no family can hold, before anything is written
    if not is_free(out):
        raise UserError(f"--out '{out}' exists and is not an empty folder; choose a new one.")
    source = Path(cfg.model.from_hf) if cfg.model.from_hf and Path(cfg.model.from_hf).is_dir() else None
    with new_folder(out) as work:
        return save_params(params, cfg.model, work, _dtype_name(dtype), source,
                           tokenizer_folder(cfg.data, cfg.model.from_hf), progress)


def save(model: Transformer, config: Config, folder: str | Path, dtype: str = "float32",
         progress: bool = False) -> list[str]:
    """Write `model` (a jaxpar Transformer of `config`) as a Hugging Face checkpoint into the new folder
    `folder`: the files `jaxpar export-hf` writes, a model with adapters with them merged into its weights.
    Returns their names."""
    return _write(_weights(model, config), config, Path(folder), dtype, progress)


def save_adapter(model: Transformer, config: Config, folder: str | Path) -> list[str]:
    """Write the LoRA adapters of `model` as peft stores them (adapter_config.json and
    adapter_model.safetensors) into the new folder `folder`. Returns their names."""
    check_exportable(config.model)
    return _write_adapter(nnx.state(model, nnx.LoRAParam), config, Path(folder))


def _weights(model: Transformer, config: Config):
    """The full weights: the parameters, or with adapters their merged weights (by path)."""
    if not config.model.lora.enabled:
        return nnx.state(model, nnx.Param)
    return _nested(merged_weights(model))


def _nested(flat: dict[tuple, object]) -> nnx.State:
    """{path: array} as the nnx.State of parameters the writer takes."""
    return nnx.from_flat_state([(path, nnx.Param(value)) for path, value in flat.items()])


def _write_adapter(adapters, cfg: Config, out: Path) -> list[str]:
    if not is_free(out):
        raise UserError(f"--out '{out}' exists and is not an empty folder; choose a new one.")
    values = {path_names(p): v.get_value() for p, v in
              jax.tree_util.tree_flatten_with_path(adapters, is_leaf=is_variable)[0]}
    with new_folder(out) as work:
        return write_adapter(work, values, cfg.model)


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None, dtype: str = "bfloat16",
               progress: bool = True, adapter: bool = False, merge: bool = False) -> dict:
    """`jaxpar export-hf`: the weights of a run's checkpoint (the newest, or `step`) as a Hugging Face
    checkpoint in `out`; of a run with adapters, `merge` writes them merged into the weights and
    `adapter` the adapters alone as peft stores them. Returns what was written."""

    _dtype_name(dtype)
    run = SavedRun(run_dir)
    try:
        step = run.step(step)
        cfg = run.config(step)
        _check_export(cfg, adapter, merge)
        family_of(cfg.model)  # one sentence before any weight is read
        if not is_free(Path(out)):
            raise UserError(f"--out '{out}' exists and is not an empty folder; choose a new one.")
        params = run.params(step, cfg, split_over_devices(cfg))
    finally:
        run.close()
    if adapter:
        files = _write_adapter(nnx.split_state(params, Frozen, nnx.LoRAParam)[1], cfg, Path(out))
        return {"step": step, "adapter": True, "files": files, "out": str(out)}
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))
    weights = _nested(merged_weights(nnx.merge(graphdef, params))) if merge else params
    files = _write(weights, cfg, Path(out), dtype, progress)
    family = json.loads((Path(out) / "config.json").read_text())["model_type"]
    return {"step": step, "family": family, "dtype": _dtype_name(dtype), "files": files, "out": str(out)}


def _check_export(cfg: Config, adapter: bool, merge: bool) -> None:
    """One sentence for an export the run cannot give (before any weight is read)."""
    if adapter and merge:
        raise UserError("--adapter writes the adapters alone and --merge the weights with them merged in; "
                        "choose one.")
    if adapter:
        check_exportable(cfg.model)
    elif cfg.model.lora.enabled and not merge:
        raise UserError("this run trains LoRA adapters: export them with --adapter (peft's files, for the "
                        "base checkpoint) or --merge (full weights with the adapters merged in).")
    elif merge and not cfg.model.lora.enabled:
        raise UserError("--merge merges a run's adapters into its weights, but this run has none "
                        "(model.lora.rank is 0); export-hf without it writes its weights.")
