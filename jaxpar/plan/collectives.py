"""Read the collectives out of a compiled program's HLO text.

Each collective is reported with its payload bytes, the mesh axes its replica groups span,
and whether it sits in a while-loop body (the scanned layers), so tests and `plan` can
check layouts against what Megatron/ZeRO predict from the program itself.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "s8": 1,
                "u8": 1, "pred": 1, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_OP_LINE = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(?P<shape>.+?)\s+(?P<op>" + "|".join(COLLECTIVE_OPS)
                      + r")(?:-start)?\((?P<rest>.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>\S+)\s.*\{\s*$")
_WHILE_BODY = re.compile(r"\bwhile\(.*?body=%(?P<body>[^\s,]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of the compiled program."""

    op: str
    bytes: int
    shapes: tuple[str, ...]
    mesh_axes: tuple[str, ...]
    computation: str
    in_loop: bool
    count: int  # executions per step: the product of the trip counts of the loops around it

    @property
    def total_bytes(self) -> int:
        """Payload bytes moved per step by this op, loops unrolled."""
        return self.bytes * self.count


def _payload(shape_text: str) -> tuple[int, tuple[str, ...]]:
    total, shapes = 0, []
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype not in _DTYPE_BYTES:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * _DTYPE_BYTES[dtype]
        shapes.append(f"{dtype}[{dims}]")
    return total, tuple(shapes)


def _first_group(rest: str, n_devices: int) -> list[int] | None:
    """Device positions in the replica group (or source-target pairs) containing position 0."""
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", rest):
        return [int(d) for d in m.group(1).split(",") if d]
    if m := re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest):
        groups = [int(d) for d in m.group(1).split(",")]
        dims = [int(d) for d in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(d) for d in m.group(3).split(",")])
        return ids.reshape(groups[0], -1)[0].tolist()
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest):
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        reduced = set(re.findall(r"'([^']+)'", m.group(2)))
        ids = np.arange(math.prod(int(s) for _, s in axes)).reshape([int(s) for _, s in axes])
        index = tuple(slice(None) if name in reduced else 0 for name, _ in axes)
        return ids[index].reshape(-1).tolist()
    if m := re.search(r"source_target_pairs=\{([^}]*(?:\}[^}]*)*?)\}\s*(?:,|$)", rest):
        pairs = re.findall(r"\{(\d+),(\d+)\}", m.group(0))
        return sorted({int(d) for p in pairs for d in p})
    return list(range(n_devices))


def _axes_spanned(group: list[int], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    coords = np.array(np.unravel_index(group, sizes)).T
    return tuple(n for i, n in enumerate(names) if len(set(coords[:, i])) > 1)


def collectives(hlo_text: str, mesh_shape: dict[str, int]) -> list[Collective]:
    """All collectives in `compiled.as_text()`, for a mesh of axis sizes `mesh_shape` (in order)."""
    n_devices = math.prod(mesh_shape.values())
    parent: dict[str, tuple[str, int]] = {}  # loop body -> (computation holding the loop, trip count)
    ops, computation = [], ""
    for line in hlo_text.splitlines():
        if m := _COMPUTATION.match(line):
            computation = m.group("name")
        elif m := _WHILE_BODY.search(line):
            trips = _TRIP_COUNT.search(line)
            parent[m.group("body")] = (computation, int(trips.group(1)) if trips else 1)
        elif m := _OP_LINE.match(line):
            ops.append((computation, m))

    def executions(name: str) -> int:
        count = 1
        while name in parent:
            name, trips = parent[name]
            count *= trips
        return count

    found = []
    for computation, m in ops:
        nbytes, shapes = _payload(m.group("shape"))
        group = _first_group(m.group("rest"), n_devices)
        found.append(Collective(m.group("op"), nbytes, shapes, _axes_spanned(group, mesh_shape), computation,
                                computation in parent, executions(computation)))
    return found


def bytes_by_op(found: list[Collective]) -> dict[str, int]:
    """Total payload bytes per step for each collective kind."""
    totals = {op: 0 for op in COLLECTIVE_OPS}
    for c in found:
        totals[c.op] += c.total_bytes
    return totals
