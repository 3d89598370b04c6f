"""The `cpu` hardware profile, measured on this machine and cached.

Emulated CPU devices share the host's cores, so what a roofline needs is the rate one device
gets while all of them work: a matmul sharded over every device is timed (fp32 and bf16), and
an all-reduce over every device at two sizes gives a latency and a bandwidth (a straight line
through time against the bytes each device sends). A few seconds; the result is kept in
$XDG_CACHE_HOME/jaxpar (else ~/.cache/jaxpar), keyed by the processor, the core count, the
device count and the jax version, so the next search reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from jaxpar.hardware import Hardware

MATMUL_SHAPE = (1024, 512, 512)  # rows per device x contracted x output: a mid-sized layer's matmul
ALL_REDUCE_FLOATS = (2 ** 12, 2 ** 20)  # fp32 elements per device: a small and a large message
REPEATS = 7


def cache_dir() -> Path:
    """Where jaxpar keeps what it measured or compiled once (calibrations, plans)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxpar"


def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # not Linux: the platform module's name is the best there is
        pass
    return platform.processor() or platform.machine()


def _median_seconds(fn, *args) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul_rate(mesh, dtype) -> float:
    """FLOP/s one device reaches on its shard while every device multiplies at once."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    rows, inner, cols = MATMUL_SHAPE
    n = mesh.devices.size
    x = jax.device_put(jnp.ones((n * rows, inner), dtype), NamedSharding(mesh, P("all")))
    w = jax.device_put(jnp.ones((inner, cols), dtype), NamedSharding(mesh, P()))
    matmul = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(mesh, P("all")))
    return 2 * rows * inner * cols / _median_seconds(matmul, x, w)


def _all_reduce_line(mesh) -> tuple[float, float]:
    """(seconds per all-reduce, bytes per second each device sends) of a psum over every device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    n = mesh.devices.size
    psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "all"), mesh=mesh, in_specs=P("all"), out_specs=P("all")))
    sent, seconds = [], []
    for floats in ALL_REDUCE_FLOATS:
        x = jax.device_put(jnp.ones((n * floats,), jnp.float32), NamedSharding(mesh, P("all")))
        sent.append(2 * (n - 1) / n * floats * 4)  # a ring all-reduce: each device sends 2(n-1)/n of its buffer
        seconds.append(_median_seconds(psum, x))
    slope = (seconds[1] - seconds[0]) / (sent[1] - sent[0])
    latency = max(seconds[0] - slope * sent[0], 0.0)
    return latency, (1 / slope if slope > 0 else float("inf"))


def measure(devices: list) -> Hardware:
    """Measure the `cpu` profile on `devices` (all of them working at once)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    mesh = Mesh(np.asarray(devices), ("all",))
    fp32, bf16 = _matmul_rate(mesh, jnp.float32), _matmul_rate(mesh, jnp.bfloat16)
    latency, bandwidth = _all_reduce_line(mesh)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / len(devices)
    source = (f"measured on {_processor()} ({os.cpu_count()} cores) with {len(devices)} emulated devices, "
              f"jax {jax.__version__}")
    return Hardware("cpu", {"fp32": fp32, "bf16": bf16, "fp16": bf16}, memory, len(devices), bandwidth, bandwidth,
                    latency, latency, False, source)


def _cache_file(devices: list) -> Path:
    import jax

    key = json.dumps([_processor(), os.cpu_count(), len(devices), jax.__version__, MATMUL_SHAPE,
                      ALL_REDUCE_FLOATS])
    return cache_dir() / f"cpu-profile-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def cpu_profile(devices: list) -> Hardware:
    """The `cpu` profile for these devices: from the cache, else measured (and cached)."""
    path = _cache_file(devices)
    try:
        return Hardware(**json.loads(path.read_text()))
    except FileNotFoundError:
        pass
    except (ValueError, TypeError) as e:  # a damaged or older cache file: measure again
        print(f"jaxpar: re-measuring the cpu profile ({path} unreadable: {e})", file=sys.stderr)
    print(f"jaxpar: measuring the cpu profile on {len(devices)} devices (once; cached in {path})", file=sys.stderr)
    hardware = measure(devices)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(hardware.to_dict(), indent=1))
    tmp.replace(path)
    return hardware
