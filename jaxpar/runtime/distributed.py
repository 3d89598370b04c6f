"""Multi-process runs on the JAX distributed runtime: detection, initialization, liveness.

A run is multi-process when the environment says so:
- JAXPAR_COORDINATOR (host:port), JAXPAR_NUM_PROCESSES and JAXPAR_PROCESS_ID (set by
  `jaxpar launch`, or by hand / a Kubernetes indexed Job), or
- a cluster JAX detects itself: SLURM with more than one task, Open MPI with more than one
  rank, or JAX_COORDINATOR_ADDRESS.

`initialize` must run before jax starts its backends. On CPU it selects gloo collectives.
It then starts a watchdog: every process bumps a counter in the coordinator's key-value
store, and a process whose counter stops moving for `run.heartbeat_timeout` seconds is
declared lost; the survivors print one sentence naming it and exit with EXIT_LOST, instead
of waiting forever inside a collective. JAX's own heartbeat timeout is set longer, so that
this sentence, not a C++ abort, is what a user sees when a worker dies.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable

from jaxpar.config import ConfigError
from jaxpar.errors import EXIT_LOST, RunFailed

ENV_COORDINATOR = "JAXPAR_COORDINATOR"
ENV_NUM_PROCESSES = "JAXPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXPAR_PROCESS_ID"
ENV_LOCAL_DEVICES = "JAXPAR_LOCAL_DEVICES"  # emulated CPU devices per process (set by `jaxpar launch`)
ENV_SLOT = "JAXPAR_SLOT"  # which of `jaxpar launch`'s process slots (its devices) this process runs in
ENV_ATTEMPT = "JAXPAR_ATTEMPT"  # which start of the run under `jaxpar launch --restarts` this is (1, 2, ...)
_KEY_PREFIX = "jaxpar/alive/"
_TRIES, _RETRY_SLEEP_S = 3, 1.0  # a coordinator call that fails for no expected reason is tried this often
_SHARE_TIMEOUT_MS = 120_000  # how long share() waits for a peer's value (the peers are at most a read behind)


class CoordinatorFailed(RunFailed):
    """A call to the coordinator's key-value store kept failing; like a lost process 0, this ends the run."""

    exit_code = EXIT_LOST


@dataclasses.dataclass(frozen=True)
class ProcessSetup:
    """Where this process stands in a multi-process run (None fields: JAX detects them)."""

    coordinator: str | None
    num_processes: int | None
    process_id: int | None


def _int_env(env: dict, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {env[name]!r}.") from None


def from_environment(env: dict | None = None) -> ProcessSetup | None:
    """The multi-process setup the environment asks for, or None for a single-process run."""
    env = os.environ if env is None else env
    ours = [name for name in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID) if env.get(name)]
    if ours:
        if len(ours) < 3:
            missing = sorted({ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID} - set(ours))
            raise ConfigError(f"{', '.join(ours)} is set but {', '.join(missing)} is not; a multi-process run needs "
                              f"all three.")
        count, index = _int_env(env, ENV_NUM_PROCESSES), _int_env(env, ENV_PROCESS_ID)
        if count < 1 or not 0 <= index < count:
            raise ConfigError(f"{ENV_PROCESS_ID}={index} must be between 0 and {ENV_NUM_PROCESSES}-1={count - 1}.")
        return None if count == 1 else ProcessSetup(env[ENV_COORDINATOR], count, index)
    slurm = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    mpi = env.get("OMPI_COMM_WORLD_SIZE")
    if env.get("JAX_COORDINATOR_ADDRESS") or (slurm and slurm.isdigit() and int(slurm) > 1) or \
            (mpi and mpi.isdigit() and int(mpi) > 1):
        return ProcessSetup(None, None, None)
    return None


def local_device_count(env: dict | None = None) -> int | None:
    """The number of CPU devices each process should emulate, when `jaxpar launch` set it."""
    env = os.environ if env is None else env
    if not env.get(ENV_LOCAL_DEVICES):
        return None
    count = _int_env(env, ENV_LOCAL_DEVICES)
    if count < 1:
        raise ConfigError(f"{ENV_LOCAL_DEVICES} must be positive, got {count}.")
    return count


class Watchdog:
    """Declares a peer lost when its liveness counter stops moving for `timeout` seconds."""

    def __init__(self, client, process_id: int, num_processes: int, timeout: float):
        self.client, self.process_id, self.num_processes, self.timeout = client, process_id, num_processes, timeout
        self.interval = max(0.2, min(1.0, timeout / 10))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxpar-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def stopped_or_lost(self, seconds: float) -> None:
        """Wait up to `seconds` (the watchdog exits the process if it finds a lost peer meanwhile)."""
        self._stop.wait(seconds)

    def _run(self) -> None:
        last_seen: dict[int, tuple[str, float]] = {}
        started = time.monotonic()
        rpc_failed_since = None
        own_key = f"{_KEY_PREFIX}{self.process_id}"
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            try:
                self.client.key_value_increment(own_key, 1)
                counters = dict(self.client.key_value_dir_get(_KEY_PREFIX))
                rpc_failed_since = None
            except _runtime_error():  # the coordinator is gone or slow; it is declared lost below after `timeout`
                rpc_failed_since = rpc_failed_since or now
                if now - rpc_failed_since > self.timeout and not self._stop.is_set():
                    self._lost(0, "the coordinator it runs cannot be reached")
                continue
            for peer in range(self.num_processes):
                value = counters.get(f"{_KEY_PREFIX}{peer}")
                if last_seen.get(peer, (None,))[0] != value:
                    last_seen[peer] = (value, now)
                since = last_seen[peer][1] if value is not None else started
                if peer != self.process_id and now - since > self.timeout and not self._stop.is_set():
                    self._lost(peer, f"it has not answered for {self.timeout:g} s")

    def _lost(self, peer: int, why: str) -> None:
        print(f"jaxpar: error: lost process {peer} of {self.num_processes} ({why}); process {self.process_id} "
              f"stops too, resume from the last checkpoint.", file=sys.stderr, flush=True)
        os._exit(EXIT_LOST)  # the main thread may be blocked inside a collective that never completes


_watchdog: Watchdog | None = None


def initialize(setup: ProcessSetup, heartbeat_timeout: float, on_cpu: bool) -> None:
    """Join the distributed runtime (before jax starts its backends) and start the watchdog."""
    global _watchdog
    import jax

    if on_cpu:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX aborts the process itself once its heartbeat times out; ours fires first, with a clear sentence.
    jax_timeout = int(heartbeat_timeout * 2 + 10)
    try:
        jax.distributed.initialize(setup.coordinator, setup.num_processes, setup.process_id,
                                   heartbeat_timeout_seconds=jax_timeout,
                                   initialization_timeout=int(max(60, heartbeat_timeout * 4)))
    except (ValueError, RuntimeError) as e:
        where = setup.coordinator or "the detected cluster"
        raise ConfigError(f"could not join the distributed run at {where} ({' '.join(str(e).split())[:200]}).") \
            from None
    _watchdog = Watchdog(_client(), jax.process_index(), jax.process_count(), heartbeat_timeout).start()


def finish(timeout: float = 600.0) -> None:
    """Wait until every process is done, then stop the watchdog (a finished peer is not a lost one)."""
    global _watchdog
    if _watchdog is None:
        return
    try:
        _client().wait_at_barrier("jaxpar/finish", int(timeout * 1000))
    finally:
        _watchdog.stop()
        _watchdog = None


def wait_for_lost_peer() -> None:
    """After an error in a multi-process run, give the watchdog time to name a lost peer.

    A collective whose peer died fails at once (gloo: "connection closed by peer") without
    saying which process is gone; the watchdog knows within run.heartbeat_timeout and then
    ends the process with its one sentence. Returns when no peer is lost: the error is this
    process's own.
    """
    if _watchdog is not None:
        _watchdog.stopped_or_lost(_watchdog.timeout * 1.5 + 2)


def abandon() -> None:
    """Stop the watchdog without waiting for the others (this process is exiting with an error)."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None


def is_secondary() -> bool:
    """Whether this is a process other than 0 of a multi-process run (it leaves reporting to process 0).

    Works before the runtime is joined too, from the launcher's or the cluster's rank variables.
    """
    if "jax" in sys.modules and _client_or_none() is not None:
        import jax

        return jax.process_index() != 0
    for name in (ENV_PROCESS_ID, "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name]) != 0
    return False


def _client_or_none():
    try:
        return _client()
    except ImportError:
        return None


class StopAgreement:
    """Turns a signal seen by any process into one step at which every process stops.

    The first process to see SIGTERM/SIGINT publishes `its step + 2` in the key-value store.
    Processes stay within one step of each other (each reads step N's replicated metrics,
    which needs every process to have run step N, before deciding about step N+1), so all
    of them read that value before they reach it, and all stop and save at the same step.
    """

    KEY = "jaxpar/stop_at"

    def __init__(self):
        import jax

        self.multi = jax.process_count() > 1
        self._published = False
        self._stop_at: int | None = None

    def should_stop(self, step: int, signalled: bool) -> bool:
        """Whether to stop after `step` (call once per step on every process, in step order).

        Raises CoordinatorFailed when the key-value store keeps failing: a process that cannot
        learn of a stop must not train on past it.
        """
        if not self.multi:
            return signalled
        client = _client()
        if signalled and not self._published:
            # ALREADY_EXISTS: another process published first, and its step holds for everyone.
            ask_coordinator("publishing the stop step in the coordinator",
                            lambda: client.key_value_set(self.KEY, str(step + 2)), expected="ALREADY_EXISTS")
            self._published = True
        if self._stop_at is None:
            # NOT_FOUND: no process has seen a signal yet.
            value = ask_coordinator("reading the stop step from the coordinator",
                                    lambda: client.key_value_try_get(self.KEY), expected="NOT_FOUND")
            if value is None:
                return False
            self._stop_at = int(value)
        return step >= self._stop_at


_shares = itertools.count()  # every process calls share() in the same order, so the n-th calls meet


def share(value: str) -> list[str]:
    """Every process's `value`, in process order; returns only once all of them have published theirs,
    so it is also a barrier. Call it on every process, in the same order. A single process gets [value]."""
    import jax

    if jax.process_count() == 1:
        return [value]
    client, prefix = _client(), f"jaxpar/share/{next(_shares)}/"
    # ALREADY_EXISTS: an earlier try got through although its answer was lost.
    ask_coordinator("publishing a value for the other processes in the coordinator",
                    lambda: client.key_value_set(f"{prefix}{jax.process_index()}", value), expected="ALREADY_EXISTS")
    return [ask_coordinator(f"reading the value of process {peer} from the coordinator",
                            lambda peer=peer: client.blocking_key_value_get(f"{prefix}{peer}", _SHARE_TIMEOUT_MS))
            for peer in range(jax.process_count())]


def ask_coordinator[T](what: str, call: Callable[[], T], expected: str | None = None) -> T | None:
    """`call()` on the coordinator's key-value store, which reports errors as a JaxRuntimeError whose
    text starts with an absl status ("NOT_FOUND: ..."). Returns None when it fails with the `expected`
    status; retries any other failure a few times, then raises CoordinatorFailed saying that `what` failed."""
    for attempt in range(_TRIES):
        if attempt:
            time.sleep(_RETRY_SLEEP_S)
        try:
            return call()
        except _runtime_error() as e:
            if str(e).split(":", 1)[0] == expected:
                return None
            failure = e
    import jax

    raise CoordinatorFailed(f"{what} failed {_TRIES} times ({_first_sentence(failure)}); process "
                            f"{jax.process_index()} stops, resume from the last checkpoint.")


def _first_sentence(error: Exception) -> str:
    """'UNAVAILABLE: Failed to send RPC to coordination service' out of the runtime's multi-line report."""
    text = " ".join(str(error).split()).split(". ")[0].rstrip(".")
    return text if len(text) <= 120 else text[:117] + "..."


def _runtime_error() -> type[Exception]:
    """The type of the coordinator client's errors (imported late: jax must not start before initialize)."""
    from jax.errors import JaxRuntimeError

    return JaxRuntimeError


def _client():
    from jax._src import distributed as jax_distributed  # the runtime client: key-value store and barriers

    return jax_distributed.global_state.client
