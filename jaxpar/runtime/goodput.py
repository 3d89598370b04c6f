"""Goodput: the share of a run's wall time spent on training steps that count.

The terms are those of Google's ml-goodput-measurement (MaxText's goodput recorder). Goodput is
productive time over the job's elapsed time, from its first start to now. Productive time is
the step time of every step in the final trajectory, each counted once. Badput is the rest:
program startup (device setup, restore, the first step's compilation), checkpoint saves (the
part that blocks training; an asynchronous save's background write does not), wasted progress
from disruptions (steps computed and then lost to a failure, so recomputed: "recomputed
steps"), and the time each restart costs (from the failed attempt's last step to the restarted
one's first: detection, back-off, start-up, restore and compilation again).

Process 0 of every attempt appends to `<run.dir>/timeline.jsonl`: a `start` row when its loop
begins (the process's start time, the step it resumed from), a `step` row as each step's
metrics are read, a `save` row per save, and an `end` row when it stops. A finished run's `end`
row closes the job; the next start in that folder begins a new one. Pure Python (no jax), so
`jaxpar launch` reads the same file.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from jaxpar.runtime.jsonl import append_jsonl

TIMELINE = "timeline.jsonl"


class Timeline:
    """Appends one attempt's rows to <run.dir>/timeline.jsonl (`write=False`: a process other than 0)."""

    def __init__(self, run_dir: Path, write: bool):
        self.path, self.write = Path(run_dir) / TIMELINE, write

    def _append(self, row: dict) -> None:
        if self.write:
            append_jsonl(self.path, row)

    def start(self, started: float, resumed: int, source: str, **where) -> None:
        """The loop begins now: `started` is when the process began, `resumed` the step it goes on from,
        `source` where that state came from ('memory', 'checkpoint' or 'init'); `where`: devices, layout..."""
        self._append({"event": "start", "t": started, "ready_t": time.time(), "resumed": resumed, "source": source,
                      **where})

    def step(self, step: int, seconds: float) -> None:
        self._append({"event": "step", "t": time.time(), "step": step, "s": seconds})

    def save(self, step: int, seconds: float, kind: str) -> None:
        """A save of `step` that held training for `seconds` (kind: 'checkpoint' or 'memory')."""
        self._append({"event": "save", "t": time.time(), "step": step, "s": seconds, "kind": kind})

    def end(self, step: int, finished: bool) -> None:
        self._append({"event": "end", "t": time.time(), "step": step, "finished": finished})


def current_job(rows: list[dict]) -> list[list[dict]]:
    """The attempts of the job in progress (each a list of rows starting with its `start` row): the
    attempts since the last finished one."""
    attempts: list[list[dict]] = []
    for row in rows:
        if row.get("event") == "start":
            if attempts and any(r.get("event") == "end" and r.get("finished") for r in attempts[-1]):
                attempts = []
            attempts.append([row])
        elif attempts:
            attempts[-1].append(row)
    return attempts


def _first_step_excess(steps: list[dict], typical: float | None) -> float:
    """The part of an attempt's first step that was compilation: its time beyond a typical step's."""
    if not steps or typical is None:
        return 0.0
    return max(steps[0]["s"] - typical, 0.0)


def goodput(attempts: list[list[dict]], now: float) -> dict:
    """Goodput and its badput parts (seconds, and how many of each) over `attempts` (current_job), up to `now`."""
    steps_of = [[r for r in a if r.get("event") == "step"] for a in attempts]
    everyone = [r["s"] for steps in steps_of for r in steps[1:]]
    parts = {"productive_s": 0.0, "startup_s": 0.0, "restarts": max(len(attempts) - 1, 0), "restart_s": 0.0,
             "recomputed_steps": 0, "recomputed_s": 0.0, "checkpoint_saves": 0, "checkpoint_s": 0.0}
    previous_end = None
    for i, (attempt, steps) in enumerate(zip(attempts, steps_of)):
        start = attempt[0]
        later = [a[0]["resumed"] for a in attempts[i + 1:]]
        kept_up_to = min(later) if later else float("inf")  # steps beyond it were lost and computed again
        own = [r["s"] for r in steps[1:]]
        excess = _first_step_excess(steps, statistics.median(own or everyone) if (own or everyone) else None)
        for k, row in enumerate(steps):
            work = row["s"] - (excess if k == 0 else 0.0)
            if row["step"] <= kept_up_to:
                parts["productive_s"] += work
            else:
                parts["recomputed_steps"] += 1
                parts["recomputed_s"] += work
        saves = [r["s"] for r in attempt if r.get("event") == "save"]
        parts["checkpoint_saves"] += len(saves)
        parts["checkpoint_s"] += sum(saves)
        getting_ready = max(start["ready_t"] - start["t"], 0.0) + excess
        if i == 0:
            parts["startup_s"] += getting_ready
        else:
            parts["restart_s"] += getting_ready + max(start["t"] - previous_end, 0.0)
        previous_end = max(r["t"] for r in attempt)
    wall = max(now - attempts[0][0]["t"], 1e-9) if attempts else 0.0
    accounted = sum(v for k, v in parts.items() if k.endswith("_s"))
    return {"goodput": parts["productive_s"] / wall if wall else None, "wall_s": wall, **parts,
            "other_s": max(wall - accounted, 0.0)}


def describe(parts: dict) -> str:
    """'goodput 0.62 (3 restarts: 40.1 s, 5 recomputed steps: 3.2 s, 9 checkpoint saves: 0.8 s, of 95.0 s)'."""
    def count(n: int, what: str) -> str:
        return f"{n} {what}{'' if n == 1 else 's'}"

    return (f"goodput {parts['goodput']:.2f} ({count(parts['restarts'], 'restart')}: {parts['restart_s']:.1f} s, "
            f"{count(parts['recomputed_steps'], 'recomputed step')}: {parts['recomputed_s']:.1f} s, "
            f"{count(parts['checkpoint_saves'], 'checkpoint save')}: {parts['checkpoint_s']:.1f} s, "
            f"of {parts['wall_s']:.1f} s)")
