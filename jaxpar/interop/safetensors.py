"""The safetensors format, read lazily and written in shards, with NumPy alone.

A file is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and
byte range) and the raw little-endian data. jaxpar reads it itself rather than through the
`safetensors` package: that package's NumPy backend cannot hold bfloat16 (the dtype every
published Llama, Mistral and Qwen checkpoint is stored in), and its jax backend reads whole
tensors. Here a read is a box of one tensor taken from a memory map (ml_dtypes gives NumPy a
bfloat16), so a device that holds a slice reads that slice and nothing else.

A checkpoint folder holds `model.safetensors`, or shards listed in `model.safetensors.index.json`.
`Checkpoint` checks every header against the files before anything is read: a missing shard, a
header that is not JSON, and a file shorter than its header says (cut short) are one-sentence
CheckpointErrors.
"""

from __future__ import annotations

import json
import math
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxpar.config.hf_errors import CheckpointError

INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"
DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
          "BF16": np.dtype(ml_dtypes.bfloat16)}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
ALIGN = 8  # the header is padded so the data starts on an 8-byte boundary, as the safetensors library does


def _check_entry(path: Path, name: str, entry) -> None:
    """A header entry: a known dtype, a shape, and a byte range of exactly that many elements."""
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        sizes_fit = all(isinstance(n, int) and n >= 0 for n in shape) and 0 <= begin <= end
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}'s header entry for {name} lacks its dtype, shape or data_offsets.") from None
    if dtype not in DTYPES:
        raise CheckpointError(f"{path} stores {name} as {dtype}; jaxpar reads {', '.join(DTYPES)}.")
    if not sizes_fit or end - begin != math.prod(shape) * DTYPES[dtype].itemsize:
        raise CheckpointError(f"{path}'s header gives {name} a byte range that does not hold its shape {shape}.")


class SafetensorsFile:
    """One .safetensors file: its header parsed and checked against the file's size; tensors read
    as boxes through memory maps."""

    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with path.open("rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8)) if size >= 8 else (None,)
                if header_len is None or 8 + header_len > size:
                    raise CheckpointError(f"{path} is cut short: its header does not fit in its {size} bytes.")
                header = json.loads(f.read(header_len).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, struct.error):
            raise CheckpointError(f"{path} is not a safetensors file (its header is not JSON).") from None
        except OSError as e:
            raise CheckpointError(f"{path} cannot be read ({e.strerror or type(e).__name__}).") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path} is not a safetensors file (its header is not a JSON object).")
        header.pop("__metadata__", None)
        for name, entry in header.items():
            _check_entry(path, name, entry)
        self.data_start = 8 + header_len
        self.entries: dict[str, dict] = header
        end = max((e["data_offsets"][1] for e in header.values()), default=0)
        if self.data_start + end > size:
            raise CheckpointError(f"{path} is cut short: it has {size} bytes, but its header lists "
                                  f"{self.data_start + end}.")
        self._maps: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()  # devices' reads may come from several threads

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def _map(self, name: str) -> np.ndarray:
        with self._lock:
            if name not in self._maps:
                entry = self.entries[name]
                shape = tuple(entry["shape"])
                self._maps[name] = (np.memmap(self.path, DTYPES[entry["dtype"]], "r",
                                              self.data_start + entry["data_offsets"][0], shape)
                                    if math.prod(shape) else np.zeros(shape, DTYPES[entry["dtype"]]))
            return self._maps[name]

    def read(self, name: str, box: tuple[tuple[int, int], ...]) -> np.ndarray:
        """The box [start, stop) per dimension of tensor `name`, copied out of the memory map."""
        return np.array(self._map(name)[tuple(slice(a, b) for a, b in box)])


class Checkpoint:
    """The safetensors files of a checkpoint folder, by tensor name. `bytes_read` counts the bytes
    every read has copied out of them."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        index = folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                files = {name: folder / str(file) for name, file in weight_map.items()}
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise CheckpointError(f"{index} cannot be read as a safetensors index (a JSON object with a "
                                      f"weight_map).") from None
        else:
            found = sorted(folder.glob("*.safetensors"))
            if not found:
                raise CheckpointError(f"{folder} holds no *.safetensors weights.")
            files = {}
            for path in found:
                files.update({name: path for name in SafetensorsFile(path).entries})
        self.files: dict[Path, SafetensorsFile] = {}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise CheckpointError(f"shard {path.name} listed in {index} is missing.")
            self.files[path] = SafetensorsFile(path)
        self.where: dict[str, SafetensorsFile] = {}
        for name, path in files.items():
            if name not in self.files[path].entries:
                raise CheckpointError(f"{index} puts {name} in {path.name}, which does not hold it.")
            self.where[name] = self.files[path]
        self.bytes_read = 0

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The stored shape of tensor `name`, or None when the checkpoint lacks it."""
        return self.where[name].shape(name) if name in self.where else None

    def read(self, name: str, box: tuple[tuple[int, int], ...]) -> np.ndarray:
        """The box [start, stop) per dimension of tensor `name`."""
        array = self.where[name].read(name, box)
        self.bytes_read += array.nbytes
        return array


def write_file(path: Path, plan: list[tuple[str, tuple[int, ...]]], dtype: np.dtype,
               tensor: Callable[[str], np.ndarray]) -> int:
    """One safetensors file of the tensors in `plan` ((name, shape) in order) as `dtype`, each made by
    `tensor(name)` only when it is written, so one tensor at a time is in memory. Returns the bytes
    of tensor data written."""
    header, offset = {}, 0
    for name, shape in plan:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}  # transformers refuses files without it
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % ALIGN)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape in plan:
            array = np.asarray(tensor(name)).astype(dtype.newbyteorder("<"))
            if array.shape != tuple(shape):
                raise ValueError(f"{name} was planned as {shape} but made as {array.shape}")
            f.write(np.ascontiguousarray(array).tobytes())
    return offset


def write_checkpoint(folder: Path, plan: list[tuple[str, tuple[int, ...]]], dtype: np.dtype,
                     tensor: Callable[[str], np.ndarray], max_shard_bytes: int,
                     progress: Callable[[int], None] | None = None) -> list[str]:
    """Write the tensors named in `plan` ((name, shape) in order) as `dtype` in shards of at most
    `max_shard_bytes` (a tensor larger than that gets a shard of its own), each tensor made only when it
    is written (`tensor(name)`). A single file is model.safetensors; several are
    model-0000i-of-0000N.safetensors with the index. Returns the file names."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in plan:
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total = {}, 0
    for file, members in zip(names, shards):
        written = write_file(folder / file, members, dtype, tensor)
        weight_map.update({name: file for name, _ in members})
        total += written
        if progress is not None:
            progress(written)
    if len(shards) > 1:
        (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                    indent=2) + "\n")
    return names
