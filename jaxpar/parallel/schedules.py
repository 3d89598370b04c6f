"""Pipeline schedule tables: for every tick and stage, forward or backward of which microbatch
and which model chunk, or idle. Pure Python; the same table drives the executor and the chart.

A tick is one unit of work of one chunk (a forward and a backward count one tick each, so the
idle fractions are the classic (S-1)/(M+S-1) and, interleaved, (S-1)/(v*M+S-1)). A table is
built from each stage's ordered list of actions: at every tick each stage runs its next
action as soon as its dependencies finished in an earlier tick, else it idles.

Dependencies: the forward of (microbatch i, chunk k) needs the forward of (i, k-1); the
backward of (i, k) needs the forward of (i, k) and the backward of (i, k+1). Chunk k lives
on stage k % S (with v chunks per stage, round-robin as in Megatron's interleaved schedule).

The zero-bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism") split each
backward in two: B, the input's cotangent (what the previous chunk waits for), and W, the
weight gradients of (i, k), which need only B of (i, k) and which nobody waits for; a tick is
then one F, B or W. `zb-h1` keeps 1F1B's memory (at most S microbatches between F and W on
any stage) and lets W fill the cool-down; `zbv` puts two chunks on each stage in a V, chunk s
and chunk 2S-1-s on stage s, so the loss and the first chunk share stage 0.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "2bw", "zb-h1", "zbv")
# Schedules whose backward is split into B (input cotangent) and W (weight gradients).
ZERO_BUBBLE = ("zb-h1", "zbv")


class Action(NamedTuple):
    """One unit of work: 'F', 'B' or (zero-bubble schedules) 'W', a microbatch and a model chunk
    (0 .. S*v-1)."""

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
    def split_backward(self) -> bool:
        """Whether a backward is two actions, B then W (the zero-bubble schedules)."""
        return self.schedule in ZERO_BUBBLE

    def stage_of(self, chunk: int) -> int:
        """The stage that holds `chunk`: round-robin, or in a V for zbv."""
        return chunk_stage(self.schedule, self.stages, chunk)

    def local_chunk(self, chunk: int) -> int:
        """Which of its stage's chunks `chunk` is (0 .. virtual-1, in the order stored)."""
        return chunk // self.stages

    @property
    def idle_fraction(self) -> float:
        """Idle stage-ticks over all stage-ticks."""
        total = len(self.ticks) * self.stages
        return sum(a is None for row in self.ticks for a in row) / total

    def in_flight(self, stage: int) -> int:
        """Most (microbatch, chunk) pairs whose forward ran on `stage` but whose backward (its W,
        when split) has not."""
        live, peak, ends = set(), 0, "W" if self.split_backward else "B"
        for row in self.ticks:
            action = row[stage]
            if action is not None:
                key = (action.microbatch, action.chunk)
                if action.kind == "F":
                    live.add(key)
                elif action.kind == ends:
                    live.discard(key)
                peak = max(peak, len(live))
        return peak


def chunk_stage(schedule: str, stages: int, chunk: int) -> int:
    """The stage of `chunk`: k % S, or for zbv k on the way down and 2S-1-k on the way back."""
    if schedule == "zbv":
        return chunk if chunk < stages else 2 * stages - 1 - chunk
    return chunk % stages


def chunks_per_stage(schedule: str, virtual: int) -> int:
    """v: the configured virtual stages for interleaved, two for zbv, else one."""
    return virtual if schedule == "interleaved" else 2 if schedule == "zbv" else 1


def theoretical_idle_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    """(S-1) / (v*M + S-1): the bubble of GPipe, 1F1B (v=1) and interleaved 1F1B."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def _orders(schedule: str, S: int, M: int, v: int) -> list[list[Action]]:
    """Each stage's actions in the order it runs them."""
    if schedule in ("naive", "gpipe"):  # naive: GPipe with one microbatch, the whole batch
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
    if schedule == "zb-h1":
        return [_zb_h1_order(s, S, M) for s in range(S)]
    if schedule == "zbv":
        return [_zbv_order(s, S, M) for s in range(S)]
    raise ValueError(f"unknown schedule {schedule!r}")


def _zb_h1_order(s: int, S: int, M: int) -> list[Action]:
    """ZB-H1 on stage s: S - s forwards, then B and F alternately, each W as late as memory allows:
    stage s keeps up to s microbatches between B and W, so S microbatches at most between F and W
    (1F1B's peak on its first stage), and the last stage's W fill 1F1B's cool-down bubble."""
    order, pending, f, b = [], [], 0, 0
    while f < min(S - s, M):
        order.append(Action("F", f, s))
        f += 1
    while b < M:
        order.append(Action("B", b, s))
        pending.append(b)
        b += 1
        if len(pending) > s:
            order.append(Action("W", pending.pop(0), s))
        if f < M:
            order.append(Action("F", f, s))
            f += 1
    return order + [Action("W", w, s) for w in pending]


def _zbv_order(s: int, S: int, M: int) -> list[Action]:
    """ZB-V on stage s (the paper's Figure 6 pattern): chunk `a` = s on the way down, `b` = 2S-1-s on
    the way back. Forwards of a fill the V's left arm, then F-B-W of b, then the steady pattern
    F(a) B(a) W(a) F(b) B(b) W(b), then the W left over. Written for at least 2S-1 microbatches;
    with fewer, the actions of microbatches past M are left out."""
    a, b = s, 2 * S - 1 - s
    count: dict[tuple[str, int], int] = {}
    order: list[Action] = []

    def act(*steps: tuple[str, int]) -> None:
        for kind, chunk in steps:
            i = count[kind, chunk] = count.get((kind, chunk), 0) + 1
            if i <= M:
                order.append(Action(kind, i - 1, chunk))

    n = max(M, 2 * S - 1)
    act(*[("F", a)] * (2 * (S - s) - 1))
    act(*[("F", b), ("F", a)] * s)
    act(*[("F", b), ("B", b), ("W", b)] * (S - s))
    while count.get(("F", b), 0) < n:
        if count.get(("F", a), 0) < n:
            act(("F", a))
        act(("B", a), ("W", a), ("F", b), ("B", b), ("W", b))
    act(*[("B", a), ("B", b)] * s)
    act(*[("B", a), ("W", a)] * (S - s))
    act(*[("W", b)] * (n - count.get(("W", b), 0)))
    act(*[("W", a)] * (n - count.get(("W", a), 0)))
    return order


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
    """Simulate the schedule tick by tick; raises ValueError if it cannot make progress. For 2bw: one
    step's window of the endless stream (steady_window)."""
    if schedule == "2bw":
        return steady_window(stages, microbatches)
    S, M, v = stages, microbatches, chunks_per_stage(schedule, virtual)
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
    if action.kind == "W":
        return Action("B", i, k) in done
    return Action("F", i, k) in done and (k == last_chunk or Action("B", i, k + 1) in done)


def storage_order(n_layers: int, stages: int, virtual: int, schedule: str = "") -> list[int]:
    """Model layer held at each position of the stacked weights, so that stage s's contiguous
    block holds its chunks in local order: s, s+S, s+2S, ..., or for zbv s and 2S-1-s (identity
    unless a stage holds several chunks)."""
    per_chunk = n_layers // (stages * virtual)
    order = []
    for stage in range(stages):
        for local_chunk in range(virtual):
            v_arm = schedule == "zbv" and local_chunk  # zbv: stage s's second chunk is 2S-1-s
            chunk = 2 * stages - 1 - stage if v_arm else local_chunk * stages + stage
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


# ---- PipeDream-2BW in the steady state ------------------------------------------------------------
# 2BW never flushes: the 1F1B order runs on across step boundaries, and each step's program is one
# window of that endless stream, from stage 0's first forward of the step's batch to stage 0's first
# forward of the next one. A window holds the rest of the previous step's microbatches (numbered
# -M .. -1: their forwards on the later stages, and their backwards, on the weights one version old)
# and the step's own (0 .. M-1, on the current weights); nothing of the next step's. All of the
# previous batch's backwards finish inside the window, so its gradient is whole at the window's end,
# where the update is applied: W(t+1) = W(t) - update(gradient taken at W(t-1)).

STREAM_BATCHES = 6  # how many steps of the 1F1B stream are simulated to find its steady window


def _forward_ticks_of_stage_0(stream: Table, M: int) -> list[int]:
    """The tick at which stage 0 runs the forward of each step's first microbatch (0, M, 2M, ...)."""
    firsts = {Action("F", t * M, 0): t for t in range(stream.microbatches // M)}
    ticks = [0] * len(firsts)
    for tick, row in enumerate(stream.ticks):
        if row[0] in firsts:
            ticks[firsts[row[0]]] = tick
    return ticks


def _window(stream: Table, starts: list[int], t: int, M: int) -> tuple:
    """The ticks of step t's window, microbatches renumbered from the step's first (previous step: < 0)."""
    renumber = lambda a: None if a is None else Action(a.kind, a.microbatch - t * M, a.chunk)  # noqa: E731
    return tuple(tuple(renumber(a) for a in row) for row in stream.ticks[starts[t]:starts[t + 1]])


def steady_window(stages: int, microbatches: int) -> Table:
    """One step of 2BW in the steady state: a window of the endless 1F1B stream (see above). Its
    microbatches -M .. -1 are the previous step's; every window after the pipeline has filled is the
    same, and no stage idles in it."""
    S, M = stages, microbatches
    stream = build("1f1b", S, M * STREAM_BATCHES)
    starts = _forward_ticks_of_stage_0(stream, M)
    for t in range(1, STREAM_BATCHES - 2):
        window = _window(stream, starts, t, M)
        if window == _window(stream, starts, t + 1, M):
            assert all(a is None or -M <= a.microbatch < M for row in window for a in row)
            return Table("2bw", S, M, 1, window)
    raise ValueError(f"2bw with S={S}, M={M} reaches no steady state")


def without(table: Table, previous: bool) -> Table:
    """The window with the previous step's actions (previous=True: the first step, which fills the
    pipeline) or the step's own (False: the drain after the last step, trailing idle ticks cut) idle."""
    keep = (lambda a: a.microbatch >= 0) if previous else (lambda a: a.microbatch < 0)
    ticks = [tuple(a if a is not None and keep(a) else None for a in row) for row in table.ticks]
    while not previous and ticks and all(a is None for a in ticks[-1]):
        ticks.pop()
    return dataclasses.replace(table, ticks=tuple(ticks))


def run_tables(stages: int, microbatches: int, steps: int) -> list[Table]:
    """A 2BW run of `steps` steps as its programs run it: the first step fills the pipeline, the
    steps after it are the steady window, and a drain after the last finishes its microbatches."""
    window = steady_window(stages, microbatches)
    return [without(window, previous=True)] + [window] * (steps - 1) + [without(window, previous=False)]


def run_idle_fraction(tables: list[Table]) -> float:
    """Idle stage-ticks over all stage-ticks of consecutive tables (a whole 2BW run)."""
    total = sum(len(t.ticks) * t.stages for t in tables)
    return sum(a is None for t in tables for row in t.ticks for a in row) / total


def two_steps(stages: int, microbatches: int) -> Table:
    """Two consecutive steady 2BW windows as one table (`jaxpar schedule --schedule 2bw`), the
    microbatches numbered from the first window's previous step: 0 .. 3M-1."""
    M = microbatches
    window = steady_window(stages, M)
    shift = lambda a, by: None if a is None else Action(a.kind, a.microbatch + by, a.chunk)  # noqa: E731
    ticks = tuple(tuple(shift(a, M) for a in row) for row in window.ticks)
    ticks += tuple(tuple(shift(a, 2 * M) for a in row) for row in window.ticks)
    return dataclasses.replace(window, ticks=ticks)


def carried_stash_size(stages: int, microbatches: int) -> int:
    """Stash slots for 2BW's endless stream: the fewest K (slot = microbatch % K) that overwrite no
    live value over several steps of the stream, rounded up to a divisor of M, so that a microbatch
    keeps its slot when the next window numbers it M lower."""
    K = stash_size(build("1f1b", stages, microbatches * 3))
    return min(d for d in range(K, microbatches + 1) if microbatches % d == 0)
