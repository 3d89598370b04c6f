"""Pipeline schedule tables: for every tick and stage, forward or backward of which microbatch
and which model chunk, or idle. Pure Python; the same table drives the executor and the chart.

A tick is one unit of work of one chunk (a forward and a backward count one tick each, so the
idle fractions are the classic (S-1)/(M+S-1) and, interleaved, (S-1)/(v*M+S-1)). A table is
built from each stage's ordered list of actions: at every tick each stage runs its next
action as soon as its dependencies finished in an earlier tick, else it idles.

Dependencies: the forward of (microbatch i, chunk k) needs the forward of (i, k-1); the
backward of (i, k) needs the forward of (i, k) and the backward of (i, k+1). Chunk k lives
on stage k % S (with v chunks per stage, round-robin as in Megatron's interleaved schedule).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b", "interleaved", "2bw")


class Action(NamedTuple):
    """One unit of work: 'F' or 'B', a microbatch and a model chunk (0 .. S*v-1)."""

    kind: str
    microbatch: int
    chunk: int


@dataclasses.dataclass(frozen=True)
class Table:
    """ticks[t][s] is the Action stage s runs at tick t, or None when it idles."""

    schedule: str
    stages: int
    microbatches: int
    virtual: int
    ticks: tuple[tuple[Action | None, ...], ...]

    @property
    def idle_fraction(self) -> float:
        """Idle stage-ticks over all stage-ticks."""
        total = len(self.ticks) * self.stages
        return sum(a is None for row in self.ticks for a in row) / total

    def in_flight(self, stage: int) -> int:
        """Most microbatches whose forward ran on `stage` but whose backward has not (per chunk pair)."""
        live, peak = set(), 0
        for row in self.ticks:
            action = row[stage]
            if action is not None:
                key = (action.microbatch, action.chunk)
                live.add(key) if action.kind == "F" else live.discard(key)
                peak = max(peak, len(live))
        return peak


def theoretical_idle_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    """(S-1) / (v*M + S-1): the bubble of GPipe, 1F1B (v=1) and interleaved 1F1B."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def _orders(schedule: str, S: int, M: int, v: int) -> list[list[Action]]:
    """Each stage's actions in the order it runs them."""
    if schedule == "gpipe":
        return [[Action("F", i, s) for i in range(M)] + [Action("B", i, s) for i in range(M)] for s in range(S)]
    if schedule in ("1f1b", "2bw"):
        orders = []
        for s in range(S):
            warmup = min(S - 1 - s, M)
            order = [Action("F", i, s) for i in range(warmup)]
            for i in range(M - warmup):
                order += [Action("F", warmup + i, s), Action("B", i, s)]
            order += [Action("B", i, s) for i in range(M - warmup, M)]
            orders.append(order)
        return orders
    if schedule == "interleaved":
        return [_interleaved_order(s, S, M, v) for s in range(S)]
    raise ValueError(f"unknown schedule {schedule!r}")


def _interleaved_order(s: int, S: int, M: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B order for stage s: microbatches in groups of S per chunk."""
    def unit(n: int, backward: bool) -> Action:
        group, within = divmod(n, S * v)
        local_chunk = within // S
        if backward:
            local_chunk = v - 1 - local_chunk
        microbatch = group * S + within % S
        return Action("B" if backward else "F", microbatch, local_chunk * S + s)

    total = M * v
    warmup = min((S - s - 1) * 2 + (v - 1) * S, total)
    order = [unit(n, False) for n in range(warmup)]
    for n in range(total - warmup):
        order += [unit(warmup + n, False), unit(n, True)]
    order += [unit(n, True) for n in range(total - warmup, total)]
    return order


def build(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> Table:
    """Simulate the schedule tick by tick; raises ValueError if it cannot make progress."""
    S, M, v = stages, microbatches, virtual if schedule == "interleaved" else 1
    orders = _orders(schedule, S, M, v)
    last_chunk = S * v - 1
    done: set[Action] = set()
    position = [0] * S
    ticks = []
    while any(position[s] < len(orders[s]) for s in range(S)):
        row = []
        for s in range(S):
            action = orders[s][position[s]] if position[s] < len(orders[s]) else None
            if action is not None and not _ready(action, done, last_chunk):
                action = None
            row.append(action)
        if all(a is None for a in row):
            raise ValueError(f"{schedule} with S={S}, M={M}, v={v} deadlocks")
        for s, action in enumerate(row):
            if action is not None:
                position[s] += 1
        done.update(a for a in row if a is not None)  # visible from the next tick on
        ticks.append(tuple(row))
    return Table(schedule, S, M, v, tuple(ticks))


def _ready(action: Action, done: set[Action], last_chunk: int) -> bool:
    i, k = action.microbatch, action.chunk
    if action.kind == "F":
        return k == 0 or Action("F", i, k - 1) in done
    return Action("F", i, k) in done and (k == last_chunk or Action("B", i, k + 1) in done)


def storage_order(n_layers: int, stages: int, virtual: int) -> list[int]:
    """Model layer held at each position of the stacked weights, so that stage s's contiguous
    block holds its chunks s, s+S, s+2S, ... (identity unless virtual > 1)."""
    per_chunk = n_layers // (stages * virtual)
    order = []
    for stage in range(stages):
        for local_chunk in range(virtual):
            chunk = local_chunk * stages + stage
            order += range(chunk * per_chunk, (chunk + 1) * per_chunk)
    return order


def stash_size(table: Table) -> int:
    """Fewest slots K such that slot = microbatch % K never overwrites a live input or cotangent.

    A chunk's input is live from the tick its predecessor chunk's forward sent it (its own
    forward, for chunk 0) until its backward; a cotangent from the successor's backward
    until this chunk's backward.
    """
    done = {}
    for t, row in enumerate(table.ticks):
        for action in row:
            if action is not None:
                done[action] = t
    last = table.stages * table.virtual - 1
    spans = {"x": [], "g": []}  # (stage, local chunk, microbatch, start, end)
    for action, t in done.items():
        if action.kind != "B":
            continue
        i, k = action.microbatch, action.chunk
        where = (k % table.stages, k // table.stages, i)
        spans["x"].append(where + (done[Action("F", i, k - 1)] if k > 0 else done[Action("F", i, k)], t))
        if k < last:
            spans["g"].append(where + (done[Action("B", i, k + 1)], t))
    for K in range(1, table.microbatches + 1):
        if all(_no_overlap(span_list, K) for span_list in spans.values()):
            return K
    return table.microbatches


def _no_overlap(spans, K: int) -> bool:
    by_slot: dict[tuple, list[tuple[int, int]]] = {}
    for stage, local_chunk, micro, start, end in spans:
        by_slot.setdefault((stage, local_chunk, micro % K), []).append((start, end))
    for intervals in by_slot.values():
        intervals.sort()
        if any(later[0] <= earlier[1] for earlier, later in zip(intervals, intervals[1:])):
            return False
    return True
