"""The plan of `data.packing=pack`: which pieces of which documents fill each row, computed once per
corpus, row width and seed, and kept beside the tokens.

Documents longer than a row are cut into row-sized pieces (preference pairs: each pair one unit of
two whole documents, see jaxpar.data.preference); the units are shuffled with the seed and each goes
to the first of the open rows with room for it, in the order the rows opened. When none has room
and `PACK_BUFFER` rows are open, the fullest (the first of equals) is closed and a new row opens.
The rows are the closed ones in closing order, then the open ones in the order they opened.

That first-fit is sequential, so it runs as one compiled `lax.scan` over the units' sizes on the
CPU (a few hundred nanoseconds a unit, so ten million documents plan in seconds), its state the
open rows' free room, ids and unit counts; NumPy builds the units before it and the plan (CSR
arrays: each row's pieces in the order they went in) after it. A token folder keeps its plans
(`pack-plan-<key>.npz`, the key a digest of the lengths, width, seed, pairs and PLAN_FORMAT), so a
second run loads its plan; a folder it cannot write to just means no cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import sys
import tempfile
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.data.preference import fitting_pairs

PACK_BUFFER = 64  # open rows a unit may go to
PLAN_FORMAT = 1  # bump when the plan of the same inputs changes: older cached plans are then not read
MIN_SCAN = 1024  # the shortest scan (see scan_length)
ARRAYS = ("row_starts", "piece_doc", "piece_offset", "piece_length")


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Rows of pieces (document, offset in it, length), as CSR arrays: row r's pieces are
    row_starts[r]:row_starts[r + 1] of piece_doc, piece_offset and piece_length, in the order they went in."""

    row_starts: np.ndarray  # (rows + 1,) int64
    piece_doc: np.ndarray
    piece_offset: np.ndarray
    piece_length: np.ndarray

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def row(self, r: int) -> list[tuple[int, int, int]]:
        """Row r's pieces as (document, offset, length)."""
        span = slice(int(self.row_starts[r]), int(self.row_starts[r + 1]))
        return list(zip(*(a[span].tolist() for a in (self.piece_doc, self.piece_offset, self.piece_length))))

    def pieces(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the pieces of `rows`, row after row, as indices into the piece arrays; each row's piece count)."""
        first = self.row_starts[rows]
        counts = self.row_starts[np.asarray(rows) + 1] - first
        return ranges(first, counts), counts

    def used(self, rows: np.ndarray) -> int:
        """The document tokens `rows` hold."""
        return int(self.piece_length[self.pieces(rows)[0]].sum())


def ranges(first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """first[0] .. first[0] + counts[0] - 1, then the same for each following entry, as one array."""
    total = int(np.sum(counts))
    begins = np.cumsum(counts) - counts
    return np.arange(total, dtype=np.int64) + np.repeat(np.asarray(first, np.int64) - begins, counts)


def pack_units(lengths: np.ndarray, width: int, pairs: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document, offset, length) of each unit's pieces, shape (units, pieces a unit): every
    document cut at `width` (one piece a unit), or every pair that fits a row (its two documents)."""
    lengths = np.asarray(lengths, np.int64)
    index = np.int32 if len(lengths) < 2 ** 31 and lengths.max(initial=0) < 2 ** 31 else np.int64
    if pairs:
        kept = fitting_pairs(lengths, width)
        doc_UP = np.stack([2 * kept, 2 * kept + 1], axis=1).astype(index)
        return doc_UP, np.zeros_like(doc_UP), lengths[doc_UP].astype(index)
    counts = (lengths + width - 1) // width
    doc_U = np.repeat(np.arange(len(lengths), dtype=index), counts)
    offset_U = (np.arange(len(doc_U), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)) * width
    offset_U = offset_U.astype(index)
    length_U = np.minimum(width, lengths[doc_U] - offset_U).astype(index)
    return doc_U[:, None], offset_U[:, None], length_U[:, None]


def _first_fit_step(width, state, size):
    """One unit of `size` tokens into the open rows, held in slots in the order they opened (a free
    slot's room is -1): (the new state, (the unit's row id, its place in the row, the id of the row it
    closed or -1))."""
    rooms, ids, counts, n_open, next_id = state
    slots = jnp.arange(PACK_BUFFER, dtype=jnp.int32)
    fits = rooms >= size
    k = jnp.argmax(fits)  # the first open row with room
    found = fits[k]
    close = ~found & (n_open == PACK_BUFFER)
    fullest = jnp.argmin(rooms)  # the first of the fullest: every slot is open when one must close
    outputs = (jnp.where(found, ids[k], next_id), jnp.where(found, counts[k], 0), jnp.where(close, ids[fullest], -1))
    shift = close & (slots >= fullest)  # closing a row moves the later ones up a slot
    rooms, ids, counts = (jnp.where(shift, jnp.roll(a, -1), a) for a in (rooms, ids, counts))
    new = ~found & (slots == jnp.where(close, PACK_BUFFER - 1, n_open))
    into = found & (slots == k)
    opened = (~found).astype(jnp.int32)
    state = (jnp.where(new, width - size, jnp.where(into, rooms - size, rooms)), jnp.where(new, next_id, ids),
             jnp.where(new, 1, jnp.where(into, counts + 1, counts)), jnp.minimum(n_open + opened, PACK_BUFFER),
             next_id + opened)
    return state, outputs


@jax.jit
def _first_fit(sizes, width):
    empty = jnp.full(PACK_BUFFER, -1, jnp.int32)
    init = (empty, empty, jnp.zeros(PACK_BUFFER, jnp.int32), jnp.int32(0), jnp.int32(0))
    state, outputs = jax.lax.scan(lambda s, size: _first_fit_step(width, s, size), init, sizes)
    return outputs, state[1], state[3]


def scan_length(count: int) -> int:
    """`count` rounded up to m * 2^e with 8 <= m < 16 (at most an eighth more), at least MIN_SCAN: the
    scan compiles once for each such length, not for every corpus."""
    step = 1 << max(count.bit_length() - 4, 0)
    return max(MIN_SCAN, -(-count // step) * step)


def first_fit(sizes: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(each unit's row, in the plan's row order; its place among that row's units; the row count) of
    units of `sizes` tokens placed first-fit in this order. Runs on the CPU, whatever the host's
    default device."""
    count = len(sizes)
    if count == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), 0
    # units of no tokens after the last one go to the first open row and change nothing the plan reads
    padded = np.zeros(scan_length(count), np.int32)
    padded[:count] = sizes
    try:  # this process's own CPU (in a multi-process run jax.devices lists every process's)
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS without the CPU: the scan runs where jax does
        cpu = jax.local_devices()[0]
    (row_ids, within, closed), open_ids, n_open = _first_fit(jax.device_put(padded, cpu),
                                                            jax.device_put(np.int32(width), cpu))
    del padded
    closed = np.asarray(closed)[:count]
    order = np.concatenate([closed[closed >= 0], np.asarray(open_ids)[:int(n_open)]])  # row ids in the plan's order
    del closed
    rank = np.empty(len(order), np.int32 if len(order) < 2 ** 31 else np.int64)
    rank[order] = np.arange(len(order))
    return rank[np.asarray(row_ids)[:count]], np.asarray(within)[:count], len(order)


def pack_plan(lengths: np.ndarray, width: int, seed: int, pairs: bool = False) -> PackPlan:
    """The plan of documents of `lengths` tokens in rows of `width` (see the module's docstring):
    units shuffled with `seed`, then placed first-fit over PACK_BUFFER open rows."""
    doc_UP, offset_UP, length_UP = pack_units(lengths, width, pairs)
    order = np.random.default_rng(seed).permutation(len(doc_UP))
    order = order.astype(np.int32) if len(order) < 2 ** 31 else order
    row, within, n_rows = first_fit(length_UP.sum(axis=1, dtype=np.int32)[order], width)
    unit_starts = np.concatenate([[0], np.cumsum(np.bincount(row, minlength=n_rows))])
    place = np.empty_like(order)  # the units row after row, each row's in the order they went in
    place[unit_starts[row] + within] = order
    del row, within, order
    per_unit = doc_UP.shape[1]
    return PackPlan(unit_starts * per_unit, *(a[place].ravel() for a in (doc_UP, offset_UP, length_UP)))


def plan_key(lengths: np.ndarray, width: int, seed: int, pairs: bool) -> str:
    """A digest of everything the plan depends on: the documents' lengths, the row width, the seed,
    pairs, the buffer and PLAN_FORMAT."""
    digest = hashlib.sha256(f"{PLAN_FORMAT} {PACK_BUFFER} {width} {seed!r} {pairs}\n".encode())
    digest.update(np.ascontiguousarray(lengths, dtype="<i8").data)
    return digest.hexdigest()[:32]


def cached_pack_plan(lengths: np.ndarray, width: int, seed: int, pairs: bool, folder: Path | None) -> PackPlan:
    """pack_plan, read from `folder` when a run planned it before, else planned and kept there (no
    folder: planned each time)."""
    if folder is None:
        return pack_plan(lengths, width, seed, pairs)
    path = Path(folder) / f"pack-plan-{plan_key(lengths, width, seed, pairs)}.npz"
    plan = read_plan(path)
    if plan is None:
        plan = pack_plan(lengths, width, seed, pairs)
        write_plan(path, plan)
    elif pairs:
        fitting_pairs(lengths, width)  # its warning of the pairs left out, as when the plan was made
    return plan


def read_plan(path: Path) -> PackPlan | None:
    """The plan kept at `path`; None when there is none, or it cannot be read or does not hold a plan
    (it is planned again and written anew)."""
    try:
        with np.load(path) as saved:
            plan = PackPlan(*(saved[name] for name in ARRAYS))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    pieces = len(plan.piece_doc)
    consistent = (plan.row_starts.ndim == 1 and len(plan.row_starts) >= 1 and plan.row_starts[0] == 0
                  and plan.row_starts[-1] == pieces and len(plan.piece_offset) == len(plan.piece_length) == pieces)
    return plan if consistent else None


def write_plan(path: Path, plan: PackPlan) -> None:
    """Keep `plan` at `path`, atomically (a temporary file, then a rename): readers see all of it or
    nothing. A folder that cannot be written just keeps nothing (one line on stderr says so)."""
    temporary = None
    try:  # a name of its own: several processes (hosts, on a shared folder) may plan at once
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(handle, "wb") as out:
            np.savez(out, **{name: getattr(plan, name) for name in ARRAYS})
        os.chmod(temporary, 0o644)  # mkstemp's file is private; the folder's other readers read the plan too
        os.replace(temporary, path)
    except OSError as error:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        print(f"jaxpar: warning: the packing plan is not kept in '{path.parent}' ({error.strerror or error}), "
              f"so each run plans it again.", file=sys.stderr)
