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
from jaxpar.data.folders import is_free, new_folder
from jaxpar.data.token_folder import tokenizer_folder
from jaxpar.errors import UserError
from jaxpar.features import with_derived
from jaxpar.interop.hf_config import config_for, family_of
from jaxpar.interop.hf_weights import load_params, open_checkpoint, save_params
from jaxpar.model.transformer import Transformer
from jaxpar.parallel.layout import Layout
from jaxpar.runtime.devices import make_mesh
from jaxpar.train.saved_run import SavedRun

DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
NUMPY_DTYPES = {"float32": np.float32, "bfloat16": jax.numpy.bfloat16}
ONE_DEVICE = dict.fromkeys(MESH_AXES, 1)


def _dtype_name(dtype: str) -> str:
    """'float32' or 'bfloat16' for any of their spellings; raises UserError for another dtype."""
    if dtype not in DTYPE_NAMES:
        raise UserError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}.")
    return DTYPE_NAMES[dtype]


def load(folder: str | Path, dtype: str = "float32", progress: bool = False, **overrides) -> tuple[Transformer, Config]:
    """The checkpoint in `folder` as a jaxpar Transformer on the first device, with its weights in
    `dtype` ('float32' or 'bfloat16'), and its Config (`overrides`: other dotted keys, such as
    **{"model.seq_len": 4096}). Calling the model on int tokens (B, L) returns fp32 logits (B, L, V)."""
    wanted = NUMPY_DTYPES[_dtype_name(dtype)]
    cfg = with_derived(config_for(folder, **overrides), ONE_DEVICE)  # an MoE's routing group size filled in
    checkpoint = open_checkpoint(cfg.model)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params, _ = load_params(checkpoint, cfg.model, jax.tree.map(lambda _: one_device, abstract), wanted, progress)
    return nnx.merge(graphdef, params), cfg


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
    `folder`: the files `jaxpar export-hf` writes. Returns their names."""
    return _write(nnx.state(model, nnx.Param), config, Path(folder), dtype, progress)


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None, dtype: str = "bfloat16",
               progress: bool = True) -> dict:
    """`jaxpar export-hf`: the weights of a run's checkpoint (the newest, or `step`) as a Hugging Face
    checkpoint in `out`. Returns what was written."""

    _dtype_name(dtype)
    run = SavedRun(run_dir)
    try:
        step = run.step(step)
        cfg = run.config(step)
        family_of(cfg.model)  # one sentence before any weight is read
        if not is_free(Path(out)):
            raise UserError(f"--out '{out}' exists and is not an empty folder; choose a new one.")
        params = run.params(step, cfg, split_over_devices(cfg))
    finally:
        run.close()
    files = _write(params, cfg, Path(out), dtype, progress)
    family = json.loads((Path(out) / "config.json").read_text())["model_type"]
    return {"step": step, "family": family, "dtype": _dtype_name(dtype), "files": files, "out": str(out)}
