"""The `cpu` hardware profile, measured on this machine and cached.

Emulated CPU devices share the host's cores, so what a roofline needs is the rate one device
gets while all of them work: a matmul sharded over every device is timed in each compute dtype
(fp32, bf16, fp16: a run's roofline takes its precision policy's), as is an elementwise op (the
bytes a device writes per second, for the memory term), and all-reduces timed inside a loop (so
that launching the program is not counted) give the fixed cost of a collective and the latency
of one ring step (16-byte messages over every device and over pairs) and the bandwidth (1 MiB
over every device). The profile also keeps the machine's record (jaxpar.runtime.machine: processor,
native bf16, one whole-machine matmul's rates), which the planner prints with its figures. A few
seconds; the result is kept in $XDG_CACHE_HOME/jaxpar (else ~/.cache/jaxpar), keyed by the
processor, the core count, the device count and the jax version, so the next search reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

from jaxpar.runtime import machine
from jaxpar.runtime.hardware import GPU_PROFILES, Hardware
from jaxpar.runtime.machine import cache_dir, store_json

MATMUL_SHAPE = (1024, 512, 512)  # rows per device x contracted x output: a mid-sized layer's matmul
ALL_REDUCE_FLOATS = (4, 2 ** 18)  # fp32 elements per device: a message of latency only, and a large one
LOOP_SHORT, LOOP_LONG = 10, 30
WRITE_FLOATS = 2 ** 21  # fp32 elements per device written by the elementwise probe (8 MiB, past the caches)
REPEATS = 7
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")  # the compute dtypes of jaxpar.config.precision's policies
PROFILE_FORMAT = 2  # 2: rates by compute dtype, and the machine record (jaxpar.runtime.machine)


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
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rows, inner, cols = MATMUL_SHAPE
    n = mesh.devices.size
    x = jax.device_put(jnp.ones((n * rows, inner), dtype), NamedSharding(mesh, P("all")))
    w = jax.device_put(jnp.ones((inner, cols), dtype), NamedSharding(mesh, P()))
    matmul = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(mesh, P("all")))
    return 2 * rows * inner * cols / _median_seconds(matmul, x, w)


def _write_rate(mesh) -> float:
    """Bytes per second one device writes in elementwise work (reading as much) while every
    device works at once."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(mesh, P("all"))
    x = jax.device_put(jnp.ones((mesh.devices.size * WRITE_FLOATS,), jnp.float32), sharding)
    scale = jax.jit(lambda x: x * 1.0001 + 1.0, out_shardings=sharding)
    return WRITE_FLOATS * 4 / _median_seconds(scale, x)


def _all_reduce_seconds(mesh, axis: str, floats: int) -> float:
    """Seconds of one psum over `axis` of `floats` fp32 per device, inside a program: the
    difference of a loop of LOOP_LONG psums and one of LOOP_SHORT, over their difference (so the
    cost of launching a program, about a tenth of a millisecond here, is left out)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    every = P(mesh.axis_names)
    x = jax.device_put(jnp.ones((mesh.devices.size * floats,), jnp.float32), NamedSharding(mesh, every))
    scale = 1 / mesh.shape[axis]  # keeps the values bounded

    def looped(times):
        body = lambda _, y: jax.lax.psum(y, axis) * scale  # noqa: E731
        return jax.jit(jax.shard_map(lambda y: jax.lax.fori_loop(0, times, body, y), mesh=mesh, in_specs=every,
                                     out_specs=every, check_vma=False))

    return (_median_seconds(looped(LOOP_LONG), x) - _median_seconds(looped(LOOP_SHORT), x)) / (LOOP_LONG - LOOP_SHORT)


def _collective_costs(devices: list) -> tuple[float, float, float]:
    """(seconds each collective costs, seconds per ring step, bytes per second each device sends).
    A tiny psum over every device and one over pairs of devices are all latency: a fixed cost
    plus n-1 ring steps (on emulated devices the fixed cost, a rendezvous of threads, dominates);
    a large psum over every device adds its bytes over the link."""
    import numpy as np
    from jax.sharding import Mesh

    n = len(devices)
    every = Mesh(np.asarray(devices), ("all",))
    small, large = (_all_reduce_seconds(every, "all", floats) for floats in ALL_REDUCE_FLOATS)
    step, fixed = max(small, 0.0) / max(n - 1, 1), 0.0
    if n >= 4 and n % 2 == 0:
        pairs = _all_reduce_seconds(Mesh(np.asarray(devices).reshape(n // 2, 2), ("rest", "pair")), "pair",
                                    ALL_REDUCE_FLOATS[0])
        step = max(small - pairs, 0.0) / (n - 2)
        fixed = max(pairs - step, 0.0)
    sent = 2 * (n - 1) / n * ALL_REDUCE_FLOATS[1] * 4  # a ring all-reduce: each device sends 2(n-1)/n of its buffer
    return fixed, step, sent / max(large - small, 1e-9)


def measure(devices: list) -> Hardware:
    """Measure the `cpu` profile on `devices` (all of them working at once)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    mesh = Mesh(np.asarray(devices), ("all",))
    rates = {dtype: _matmul_rate(mesh, jnp.dtype(dtype)) for dtype in COMPUTE_DTYPES}
    fixed, step, bandwidth = _collective_costs(devices)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / len(devices)
    source = (f"measured on {machine.processor()} ({os.cpu_count()} cores) with {len(devices)} emulated devices, "
              f"jax {jax.__version__}")
    return Hardware("cpu", rates, memory, len(devices), bandwidth, bandwidth, step, step, False, source,
                    _write_rate(mesh), fixed, machine.describe(devices))


def _cache_file(devices: list) -> Path:
    import jax

    key = json.dumps([machine.processor(), os.cpu_count(), len(devices), jax.__version__, MATMUL_SHAPE,
                      ALL_REDUCE_FLOATS, WRITE_FLOATS, COMPUTE_DTYPES, PROFILE_FORMAT])
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
    store_json(path, hardware.to_dict(), indent=1)
    return hardware


def profile(name: str, devices: list) -> Hardware:
    """The profile called `name`; `cpu` is calibrated on `devices` (once, then read from the cache)."""
    return cpu_profile(devices) if name == "cpu" else GPU_PROFILES[name]
