"""Read the collectives out of a compiled program's HLO text.

Each collective is reported with its payload bytes, the mesh axes its replica groups span,
and whether it sits in a while-loop body (the scanned layers), so tests and `plan` can
check layouts against what Megatron/ZeRO predict from the program itself.

A ragged all-to-all (dropless routing's parallel.expert_dispatch=ragged) moves data-dependent slices of
static buffers; it is counted as the rows it routes, the smaller of its operand and its output buffer
(each device sends its A assignments and gets as many back; a receive buffer holds mesh.expert x A rows,
room for all of them). On XLA:CPU the op is emulated (jaxpar.parallel.ragged): the emulation's
all-to-all of padded blocks, mesh.expert x those rows, counts as the op, and its exchange of offsets,
which the op does without, not at all.

XLA:GPU writes collectives asynchronously: an `all-reduce-start` (all-gather-, reduce-scatter-,
all-to-all-, ragged-all-to-all-, collective-permute-start) whose shape is the tuple (its operands, its
result), and a `-done` that waits for it. The start is counted, by its result.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from jaxpar.parallel.ragged import OFFSETS_SCOPE, ROWS_SCOPE
from jaxpar.plan.hlo import Instruction, Module, array_shapes, nbytes, parse

COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                  "ragged-all-to-all")


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
    group_size: int  # devices taking part in each of its groups

    @property
    def total_bytes(self) -> int:
        """Payload bytes moved per step by this op, loops unrolled."""
        return self.bytes * self.count

    @property
    def wire_bytes(self) -> int:
        """Bytes each device sends per execution with a bandwidth-optimal algorithm (ring): the
        measure on which a reduce-scatter plus an all-gather cost what one all-reduce costs.
        `bytes` is the result: the whole buffer for an all-reduce or all-gather, one shard for a
        reduce-scatter."""
        n = self.group_size
        share = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n, "reduce-scatter": n - 1,
                 "all-to-all": (n - 1) / n, "collective-permute": 1,
                 "ragged-all-to-all": (n - 1) / n}[self.op]  # ragged: the share of balanced routes to others
        return round(self.bytes * share)


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


def collectives(hlo: str | Module, mesh_shape: dict[str, int]) -> list[Collective]:
    """All collectives in `compiled.as_text()` (or its parsed Module), for a mesh of axis sizes
    `mesh_shape` (in order)."""
    module = parse(hlo) if isinstance(hlo, str) else hlo
    loop_bodies = {callee for callee, callers in module.calls.items() if any(t > 1 for _, t in callers)}
    n_devices = math.prod(mesh_shape.values())
    found = []
    for name, instructions in module.computations.items():
        by_name = {inst.name: inst for inst in instructions}
        for inst in instructions:
            op = inst.op.removesuffix("-start")
            if op not in COLLECTIVE_OPS or _emulation_offsets(inst):
                continue
            group = _first_group(inst.rest, n_devices)
            result = _result_shape(inst)
            shapes = tuple(f"{dtype}[{','.join(map(str, dims))}]" for dtype, dims in array_shapes(result))
            size = 2 if op == "collective-permute" else len(group)  # a permute sends its buffer once
            op, payload = _routed(op, inst, result, by_name, size)
            found.append(Collective(op, payload, shapes, _axes_spanned(group, mesh_shape), name,
                                    name in loop_bodies, module.executions(name), size))
    return found


def _scoped(inst: Instruction, scope: str) -> bool:
    return re.search(rf'op_name="[^"]*[/(]{re.escape(scope)}\)*/', inst.rest) is not None


def _emulation_offsets(inst: Instruction) -> bool:
    """The ragged all-to-all emulation's exchange of offsets, which the op itself does not need."""
    return _scoped(inst, OFFSETS_SCOPE)


def _result_shape(inst: Instruction) -> str:
    """The shape of what a collective produces: an asynchronous start's (operands, result) tuple gives its
    second element (see above)."""
    text = inst.shape.strip()
    if not inst.op.endswith("-start") or not text.startswith("("):
        return inst.shape
    depth, commas = 0, []
    for i, char in enumerate(text):
        depth += (char in "([{") - (char in ")]}")
        if char == "," and depth == 1:
            commas.append(i)
    return text[commas[0] + 1:(commas[1] if len(commas) > 1 else -1)] if commas else inst.shape


def _routed(op: str, inst: Instruction, result: str, by_name: dict[str, Instruction],
            devices: int) -> tuple[str, int]:
    """(kind, payload bytes): the result's bytes, but for a ragged all-to-all the rows it routes (see above)."""
    if op == "all-to-all" and _scoped(inst, ROWS_SCOPE):  # the emulation's padded blocks, one per device
        return "ragged-all-to-all", nbytes(result) // devices
    if op == "ragged-all-to-all":
        operand = re.match(r"\s*%?([^\s,)]+)", inst.rest)
        source = by_name.get(operand.group(1)) if operand else None
        return op, min(nbytes(result), nbytes(source.shape)) if source else nbytes(result)
    return op, nbytes(result)


def bytes_by_op(found: list[Collective], wire: bool = False) -> dict[str, int]:
    """Total payload bytes per step for each collective kind (wire: bytes each device sends)."""
    totals = {op: 0 for op in COLLECTIVE_OPS}
    for c in found:
        totals[c.op] += c.wire_bytes * c.count if wire else c.total_bytes
    return totals
