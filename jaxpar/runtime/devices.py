"""Devices and meshes: host-device emulation on CPU, accelerator discovery, the distributed
runtime for multi-process runs, and mesh construction (hybrid intra-/inter-host meshes).

`setup_devices` must run before jax initializes its backends: on a CPU-only host it sets
XLA_FLAGS=--xla_force_host_platform_device_count so that an 8-device mesh "just works", and
in a multi-process run it joins the JAX distributed runtime first.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys

from jaxpar.config import MESH_AXES, Config, ConfigError
from jaxpar.runtime import distributed

DEFAULT_CPU_DEVICES = 8
_GPU_PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin", "jax-rocm7-plugin")
_ACCELERATOR_PLUGINS = _GPU_PLUGINS + ("libtpu",)
# Set on a GPU host unless the user set XLA_FLAGS: the latency-hiding scheduler overlaps
# collectives with compute (collectives are already asynchronous by default in this XLA; the
# old --xla_gpu_enable_async_* flags are gone, and XLA aborts on an unknown flag).
GPU_XLA_FLAGS = "--xla_gpu_enable_latency_hiding_scheduler=true"
_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def has_accelerator_plugin(plugins: tuple[str, ...] = _ACCELERATOR_PLUGINS) -> bool:
    """Whether one of `plugins` is installed and JAX_PLATFORMS does not restrict jax to the CPU."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and set(platforms.split(",")) <= {"cpu"}:
        return False
    for name in plugins:
        try:
            importlib.metadata.version(name)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


def _emulate_cpu_devices(count: int) -> None:
    """Ask XLA for `count` host devices, unless jax is already running (then it is too late)."""
    if "jax" in sys.modules and _jax_backend_started():
        return
    flags = _COUNT_FLAG.sub("", os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def _default_gpu_flags() -> None:
    """On a GPU host, XLA_FLAGS=GPU_XLA_FLAGS unless the user set XLA_FLAGS (theirs win, whole)."""
    if "XLA_FLAGS" not in os.environ and has_accelerator_plugin(_GPU_PLUGINS):
        os.environ["XLA_FLAGS"] = GPU_XLA_FLAGS


def _jax_backend_started() -> bool:
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge._backends)
    except (ImportError, AttributeError):
        return True


def requested_devices(cfg: Config) -> int | None:
    """The device count asked for by run.devices, or None for 'auto'."""
    value = cfg.run.devices
    if value == "auto":
        return None
    if isinstance(value, int) and value > 0:
        return value
    raise ConfigError(f"run.devices must be 'auto' or a positive number, got {value!r}.")


def check_device_count(wanted: int | None, available: int, platform: str, processes: int) -> None:
    """Raise ConfigError unless run.devices (`wanted`, None for auto) fits the devices found: a
    multi-process run uses all of them, a single process at most as many as exist."""
    if processes > 1:
        if wanted is not None and wanted != available:
            raise ConfigError(f"run.devices={wanted} but a multi-process run uses all {available} devices of its "
                              f"{processes} processes; leave run.devices=auto.")
    elif wanted is not None and wanted > available:
        raise ConfigError(f"run.devices={wanted} but only {available} {platform} devices exist.")


def setup_devices(cfg: Config) -> list:
    """Prepare and return the devices this run uses (emulated on a CPU-only host)."""
    wanted = requested_devices(cfg)
    setup = distributed.from_environment()
    on_cpu = not has_accelerator_plugin()
    if on_cpu:
        per_process = distributed.local_device_count()
        _emulate_cpu_devices(per_process or max(wanted or DEFAULT_CPU_DEVICES, DEFAULT_CPU_DEVICES))
    else:
        _default_gpu_flags()
    if setup is not None:
        distributed.initialize(setup, cfg.run.heartbeat_timeout, on_cpu)
    import jax

    devices = jax.devices()
    check_device_count(wanted, len(devices), devices[0].platform, jax.process_count())
    if jax.process_count() > 1:
        return devices
    if wanted is None:
        if devices[0].platform == "cpu":
            return devices[:DEFAULT_CPU_DEVICES]
        return devices
    return devices[:wanted]


def make_mesh(sizes: dict[str, int], devices: list, process_split: dict[str, int] | None = None):
    """A mesh with axes (data, tensor, expert, stage), compiler-propagated (Auto) sharding.

    Across several processes the mesh is hybrid: each axis spans process_split[axis] processes
    (jaxpar.config.mesh.host_split), and each process holds a contiguous block of the rest.
    """
    import jax
    import numpy as np
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    shape = tuple(sizes[a] for a in MESH_AXES)
    processes = len({d.process_index for d in devices})
    if processes > 1:
        outer = process_split
        inner = tuple(sizes[a] // outer[a] for a in MESH_AXES)
        grid = mesh_utils.create_hybrid_device_mesh(inner, tuple(outer[a] for a in MESH_AXES), devices,
                                                    process_is_granule=True)
        return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(shape))
    if len(devices) == jax.device_count():
        return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(shape), devices=devices)
    # A subset of devices (e.g. the 1-device reference): lay them out in order.
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(shape))
