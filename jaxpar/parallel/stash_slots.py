"""Where a zero-bubble stage keeps each in-flight value, decided from the table (pure Python).

A value lives from the tick that writes it to the last tick that reads it: a chunk's input from
the previous chunk's forward to its own forward, its output's cotangent from the next chunk's B
to its own B (or W, when W reads it), residuals from F to B (those only B reads) or to W, and
what B hands to W from B to W. Each kind of value has a pool of slots per device; a value takes
the lowest slot free on its stage for its whole life (interval colouring), so a pool holds as
many slots as the most values of its kind a stage ever keeps at once. Both chunks of a zbv stage
share their pools: the V's two arms are never at their peaks together.

The SPMD program writes every kept pool at every tick (a `lax.switch` cannot leave a buffer
out of some branches' results without copying it): a tick whose action keeps nothing there
writes into a slot that holds nothing it still needs (`write_slots`), which costs one more slot
only at a tick where every slot does.
"""

from __future__ import annotations

import dataclasses

from jaxpar.parallel.schedules import Action, Table

# When a value starts and ends: an action of its (microbatch, chunk), or the neighbour's action
# that sends it ("sent F": the previous chunk's forward; "sent B": the next chunk's backward).
EVENTS = ("F", "B", "W", "sent F", "sent B")
# Which chunks have a value of the pool.
CHUNKS = ("all", "first", "last", "not first", "not last")


@dataclasses.dataclass(frozen=True)
class Pool:
    name: str
    start: str
    end: str
    chunks: str = "all"

    def written_by(self, action: Action, last_chunk: int) -> bool:
        """Whether `action` itself writes a value of this pool (its F or B), not a neighbour's send."""
        return action.kind == self.start and _has(self.chunks, action.chunk, last_chunk)


@dataclasses.dataclass(frozen=True)
class Slots:
    """count[pool]: slots per device; slot[pool][(stage, microbatch, chunk)]: the one a value takes;
    lives[pool][stage]: (start, end, slot) of every value kept there."""

    count: dict[str, int]
    slot: dict[str, dict[tuple[int, int, int], int]]
    lives: dict[str, dict[int, list[tuple[int, int, int]]]]

    def of(self, pool: str, stage: int, microbatch: int, chunk: int) -> int:
        return self.slot[pool].get((stage, microbatch, chunk), 0)


def assign(table: Table, pools: list[Pool]) -> Slots:
    """Every pool's slots on every stage."""
    tick = {action: t for t, row in enumerate(table.ticks) for action in row if action is not None}
    last = table.stages * table.virtual - 1
    lives: dict[str, list] = {}
    for pool in pools:  # several specs of one name share its slots (different chunks' lives)
        for action in tick:
            i, k = action.microbatch, action.chunk
            if action.kind != "F" or not _has(pool.chunks, k, last):
                continue
            span = (_when(pool.start, tick, i, k), _when(pool.end, tick, i, k))
            lives.setdefault(pool.name, []).append((span, (table.stage_of(k), i, k)))
    count, slot, spans = {}, {}, {}
    for name, pool_lives in lives.items():
        slot[name], count[name] = _colour(pool_lives)
        spans[name] = {}
        for (start, end), key in pool_lives:
            spans[name].setdefault(key[0], []).append((start, end, slot[name][key]))
    return Slots(count, slot, spans)


def write_slots(table: Table, slots: Slots, pool: str, writes) -> list[list[int]]:
    """[tick][stage]: the slot the tick writes in `pool`: its action's own when `writes(action)`,
    else one whose value is already read or not yet written (a value [start, end] needs its slot
    from the end of tick `start`, when it is written, through tick `end`, when it is last read);
    when there is none, one spare slot past the others (`slots.count` grows by one)."""
    out = []
    for t, row in enumerate(table.ticks):
        cells = []
        for s, action in enumerate(row):
            if action is not None and writes(action):
                cells.append(slots.of(pool, s, action.microbatch, action.chunk))
                continue
            held = {slot for start, end, slot in slots.lives.get(pool, {}).get(s, []) if start <= t < end}
            free = next((n for n in range(slots.count.get(pool, 0)) if n not in held), None)
            if free is None:
                free = slots.count[pool]
                slots.count[pool] = free + 1
            cells.append(free)
        out.append(cells)
    return out


def _has(chunks: str, k: int, last: int) -> bool:
    return {"all": True, "first": k == 0, "last": k == last, "not first": k > 0, "not last": k < last}[chunks]


def _when(event: str, tick: dict[Action, int], i: int, k: int) -> int:
    if event == "sent F":
        return tick[Action("F", i, k - 1)]
    if event == "sent B":
        return tick[Action("B", i, k + 1)]
    return tick[Action(event, i, k)]


def _colour(lives: list) -> tuple[dict, int]:
    """The lowest slot free for the whole of each life, per stage. A slot is free again in the tick of
    its value's last read: the executor reads inside a tick's branch and writes after it."""
    slot, busy_until = {}, {}
    for (start, end), key in sorted(lives):
        stage_busy = busy_until.setdefault(key[0], [])
        free = next((n for n, until in enumerate(stage_busy) if until <= start), len(stage_busy))
        if free == len(stage_busy):
            stage_busy.append(end)
        stage_busy[free] = end
        slot[key] = free
    return slot, max((len(b) for b in busy_until.values()), default=0)
