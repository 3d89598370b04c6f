"""The in-memory copy of the training state (checkpoint.local_every): restored before the shared
checkpoints are read, when it is complete and fits the layout.

Every `local_every` steps each process writes the shards its devices hold to host memory that
outlives the process: a RAM-backed folder (/dev/shm), so a killed process's copy is still there
when it restarts on the same host. With several processes, each also sends its copy to the next
process (process p keeps process p-1's) through a collective-permute on the devices, so a host
that is replaced can take its shards back from its peer. A copy is written to a temporary name
and renamed when whole; older copies are deleted only once every process has renamed its new
one. The copy holds the arrays exactly as laid out (raw bytes per shard), so it restores only
onto the same layout: every process must find, for every array, the shards its devices need.
After an elastic change of the device count the shared checkpoint is read instead (it reshards).

The folder is <root>/<a hash of run.dir>/process-<p>/{own,peer}/<step>/copy.bin, root being
/dev/shm/jaxpar where /dev/shm exists (else the temporary folder). A finished run removes it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.interop.checkpoint_files import flat_by_path
from jaxpar.runtime import distributed
from jaxpar.train.checkpoint import CheckpointMismatch, Restored, check_compatible, state_spec

CHUNK_BYTES = 256 * 2 ** 20  # the copy passes to the peer in pieces of this size (device memory it needs at once)
_HEADER = struct.Struct("<Q")  # the length of the JSON index that precedes the arrays' bytes
_ALIGN = 64  # bytes: what XLA:CPU wants of a host buffer it may use without copying


def local_root() -> Path:
    """Where the in-memory copies live: /dev/shm (RAM) when the host has it."""
    shm = Path("/dev/shm")
    return shm / "jaxpar" if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir()) / "jaxpar-memory"


def run_folder(run_dir: str | Path) -> Path:
    """The in-memory copies of one run (keyed by its folder's absolute path)."""
    return local_root() / hashlib.sha256(str(Path(run_dir).absolute()).encode()).hexdigest()[:16]


def _index_key(index: tuple) -> str:
    """'0:4,:' for the shard (slice(0, 4), slice(None)) of an array."""
    return ",".join(f"{'' if s.start is None else s.start}:{'' if s.stop is None else s.stop}" for s in index)


def _complete_steps(folder: Path) -> list[int]:
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


class LocalCopies:
    """The in-memory copies of one run on this process: save every `every` steps, restore the newest."""

    def __init__(self, run_dir: str | Path, every: int):
        self.every, self.run = every, run_folder(run_dir)
        self.process, self.processes = jax.process_index(), jax.process_count()
        self.folder = self.run / f"process-{self.process}"

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    # ------------------------------------------------------------------------------------------ save
    def save(self, step: int, state, meta: dict) -> None:
        """Write this process's shards of `state` (and, with peers, the previous process's) as step `step`;
        then, once every process has, delete the older copies."""
        own = self._write(self.folder / "own", step, self._pack(state, meta))
        if self.processes > 1:
            self._replicate(step, own)
        distributed.share(f"memory copy {step}")  # every process's copy is whole before any old one goes
        for kind in ("own", "peer"):
            for old in _complete_steps(self.folder / kind):
                if old != step:
                    shutil.rmtree(self.folder / kind / str(old), ignore_errors=True)

    def _pack(self, state, meta: dict) -> list:
        """The JSON index and the bytes of every distinct shard this process holds, in one list of pieces."""
        entries, pieces, offset = [], [], 0
        for key, array in flat_by_path(state).items():
            seen = set()
            for shard in array.addressable_shards:
                index = _index_key(shard.index)
                if index in seen:  # replicas on this process's devices: one copy is enough
                    continue
                seen.add(index)
                data = np.asarray(jax.device_get(shard.data), order="C")  # (ascontiguousarray makes a scalar 1-d)
                entries.append([key, index, str(data.dtype), list(data.shape), offset, data.nbytes])
                pieces.append(data.reshape(-1).view(np.uint8))
                offset += data.nbytes
        header = json.dumps({"meta": meta, "processes": self.processes, "arrays": entries}).encode()
        return [_HEADER.pack(len(header)), header, *pieces]

    @staticmethod
    def _write(kind_folder: Path, step: int, pieces: list) -> Path:
        partial = kind_folder / f"{step}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        with (partial / "copy.bin").open("wb") as f:
            for piece in pieces:
                f.write(piece if isinstance(piece, bytes) else piece.tobytes())
        final = kind_folder / str(step)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)  # whole, or not there at all
        return final / "copy.bin"

    def _replicate(self, step: int, own: Path) -> None:
        """Keep the previous process's copy of `step` here (process p holds p-1's)."""
        received = pass_around(np.fromfile(own, dtype=np.uint8), shift=1)
        self._write(self.folder / "peer", step, [received.tobytes()])

    # --------------------------------------------------------------------------------------- restore
    def restore(self, trainer, newest_shared: int | None, where: str) -> Restored | None:
        """The newest copy that every process can read for this layout, when it is no older than the newest
        shared checkpoint (`newest_shared`); None otherwise (then the shared checkpoints are read)."""
        mine = {"own": _complete_steps(self.folder / "own"), "peer": _complete_steps(self.folder / "peer")}
        everyone = [json.loads(v) for v in distributed.share(json.dumps(mine))]
        n = len(everyone)
        held = {s for copies in everyone for s in copies["own"] + copies["peer"]}
        # a step is readable when every process has its own copy, or its peer (the next process) kept one
        step = max((s for s in held if all(s in everyone[q]["own"] or s in everyone[(q + 1) % n]["peer"]
                                           for q in range(n))), default=None)
        if step is None or (newest_shared is not None and step < newest_shared):
            return None
        needs_peer = [step not in everyone[q]["own"] for q in range(n)]
        blob = self._read(step, needs_peer)
        arrays = self._arrays(blob, trainer, where, step)
        if not all(json.loads(v) for v in distributed.share(json.dumps(arrays is not None))):
            return None
        abstract = trainer.abstract_state()
        leaves = [arrays[key] for key in flat_by_path(abstract)]
        return Restored(jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract), leaves), step)

    def _read(self, step: int, needs_peer: list[bool]) -> bytes:
        """This process's copy of `step`: its own, or the one its peer (the next process) kept for it."""
        if not any(needs_peer):
            return (self.folder / "own" / str(step) / "copy.bin").read_bytes()
        previous = (self.process - 1) % self.processes  # the process whose copy this one keeps
        sending = (np.fromfile(self.folder / "peer" / str(step) / "copy.bin", dtype=np.uint8)
                   if needs_peer[previous] else np.zeros(0, np.uint8))
        received = pass_around(sending, shift=-1)
        if needs_peer[self.process]:
            return received.tobytes()
        return (self.folder / "own" / str(step) / "copy.bin").read_bytes()

    def _arrays(self, blob: bytes, trainer, where: str, step: int) -> dict | None:
        """The state's arrays built from `blob` on the trainer's shardings, or None when the copy holds
        another state or layout than this one needs."""
        (length,) = _HEADER.unpack_from(blob)
        index = json.loads(blob[_HEADER.size:_HEADER.size + length])
        body = memoryview(blob)[_HEADER.size + length:]
        abstract = trainer.abstract_state()
        try:
            check_compatible(index["meta"], trainer.cfg, abstract, where)
        except CheckpointMismatch:
            return None  # the shared checkpoint says why, in its own sentence
        if index["processes"] != self.processes or index["meta"]["spec"] != state_spec(abstract):
            return None
        shards = {(key, shard): (dtype, shape, offset, size) for key, shard, dtype, shape, offset, size
                  in index["arrays"]}
        shardings, arrays, aligned = flat_by_path(trainer.state_shardings), {}, {}
        for key, leaf in flat_by_path(abstract).items():
            placed = []
            for device, shard_index in shardings[key].addressable_devices_indices_map(leaf.shape).items():
                found = shards.get((key, _index_key(shard_index)))
                if found is None:
                    return None
                dtype, shape, offset, size = found
                if offset not in aligned:
                    view = np.frombuffer(body[offset:offset + size], dtype=jnp.dtype(dtype)).reshape(shape)
                    aligned[offset] = _aligned_copy(view)
                placed.append(jax.device_put(aligned[offset], device))
            arrays[key] = jax.make_array_from_single_device_arrays(leaf.shape, shardings[key], placed)
        return arrays

    def remove(self) -> None:
        """Delete the run's copies on every process (a finished run needs none): process 0, after all."""
        distributed.share("memory copies done")
        if not distributed.is_secondary():
            shutil.rmtree(self.run, ignore_errors=True)


def _aligned_copy(view: np.ndarray) -> np.ndarray:
    """`view` copied to 64-byte-aligned memory, which the CPU backend's device_put uses in place (a copy of
    every replica otherwise: restoring 2.4 GB on 8 devices took 3.5 s instead of a shared checkpoint's 1.3 s)."""
    buffer = np.empty(view.nbytes + _ALIGN, np.uint8)
    start = -buffer.ctypes.data % _ALIGN
    out = buffer[start:start + view.nbytes].view(view.dtype).reshape(view.shape)
    out[...] = view
    return out


def _first_devices() -> list:
    """One device of each process, in process order."""
    first = {}
    for device in sorted(jax.devices(), key=lambda d: d.id):
        first.setdefault(device.process_index, device)
    return [first[p] for p in range(jax.process_count())]


@functools.cache
def _permute(shift: int):
    """A jitted collective-permute of one row per process to process (p + shift) mod N, and its sharding."""

    mesh = Mesh(np.asarray(_first_devices()), ("process",))
    count = mesh.devices.size
    pairs = [(p, (p + shift) % count) for p in range(count)]
    rows = PartitionSpec("process")
    step = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "process", pairs), mesh=mesh, in_specs=rows,
                                 out_specs=rows))
    return step, NamedSharding(mesh, rows)


def pass_around(data: np.ndarray, shift: int) -> np.ndarray:
    """Every process sends `data` (bytes) to process (p + shift) mod N and returns what it received, through a
    collective-permute between one device of each process, in pieces of at most CHUNK_BYTES."""
    sizes = [int(v) for v in distributed.share(str(data.size))]
    count, me = len(sizes), jax.process_index()
    permute, rows = _permute(shift)
    chunk = max(min(max(sizes), CHUNK_BYTES), 1)
    received = []
    for start in range(0, max(max(sizes), 1), chunk):
        piece = np.zeros((1, chunk), np.uint8)
        part = data[start:start + chunk]
        piece[0, :part.size] = part
        local = jax.device_put(piece, _first_devices()[me])
        moved = permute(jax.make_array_from_single_device_arrays((count, chunk), rows, [local]))
        received.append(np.asarray(moved.addressable_shards[0].data)[0])
    return np.concatenate(received)[:sizes[(me - shift) % count]]
