"""The machine a speed figure comes from: its processor, whether it multiplies bf16 natively, and the
matmul rates it reaches, measured when asked. Machines of the same kind differ (an AMD EPYC with
AVX-512 BF16 runs a bf16 matmul 1.8x faster than fp32, one without it slower), so every benchmark
table, JSON line and training summary carries this record.

    python -m jaxpar.runtime.machine     prints the record and its line as one JSON line
                                 (benchmarks/peer_maxtext.py, which runs without jax, asks
                                 jaxpar's interpreter for it)

The rates are of one MATMUL_SIZE^3 matmul on one device, the median of a few after a compile: on a
CPU the emulated devices share the cores, so that is the rate of the whole machine. A GPU's record
names the device and whether it has bf16 tensor cores (compute capability 8.0 or more).

Benchmarks measure the record afresh (`describe`); a training run's summary reads it from the cache
(`cached_describe`: measured on the first run of this machine, device count and jax version, then kept
in cache_dir()), so a run does not end with a second of matmuls, four on a CPU whose bf16 is slow.
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

MATMUL_SIZE = 2048
REPEATS = 3
# dtype names as jax.numpy and jaxpar.config.precision spell them -> the short names of the tables
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo's names for bf16 dot products in hardware


def cache_dir() -> Path:
    """Where jaxpar keeps what it measured or compiled once (machine records, calibrations, plans)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxpar"


def store_json(path: Path, data, indent: int | None = None) -> None:
    """Write `data` as JSON at `path` atomically (a temporary file of this process, then a rename), so that
    processes reading or writing the same cache entry at once never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.{id(data)}.tmp")
    tmp.write_text(json.dumps(data, indent=indent))
    tmp.replace(path)


def processor() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # not Linux: the platform module's name is the best there is
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags (/proc/cpuinfo), or None where there is no such file."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return set()


def native_bf16(device=None) -> bool | None:
    """Whether bf16 matmuls run in hardware: a CPU with AVX-512 BF16 or AMX (None: flags unknown), a
    GPU of compute capability 8.0 or more."""
    if device is not None and device.platform == "gpu":
        capability = getattr(device, "compute_capability", None)
        return None if capability is None else float(capability) >= 8.0
    flags = cpu_flags()
    return None if flags is None else any(f in flags for f in NATIVE_BF16_FLAGS)


def matmul_rate(dtype: str, device=None, size: int = MATMUL_SIZE) -> float:
    """FLOP/s of one size^3 matmul in `dtype` (a jax.numpy name) on `device` (default: the first),
    the median of REPEATS runs after one that compiles."""
    import jax
    import jax.numpy as jnp

    device = device or jax.devices()[0]
    a = jax.device_put(jnp.ones((size, size), dtype), device)
    matmul = jax.jit(lambda x, y: x @ y)
    jax.block_until_ready(matmul(a, a))
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(matmul(a, a))
        times.append(time.perf_counter() - start)
    return 2 * size ** 3 / statistics.median(times)


def describe(devices=None, dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> dict:
    """The record of this machine: processor (a GPU: its device kind), cores, native bf16, the device
    count and kind, and the measured matmul rate of each of `dtypes` (FLOP/s, by jax.numpy name)."""
    import jax

    devices = devices or jax.devices()
    first = next(d for d in devices if d.process_index == jax.process_index())  # one this process can use
    gpu = first.platform == "gpu"
    return {"processor": first.device_kind if gpu else processor(), "cores": os.cpu_count(),
            "native_bf16": native_bf16(first), "platform": first.platform, "devices": len(devices),
            "matmul_size": MATMUL_SIZE, "matmul_flops": {d: matmul_rate(d, first) for d in dtypes}}


def cached_describe(devices, dtypes: tuple[str, ...]) -> dict:
    """`describe(devices, dtypes)`, measured once per processor, core count, device count and kind and jax
    version, then read from cache_dir(). Without dtypes nothing is measured, and nothing is kept."""
    import jax

    if not dtypes:
        return describe(devices, dtypes)
    first = devices[0]
    key = json.dumps([processor(), os.cpu_count(), len(devices), first.platform, first.device_kind, jax.__version__,
                      MATMUL_SIZE, list(dtypes)])
    path = cache_dir() / f"machine-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        pass
    except ValueError as e:  # a damaged cache file: measure again
        print(f"jaxpar: re-measuring the machine's matmul rate ({path} unreadable: {e})", file=sys.stderr)
    record = describe(devices, dtypes)
    store_json(path, record)
    return record


def line(record: dict) -> str:
    """The record in words: 'AMD EPYC, 2 cores, no native bf16; 2048^3 matmul: fp32 95 GFLOP/s, bf16 16 GFLOP/s'."""
    native = {True: "native bf16", False: "no native bf16", None: "native bf16 unknown"}[record["native_bf16"]]
    rates = ", ".join(f"{SHORT.get(d, d)} {r / 1e9:,.0f} GFLOP/s" for d, r in record["matmul_flops"].items())
    where = record["processor"] + (f", {record['cores']} cores" if record["platform"] == "cpu" else "")
    return f"{where}, {native}; {record['matmul_size']}^3 matmul: {rates}"


if __name__ == "__main__":
    found = describe()
    print(json.dumps({**found, "line": line(found)}))
    sys.exit(0)
