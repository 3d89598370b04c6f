"""Hugging Face safetensors weights onto any layout, and back to files.

Loading: every parameter is assembled with `jax.make_array_from_single_device_arrays` from the
boxes its addressable devices hold (`sharding.addressable_devices_indices_map`). Each distinct box
is read once, straight from the memory-mapped source tensors (jaxpar.interop.hf_names), cast, and
put on the devices that hold it. So a device reads only its own slice of each tensor, a process
only its devices' slices, and no whole model is ever built on one host or one device: a
checkpoint larger than one device's memory loads onto a ZeRO-3 or tensor-parallel layout.

Saving: one layer (of one expert, for a mixture of experts) of one parameter at a time is brought to
the host, split into the checkpoint's tensors and written into its shard (jaxpar.interop.safetensors),
so the host holds one layer of one tensor, whatever the model's size.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from jaxpar.config.hf_config import CONFIG_FILE, CheckpointError, hf_config, read_config
from jaxpar.config.model import ModelConfig
from jaxpar.data.token_folder import COMPANION_FILES, EOD, TOKENIZER, added_token_id, tokenizer_vocab
from jaxpar.interop.hf_names import TensorMap, tensor_maps
from jaxpar.interop.safetensors import DTYPES, Checkpoint, write_checkpoint
from jaxpar.model.axes import is_variable, path_names

GENERATION_CONFIG = "generation_config.json"
MAX_SHARD_BYTES = 5 * 2 ** 30  # transformers' default shard size


def open_checkpoint(m: ModelConfig) -> Checkpoint:
    """The safetensors of `m.from_hf`, checked against its config.json before anything is read or
    compiled: every tensor the model needs is there with the shape config.json implies, and the
    folder's tokenizer (if it has one) fits in the vocabulary. Raises CheckpointError."""
    folder = Path(m.from_hf)
    checkpoint = Checkpoint(folder)
    for tensor_map in tensor_maps(m):
        for name in tensor_map.names():
            shape = checkpoint.shape(name)
            if shape is None:
                raise CheckpointError(f"{folder} lacks the tensor {name}, which the model its {CONFIG_FILE} "
                                      f"describes has.")
            if shape != tensor_map.source_shape:
                raise CheckpointError(f"{name} in {folder} has shape {list(shape)}, but its {CONFIG_FILE} "
                                      f"implies {list(tensor_map.source_shape)}.")
    if (folder / TOKENIZER).is_file():
        ids = tokenizer_vocab(folder / TOKENIZER)
        if ids > m.vocab_size:
            raise CheckpointError(f"{folder}'s {TOKENIZER} produces ids up to {ids - 1}, but its {CONFIG_FILE} "
                                  f"has vocab_size {m.vocab_size}; the tokenizer and the weights do not belong "
                                  f"together.")
    return checkpoint



def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def load_params(checkpoint: Checkpoint, m: ModelConfig, shardings, dtype=np.float32, progress: bool = True):
    """The model's parameters read from `checkpoint` into `shardings` (an nnx.State of shardings in
    model order, as the layout places the parameters). Returns (the nnx.State of jax.Arrays, the
    bytes each device's slices took from the files, by device id)."""
    maps = {tensor_map.path: tensor_map for tensor_map in tensor_maps(m)}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shardings, is_leaf=is_variable)
    per_device: dict[int, int] = {}
    arrays = []
    for path, variable in tqdm(leaves, desc=f"load {Path(m.from_hf).name}", unit="tensor", disable=not progress,
                               file=sys.stderr):
        tensor_map = maps[path_names(path)]
        arrays.append(variable.replace(_assemble(checkpoint, tensor_map, variable.get_value(), dtype, per_device)))
    return jax.tree_util.tree_unflatten(treedef, arrays), per_device


def _assemble(checkpoint: Checkpoint, tensor_map: TensorMap, sharding, dtype, per_device: dict) -> jax.Array:
    """One parameter, each distinct box of it read once and put on every device that holds it."""
    shape = tensor_map.shape
    holders: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        holders.setdefault(_box(index, shape), []).append(device)
    pieces = []
    for box, devices in holders.items():
        before = checkpoint.bytes_read
        value = tensor_map.read(checkpoint.read, box).astype(dtype)
        for device in devices:
            per_device[device.id] = per_device.get(device.id, 0) + checkpoint.bytes_read - before
            pieces.append(jax.device_put(value, device))
    return jax.make_array_from_single_device_arrays(shape, sharding, pieces)


def save_params(params, m: ModelConfig, folder: Path, dtype: str, source: Path | None,
                tokenizer: Path | None, progress: bool = True) -> list[str]:
    """Write `params` (an nnx.State of the model's parameters, in model order) into `folder` as a
    Hugging Face checkpoint: config.json, safetensors of `dtype` ('float32' or 'bfloat16', sharded above
    5 GiB with the index), and the tokenizer files of `tokenizer` (a folder holding a tokenizer.json)
    and the generation settings of `source` (the checkpoint the model came from), where they exist.
    Returns the names of the files written."""
    source_config = read_config(source) if source is not None and (source / CONFIG_FILE).is_file() else None
    config = hf_config(m, dtype, source_config)
    values = {path_names(path): v.get_value() for path, v in
              jax.tree_util.tree_flatten_with_path(params, is_leaf=is_variable)[0]}
    maps = tensor_maps(m)
    owner = {name: (tensor_map, layer, expert) for tensor_map in maps for layer in range(max(tensor_map.layers, 1))
             for expert in range(max(tensor_map.experts, 1)) for name in tensor_map.names(layer, expert)}
    plan = [(name, tensor_map.source_shape) for tensor_map in maps for name in tensor_map.names()]
    made: dict[str, np.ndarray] = {}

    def tensor(name: str) -> np.ndarray:
        if name not in made:  # one layer (of one expert) of one parameter on the host at a time
            tensor_map, layer, expert = owner[name]
            index = ((layer,) if tensor_map.layers else ()) + ((expert,) if tensor_map.experts else ())
            made.clear()
            made.update(tensor_map.to_sources(np.asarray(values[tensor_map.path][index], np.float32), layer, expert))
        return made[name]

    file_dtype = DTYPES[_SAFETENSORS_DTYPE[dtype]]
    total = sum(int(np.prod(shape)) for _, shape in plan) * file_dtype.itemsize
    with tqdm(total=total, unit="B", unit_scale=True, desc="export", disable=not progress, file=sys.stderr) as bar:
        files = write_checkpoint(folder, plan, file_dtype, tensor, MAX_SHARD_BYTES, bar.update)
    files.append(CONFIG_FILE)
    for origin, names in ((tokenizer, (TOKENIZER, *COMPANION_FILES)), (source, (GENERATION_CONFIG,))):
        for name in names:
            if origin is not None and (origin / name).is_file():
                shutil.copyfile(origin / name, folder / name)
                files.append(name)
    if TOKENIZER in files and COMPANION_FILES[0] not in files:  # a tokenizer jaxpar trained: say what reads it
        settings, eod = _trained_tokenizer_settings(folder / TOKENIZER)
        (folder / COMPANION_FILES[0]).write_text(json.dumps(settings) + "\n")
        files.append(COMPANION_FILES[0])
        if eod is not None and config.get("eos_token_id") is None:
            config["eos_token_id"] = eod
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return files


def _trained_tokenizer_settings(path: Path) -> tuple[dict, int | None]:
    """The tokenizer_config.json of a tokenizer jaxpar trained, and its end-of-document id: its class, its
    end-of-document token as the end of sequence (what generation stops at, and lm-eval's prefix), and its
    decoding as the tokenizers library does it (no clean-up of spaces before punctuation)."""
    eod = added_token_id(path, EOD)
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    return ({**settings, "eos_token": EOD} if eod is not None else settings), eod


_SAFETENSORS_DTYPE = {"float32": "F32", "bfloat16": "BF16"}
