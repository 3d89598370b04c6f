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

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxpar import distributed
from jaxpar.errors import EXIT_LOST, EXIT_USAGE
from jaxpar.validation import check_launch_flags

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


def _child_env(index: int, processes: int, devices_per_process: int | None, port: int) -> dict:
    from jaxpar.runtime import has_accelerator_plugin

    env = dict(os.environ)
    env.update({distributed.ENV_COORDINATOR: f"127.0.0.1:{port}", distributed.ENV_NUM_PROCESSES: str(processes),
                distributed.ENV_PROCESS_ID: str(index), "PYTHONUNBUFFERED": "1"})
    if devices_per_process:
        env[distributed.ENV_LOCAL_DEVICES] = str(devices_per_process)
        if has_accelerator_plugin():  # one multi-GPU box: give each process its own GPUs
            first = index * devices_per_process
            env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(first + k) for k in range(devices_per_process))
    return env


def launch(processes: int, command: list[str], devices_per_process: int | None = None,
           grace: float = DEFAULT_GRACE_S, verbose: bool = False) -> int:
    """Run `jaxpar <command>` in `processes` local processes; return the launcher's exit code."""
    check_launch_flags(processes, devices_per_process, command)
    port = free_port()
    lock = threading.Lock()
    children, streams = [], []
    for index in range(processes):
        child = subprocess.Popen([sys.executable, "-m", "jaxpar", *command], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=_child_env(index, processes, devices_per_process, port))
        prefix = f"[{index}] ".encode()
        pair = [_Stream(child.stdout, sys.stdout, prefix, verbose, lock),
                _Stream(child.stderr, sys.stderr, prefix, verbose, lock)]
        for stream in pair:
            stream.start()
        children.append(child)
        streams.append(pair)
    return _supervise(children, streams, grace, lock)


def _say(lock: threading.Lock, message: str) -> None:
    with lock:
        print(f"jaxpar launch: {message}", file=sys.stderr, flush=True)


def _supervise(children: list, streams: list, grace: float, lock: threading.Lock) -> int:
    first_failure: tuple[int, int] | None = None
    deadline = None
    reported: set[int] = set()
    interrupted = 0

    def forward(signum, frame):
        nonlocal interrupted
        interrupted += 1
        for child in children:
            if child.poll() is None:
                # First signal: let each process finish its step and checkpoint; second: stop now.
                child.send_signal(signal.SIGTERM if interrupted == 1 else signal.SIGKILL)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while any(child.poll() is None for child in children):
            for index, child in enumerate(children):
                rc = child.poll()
                if rc is None or rc == 0 or index in reported:
                    continue
                reported.add(index)
                for stream in streams[index]:
                    stream.join(timeout=5)
                _report(lock, index, rc, streams[index], first_failure[0] if first_failure else None)
                if first_failure is None:
                    first_failure, deadline = (index, rc), time.monotonic() + grace
            if deadline is not None and time.monotonic() > deadline:
                for index, child in enumerate(children):
                    if child.poll() is None:
                        _say(lock, f"process {index} did not stop {grace:g} s after process {first_failure[0]} "
                                   f"failed; killing it.")
                        child.kill()
                deadline = None
            time.sleep(0.1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for index, child in enumerate(children):
        for stream in streams[index]:
            stream.join(timeout=5)
        if child.returncode != 0 and index not in reported:
            _report(lock, index, child.returncode, streams[index], first_failure[0] if first_failure else None)
            first_failure = first_failure or (index, child.returncode)
    if first_failure is None:
        return 0
    rc = first_failure[1]
    return rc if rc > 0 else 128 - rc


def _report(lock: threading.Lock, index: int, rc: int, pair: list, lost: int | None) -> None:
    fatal = next((s.fatal for s in pair if s.fatal), None)
    if rc == EXIT_USAGE:
        return  # a user mistake: process 0 has said what to change
    after = f" after process {lost} was lost" if lost is not None and (rc < 0 or rc == EXIT_LOST) else ""
    cause = f" (the JAX runtime said: {fatal.split('. ')[0].rstrip('.')})" if fatal else ""
    _say(lock, f"process {index} {_describe(rc)}{after}{cause}.")
