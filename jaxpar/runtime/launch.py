"""`jaxpar launch`: start N jaxpar processes on this machine as one distributed run.

For testing multi-process code paths on one CPU host, and for one multi-GPU box. Each child
gets JAXPAR_COORDINATOR=127.0.0.1:<free port>, JAXPAR_NUM_PROCESSES and JAXPAR_PROCESS_ID,
plus its device share. Their output is streamed line by line with a "[i] " prefix; the JAX
runtime's own C++ log lines (connection chatter, fatal-error stack traces) are held back
unless --verbose, and summarized in one sentence if that process fails.

The launcher exits 0 when every process does, else with the first failing process's code.
When one process fails, the others get `grace` seconds to notice (their watchdog names the
lost process and exits) before they are killed, so the launcher never hangs.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from jaxpar.config.command_flags import check_launch_flags
from jaxpar.errors import EXIT_LOST, EXIT_USAGE
from jaxpar.runtime import distributed
from jaxpar.runtime.devices import has_accelerator_plugin

# glog lines (I1129 11:03:11.66 123 file.cc:45] ...), their stack frames, and gloo's connection chatter
_RUNTIME_LOG = re.compile(rb"^([IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\]|\s+@\s+0x|\*\*\* |"
                          rb"RPC: /|The tasks have crashed|\d+$|:UNKNOWN:|Additional GRPC error)")
_FATAL = re.compile(rb"^F\d{4} [^\]]*\] (.*)")
DEFAULT_GRACE_S = 60.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Stream(threading.Thread):
    """Copies one child pipe to our stdout/stderr with a prefix, a line (or \\r-update) at a time."""

    def __init__(self, pipe, out, prefix: bytes, verbose: bool, lock: threading.Lock):
        super().__init__(daemon=True)
        self.pipe, self.out, self.prefix, self.verbose, self.lock = pipe, out, prefix, verbose, lock
        self.fatal: str | None = None
        self._after_cr = False  # the last segment ended in \r: a \n right after it ends the same line
        self._after_dropped = False  # the last line was runtime noise we did not show

    def run(self) -> None:
        buffer = b""
        while chunk := self.pipe.read1(65536) if hasattr(self.pipe, "read1") else self.pipe.read(65536):
            buffer += chunk
            while (cut := _first_break(buffer)) >= 0:
                self._emit(buffer[:cut + 1])
                buffer = buffer[cut + 1:]
        if buffer:
            self._emit(buffer + b"\n")

    def _emit(self, segment: bytes) -> None:
        after_cr, self._after_cr = self._after_cr, segment.endswith(b"\r")
        if after_cr and segment == b"\n":  # the rest of a \r\n: no line of its own
            return
        text = segment.rstrip(b"\r\n")
        if match := _FATAL.match(text):
            self.fatal = self.fatal or match.group(1).decode(errors="replace")
        if not self.verbose:
            # Gloo's threads write their lines and newlines to the same stdout concurrently, so two
            # messages can arrive as one line followed by an empty one: drop that empty line too.
            noise = bool(text) and bool(_RUNTIME_LOG.match(text) or b"peer ranks" in text or b"[Gloo]" in text)
            if noise or (self._after_dropped and not text):
                self._after_dropped = True
                return
            self._after_dropped = False
        with self.lock:
            self.out.buffer.write(self.prefix + segment)
            self.out.flush()


def _first_break(data: bytes) -> int:
    positions = [p for p in (data.find(b"\n"), data.find(b"\r")) if p >= 0]
    return min(positions) if positions else -1


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


def _child_env(slot: int, rank: int, processes: int, devices_per_process: int | None, port: int,
               attempt: int | None = None) -> dict:
    """The environment of the process of `slot` (its GPUs), the `rank`-th of `processes` in this attempt."""

    env = dict(os.environ)
    env.update({distributed.ENV_COORDINATOR: f"127.0.0.1:{port}", distributed.ENV_NUM_PROCESSES: str(processes),
                distributed.ENV_PROCESS_ID: str(rank), distributed.ENV_SLOT: str(slot), "PYTHONUNBUFFERED": "1"})
    if attempt is not None:
        env[distributed.ENV_ATTEMPT] = str(attempt)
    if devices_per_process:
        env[distributed.ENV_LOCAL_DEVICES] = str(devices_per_process)
        if has_accelerator_plugin():  # one multi-GPU box: give each process its own GPUs
            first = slot * devices_per_process
            env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(first + k) for k in range(devices_per_process))
    return env


@dataclasses.dataclass
class Attempt:
    """The processes of one start of the run: slot -> child, and their output streams."""

    children: dict[int, subprocess.Popen]
    streams: dict[int, list]
    lock: threading.Lock


def start(slots: list[int], command: list[str], devices_per_process: int | None, verbose: bool,
          lock: threading.Lock, attempt: int | None = None) -> Attempt:
    """Start `jaxpar <command>` once for each of `slots` as one distributed run on a free port."""
    port = free_port()
    children, streams = {}, {}
    for rank, slot in enumerate(slots):
        child = subprocess.Popen([sys.executable, "-m", "jaxpar", *command], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE,
                                 env=_child_env(slot, rank, len(slots), devices_per_process, port, attempt))
        prefix = f"[{slot}] ".encode()
        pair = [_Stream(child.stdout, sys.stdout, prefix, verbose, lock),
                _Stream(child.stderr, sys.stderr, prefix, verbose, lock)]
        for stream in pair:
            stream.start()
        children[slot], streams[slot] = child, pair
    return Attempt(children, streams, lock)


def launch(processes: int, command: list[str], devices_per_process: int | None = None,
           grace: float = DEFAULT_GRACE_S, verbose: bool = False) -> int:
    """Run `jaxpar <command>` in `processes` local processes; return the launcher's exit code."""
    check_launch_flags(processes, devices_per_process, command)
    lock = threading.Lock()
    return watch(start(list(range(processes)), command, devices_per_process, verbose, lock), grace).code


def say(lock: threading.Lock, message: str) -> None:
    with lock:
        print(f"jaxpar launch: {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Outcome:
    """How an attempt ended: the launcher's exit code, the first failure (slot, return code), whether
    the user stopped it (a signal to the launcher) and whether `stop_when` did."""

    code: int
    failure: tuple[int, int] | None
    interrupted: bool
    stopped: bool


class _Forward:
    """While active, SIGINT/SIGTERM to the launcher go on to the children: the first lets each finish its
    step and checkpoint, the second stops them now."""

    def __init__(self, attempt: Attempt):
        self.attempt, self.count = attempt, 0

    def __enter__(self) -> _Forward:
        self.previous = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _forward(self, signum, frame) -> None:
        self.count += 1
        terminate(self.attempt, signal.SIGTERM if self.count == 1 else signal.SIGKILL)

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def terminate(attempt: Attempt, signum: int) -> None:
    for child in attempt.children.values():
        if child.poll() is None:
            child.send_signal(signum)


def watch(attempt: Attempt, grace: float, restartable: Callable[[int], bool] = lambda rc: False,
          stop_when: Callable[[], bool] = lambda: False, tick: Callable[[], None] = lambda: None) -> Outcome:
    """Wait for the attempt's processes to end. When one fails, the others get `grace` seconds to stop by
    themselves, unless `restartable(its code)`: then they are killed at once (the run starts again) and only
    the launcher's restart line reports it. `stop_when()` True asks the processes to stop at a checkpoint
    (SIGTERM); `tick()` runs every poll."""
    children, lock = attempt.children, attempt.lock
    failure, deadline, reported, stopped, quiet = None, None, set(), False, False
    with _Forward(attempt) as forward:
        while any(child.poll() is None for child in children.values()):
            tick()
            if not stopped and failure is None and not forward.count and stop_when():
                stopped = quiet = True  # how the processes end now is the stop's doing, not a failure
                terminate(attempt, signal.SIGTERM)
            for slot, child in children.items():
                rc = child.poll()
                if rc is None or rc == 0 or slot in reported:
                    continue
                reported.add(slot)
                if quiet:
                    continue
                if failure is None and restartable(rc):
                    failure, quiet = (slot, rc), True
                    terminate(attempt, signal.SIGKILL)
                    continue
                _join(attempt, slot)
                _report(lock, slot, rc, attempt.streams[slot], failure[0] if failure else None)
                if failure is None:
                    failure, deadline = (slot, rc), time.monotonic() + grace
            if deadline is not None and time.monotonic() > deadline:
                for slot, child in children.items():
                    if child.poll() is None:
                        say(lock, f"process {slot} did not stop {grace:g} s after process {failure[0]} failed; "
                                  f"killing it.")
                        child.kill()
                deadline = None
            time.sleep(0.1)
        interrupted = forward.count > 0
    return _outcome(attempt, failure, reported, interrupted, stopped, quiet)


def _join(attempt: Attempt, slot: int) -> None:
    for stream in attempt.streams[slot]:
        stream.join(timeout=5)


def _outcome(attempt: Attempt, failure, reported: set, interrupted: bool, stopped: bool, quiet: bool) -> Outcome:
    for slot, child in attempt.children.items():
        _join(attempt, slot)
        if child.returncode != 0 and slot not in reported and not quiet:
            _report(attempt.lock, slot, child.returncode, attempt.streams[slot], failure[0] if failure else None)
            failure = failure or (slot, child.returncode)
    if failure is None:
        return Outcome(0, None, interrupted, stopped)
    rc = failure[1]
    return Outcome(rc if rc > 0 else 128 - rc, failure, interrupted, stopped)


def _report(lock: threading.Lock, index: int, rc: int, pair: list, lost: int | None) -> None:
    if rc == EXIT_USAGE:
        return  # a user mistake: process 0 has said what to change
    after = f" after process {lost} was lost" if lost is not None and (rc < 0 or rc == EXIT_LOST) else ""
    say(lock, f"process {index} {_describe(rc)}{after}{_runtime_said(pair)}.")


def describe(rc: int, pair: list) -> str:
    """'was killed by SIGKILL', 'exited with code 3 (the JAX runtime said: ...)'."""
    return f"{_describe(rc)}{_runtime_said(pair)}"


def _runtime_said(pair: list) -> str:
    fatal = next((s.fatal for s in pair if s.fatal), None)
    return f" (the JAX runtime said: {fatal.split('. ')[0].rstrip('.')})" if fatal else ""
