"""`jaxpar launch --restarts N`: the launcher does the scheduler's part on one machine.

When a process dies (killed by a signal) or the run stops on a lost peer (EXIT_LOST), the others are
killed at once and the run starts again from its last complete state, up to N times, after a back-off
that doubles each time (`--backoff`, at most BACKOFF_CAP_S). Any other failure (a diverged loss, a
bug, a user mistake) would only repeat, so it ends the launcher as before. Each restart is one line
of output and one row of <run.dir>/events.jsonl: when, why, the attempt, the processes and devices it
goes on with, the step it resumed from, the steps lost, where the state came from and the layout
(the last four read from the restarted run's own timeline, jaxpar.runtime.goodput).

With `--elastic` a slot (a process and its devices) is left out when its health check fails
(`--health-check CMD`, run with JAXPAR_SLOT set; exit 0 is healthy) or when its process was the first
to fail in two attempts in a row without a save in between; the run goes on with the slots left (at
least `--min-processes`), and each process re-plans its layout (run.elastic=true). A slot that is out
is checked again every `--regrow-after` seconds, or at once on SIGUSR1 to the launcher; once healthy,
the run stops at a checkpoint (SIGTERM, as a preemption) and starts again with it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from jaxpar.errors import EXIT_LOST
from jaxpar.runtime import distributed
from jaxpar.runtime.goodput import TIMELINE
from jaxpar.runtime.launch import describe, say, start, watch

BACKOFF_CAP_S = 60.0
HEALTH_CHECK_TIMEOUT_S = 60.0
EVENTS = "events.jsonl"


@dataclasses.dataclass(frozen=True)
class Policy:
    """What `jaxpar launch` does when the run fails: restarts left, back-off, and the elastic flags."""

    restarts: int
    backoff: float = 1.0
    elastic: bool = False
    min_processes: int = 1
    regrow_after: float | None = None
    health_check: str | None = None


def add_restart_flags(p) -> None:
    """`jaxpar launch`'s flags for runs that restart themselves (jaxpar.runtime.supervisor)."""
    p.add_argument("--restarts", type=int, default=0, metavar="N",
                   help="start the run again from its last complete state when a process dies or a peer is lost, "
                        "up to N times (train, with checkpoint.every)")
    p.add_argument("--backoff", type=float, default=1.0, metavar="S",
                   help="seconds before the first restart, doubling for each next one (default 1)")
    p.add_argument("--elastic", action="store_true",
                   help="leave out a process slot that fails again or fails --health-check, go on with the others "
                        "on a re-planned layout and the same global batch (run.elastic=true)")
    p.add_argument("--min-processes", type=int, metavar="K", help="the fewest processes an elastic run goes on with "
                                                                 "(default 1)")
    p.add_argument("--regrow-after", type=float, metavar="S",
                   help="check a slot that was left out again every S seconds (or on SIGUSR1), and grow back onto "
                        "it at a checkpoint once healthy")
    p.add_argument("--health-check", metavar="CMD",
                   help="a shell command run for each slot (JAXPAR_SLOT set) before a restart and to regrow; "
                        "exit 0 is healthy")


def restartable(rc: int) -> bool:
    """A process that died, or stopped because a peer was lost: starting again can help."""
    return rc < 0 or rc == EXIT_LOST


class _Tail:
    """The rows the run appends to its timeline after the launcher started, by attempt."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, path.stat().st_size if path.exists() else 0, b""
        self.current: str | None = None
        self.starts: dict[str, dict] = {}  # attempt -> its start row
        self.reached: dict[str, int] = {}  # attempt -> the newest step it reached
        self.saved: dict[str, int] = {}  # attempt -> how many saves it made
        self.finished: dict[str, bool] = {}

    def read(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = self.partial + f.read()
        self.offset += len(data) - len(self.partial)
        *lines, self.partial = data.split(b"\n")
        for line in lines:
            try:
                self._take(json.loads(line))
            except (json.JSONDecodeError, KeyError):
                continue

    def _take(self, row: dict) -> None:
        event = row["event"]
        if event == "start":
            self.current = str(row.get("attempt"))
            self.starts[self.current] = row
            self.reached[self.current] = row["resumed"]
        elif self.current is not None and event == "step":
            self.reached[self.current] = max(self.reached[self.current], row["step"])
        elif self.current is not None and event == "save":
            self.saved[self.current] = self.saved.get(self.current, 0) + 1
        elif self.current is not None and event == "end":
            self.finished[self.current] = bool(row["finished"])


class Supervisor:
    """Runs the attempts of one launched run until it finishes, fails for good or runs out of restarts."""

    def __init__(self, policy: Policy, processes: int, command: list[str], devices_per_process: int | None,
                 grace: float, verbose: bool, run_dir: Path):
        self.policy, self.command, self.grace, self.verbose = policy, command, grace, verbose
        self.slots, self.devices_per_process = list(range(processes)), devices_per_process
        self.lock = threading.Lock()
        run_dir.mkdir(parents=True, exist_ok=True)
        self.events, self.tail = run_dir / EVENTS, _Tail(run_dir / TIMELINE)
        self.out: dict[int, float] = {}  # slot -> when it was left out or last checked
        self.rejoining: list[int] = []
        self.pending: dict | None = None  # the events row of the last restart, completed from its attempt's start
        self.asked_regrow = False
        self.first_failures: list[tuple[int, int]] = []  # (attempt, slot) of each attempt's first failure

    def run(self) -> int:
        previous = signal.signal(signal.SIGUSR1, self._ask_regrow)
        try:
            if self.policy.elastic:
                self._leave_out([s for s in self.slots if not self._healthy(s)])
            return self._attempts()
        finally:
            signal.signal(signal.SIGUSR1, previous)

    def _ask_regrow(self, signum, frame) -> None:
        self.asked_regrow = True

    def _live(self) -> list[int]:
        return [s for s in self.slots if s not in self.out]

    def _attempts(self) -> int:
        attempt, used = 1, 0
        while True:
            live = self._live()
            if len(live) < self.policy.min_processes or not live:
                self._close_pending()
                say(self.lock, f"only {len(live)} of {len(self.slots)} process slots are healthy, fewer than "
                               f"--min-processes {self.policy.min_processes}; the run stops here.")
                return 1
            running = start(live, self.command, self.devices_per_process, self.verbose, self.lock, attempt)
            left = self.policy.restarts - used
            outcome = watch(running, self.grace, restartable if left else (lambda rc: False), self._regrow_due,
                            self._tick)
            self._tick()
            self._close_pending()
            if outcome.interrupted:
                return outcome.code
            if outcome.stopped:
                if self.tail.finished.get(str(attempt)):
                    return 0
                self._regrow(attempt + 1)
            elif outcome.failure is None:
                return 0
            else:
                slot, rc = outcome.failure
                if not (restartable(rc) and left):
                    if restartable(rc):
                        say(self.lock, f"no restarts left (--restarts {self.policy.restarts}); the run stops here.")
                    return outcome.code
                used += 1
                self._restart(attempt, slot, f"process {slot} {describe(rc, running.streams[slot])}", used)
            attempt += 1

    # ------------------------------------------------------------------------------------- restarts
    def _restart(self, attempt: int, slot: int, cause: str, used: int) -> None:
        """Decide which slots go on after `slot` failed, say so in one line, and wait the back-off."""
        self.first_failures.append((attempt, slot))
        left_out, why = [], ""
        if self.policy.elastic:
            # the same slot failed first in the attempt before, and this attempt saved nothing since
            again = (len(self.first_failures) > 1 and self.first_failures[-2] == (attempt - 1, slot)
                     and not self.tail.saved.get(str(attempt)))
            health = {s: self._healthy(s) for s in self._live()}
            left_out = [s for s, healthy in health.items() if not healthy or (s == slot and again)]
            why = ", ".join(f"slot {s} {'fails its health check' if not health[s] else 'failed again on restart'}"
                            for s in left_out)
            self._leave_out(left_out)
        delay = min(self.policy.backoff * 2 ** (used - 1), BACKOFF_CAP_S)
        live = self._live()
        where = f" on {len(live)} process{'es' if len(live) != 1 else ''} ({why}: left out)" if left_out else ""
        say(self.lock, f"{cause}; restart {used} of {self.policy.restarts} in {delay:g} s{where}.")
        self.pending = self._row("shrink" if left_out else "restart", cause, attempt + 1, live)
        time.sleep(delay)

    def _row(self, event: str, cause: str, attempt: int, live: list[int]) -> dict:
        return {"time": time.time(), "event": event, "attempt": attempt, "cause": cause, "processes": len(live),
                "slots": live, "from_attempt": attempt - 1}

    def _tick(self) -> None:
        """Read the run's new timeline rows; complete the pending events row once its attempt has started."""
        self.tail.read()
        if self.pending is not None and str(self.pending["attempt"]) in self.tail.starts:
            self._close_pending()

    def _close_pending(self) -> None:
        """Write the pending events row, with what the restarted attempt's start row says (null if none)."""
        if self.pending is None:
            return
        row, self.pending = self.pending, None
        begun = self.tail.starts.get(str(row["attempt"])) or {}
        reached = self.tail.reached.get(str(row.pop("from_attempt")))
        resumed = begun.get("resumed")
        lost = reached - resumed if reached is not None and resumed is not None else None
        row.update({"step_resumed": resumed, "steps_lost": lost, "restored_from": begun.get("source"),
                    "devices": begun.get("devices"), "layout": begun.get("layout")})
        with self.events.open("a") as f:
            f.write(json.dumps(row) + "\n")

    # ------------------------------------------------------------------------------- shrink, regrow
    def _healthy(self, slot: int) -> bool:
        if self.policy.health_check is None:
            return True
        try:
            return subprocess.run(self.policy.health_check, shell=True, capture_output=True,
                                  env={**os.environ, distributed.ENV_SLOT: str(slot)},
                                  timeout=HEALTH_CHECK_TIMEOUT_S).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def _leave_out(self, slots: list[int]) -> None:
        for slot in slots:
            self.out[slot] = time.monotonic()

    def _regrow_due(self) -> bool:
        """Whether a slot that is out is healthy again (checked every --regrow-after seconds, or on SIGUSR1)."""
        if not self.out:
            return False
        now, every = time.monotonic(), self.policy.regrow_after
        due = [s for s, since in self.out.items() if self.asked_regrow or (every is not None and now - since >= every)]
        self.asked_regrow = False
        for slot in due:
            self.out[slot] = now
        self.rejoining = [s for s in due if self._healthy(s)]
        if self.rejoining:
            names = ", ".join(map(str, self.rejoining))
            say(self.lock, f"slot {names} is healthy again; the run stops at a checkpoint and goes on with "
                           f"{len(self._live()) + len(self.rejoining)} processes.")
        return bool(self.rejoining)

    def _regrow(self, attempt: int) -> None:
        for slot in self.rejoining:
            del self.out[slot]
        cause = f"slot {', '.join(map(str, self.rejoining))} healthy again"
        self.pending = self._row("regrow", cause, attempt, self._live())
