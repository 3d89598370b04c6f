"""An elastic run's layout on the devices it has now (run.elastic=true, `jaxpar train --elastic`).

The first elastic start records the rows each device holds per microbatch (jaxpar.runtime.elastic). A later
start on another device count keeps them: the config's own mesh, when it lays out on the devices
(an axis of -1 fills them), validates and fits the memory budget, with the microbatch count that
keeps the rows; else the planner's best layout that fits (jaxpar.plan.search, on these devices),
searching the mesh and the microbatch count with the rest of the recipe held (held_settings). The
global batch is the same either way, so the optimizer takes the same steps, up to the order of the
reductions; the checkpoint is resharded onto the new layout when it is restored.

Every process decides the same way (the same compiles, in the same order); process 0's decision is
taken by all. The memory budget is a device's memory: what a GPU reports, or the host's RAM shared
by a process's CPU devices.
"""

from __future__ import annotations

import json
import os
import sys

from jaxpar.config import Config, ConfigError, flatten_dict
from jaxpar.config.mesh import resolve_mesh
from jaxpar.errors import UserError
from jaxpar.features.validation import validate
from jaxpar.runtime import distributed
from jaxpar.runtime.elastic import keep_rows, read_record


def prepare_elastic(cfg: Config):
    """jaxpar.session.prepare for a run with run.elastic=true: the devices first, then the layout for them."""
    from jaxpar.runtime.devices import setup_devices
    from jaxpar.train.run_session import prepare

    devices = setup_devices(cfg)
    return prepare(replan(cfg, devices), devices)


def _local(devices: list) -> list:
    import jax

    return [d for d in devices if d.process_index == jax.process_index()]


def memory_budget(devices: list) -> float:
    """Bytes of memory one device has: the GPU's own limit, else the host's RAM over this process's devices."""
    stats = devices[0].memory_stats() if devices[0].platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / len(_local(devices))


def _fits(layout: Config, devices: list, budget: float) -> bool:
    from jaxpar.plan import compiled_cache

    entry, _ = compiled_cache.measure(layout, devices, budget)
    return not entry["state_only"] and entry["bytes_per_device"] <= budget


def held_settings(cfg: Config) -> dict:
    """What the re-plan keeps as the config wrote it: the run's recipe, which no device count forces to
    change (ZeRO, remat, and with stages the schedule). The planner chooses the mesh and the microbatch
    count only: a handful of compiles, where the whole search would be hundreds."""
    held = {"parallel.zero": cfg.parallel.zero, "train.remat": cfg.train.remat}
    if cfg.mesh.stage == 1:
        return {**held, "mesh.stage": 1}
    return {**held, "parallel.pipeline.schedule": cfg.parallel.pipeline.schedule,
            "parallel.pipeline.virtual": cfg.parallel.pipeline.virtual}


def _planned(cfg: Config, devices: list, budget: float) -> tuple[dict, str]:
    """The planner's best layout of `cfg` on `devices` within `budget` (held_settings held), and its name."""
    from jaxpar.plan.calibrate import profile
    from jaxpar.plan.search import search
    from jaxpar.plan.search_report import best_overrides
    from jaxpar.runtime.hardware import for_device_kind

    name = "cpu" if devices[0].platform == "cpu" else for_device_kind(devices[0].device_kind)
    if name is None:
        raise ConfigError(f"an elastic run needs a new layout on {len(devices)} devices, but no hardware profile "
                          f"matches {devices[0].device_kind!r} for the planner to choose one.")
    result = search(cfg, devices, profile(name, _local(devices)), budget, held_settings(cfg), progress=False,
                    processes=1, top=1)
    return best_overrides(result), result.ranked[0].name


def _decide(cfg: Config, devices: list, rows: float | None, before: int | None) -> tuple[dict, str]:
    """(overrides, why) for `devices`: the config's mesh keeping `rows` rows per device, else the planner's."""
    n, processes = len(devices), len({d.process_index for d in devices})
    budget = memory_budget(devices)
    kept = keep_rows(cfg, n, rows) if rows is not None else None
    reason = f"does not lay out on {n} devices"
    if kept is not None:
        try:
            validate(cfg.replace(**kept), n, processes)
            if before == n or _fits(cfg.replace(**kept), devices, budget):
                return kept, f"the config's mesh, the global batch of {cfg.train.batch_size} at {rows:g} rows a device"
            reason = f"does not fit {budget / 1e9:.3g} GB per device"
        except ConfigError as e:
            reason = f"cannot be kept ({str(e).rstrip('.')})"
    mesh = " ".join(f"mesh.{axis}={size}" for axis, size in cfg.to_dict()["mesh"].items()
                    if axis != "hosts" and size != 1)
    try:
        best, name = _planned(cfg, devices, budget)
    except UserError as e:  # nothing fits: a user's problem, said before anything is compiled for good
        raise ConfigError(str(e)) from None
    return best, f"{mesh} {reason}, so the planner's best layout that fits: {name}"


def replan(cfg: Config, devices: list) -> Config:
    """`cfg` laid out for `devices` as the module docstring says (process 0 deciding for all), said in one
    line when it changes anything. Raises ConfigError when the global batch cannot be kept."""
    record = read_record(cfg.run.dir)
    if record is None:
        try:
            resolve_mesh(cfg.mesh, len(devices))
            return cfg  # the first start, on a mesh that lays out: as configured (the loop records its rows)
        except ConfigError:
            record = (None, None)
    overrides, why = _decide(cfg, devices, *record)
    overrides, why = json.loads(distributed.share(json.dumps([overrides, why]))[0])
    flat = flatten_dict(cfg.to_dict())
    changed = {k: v for k, v in overrides.items() if flat.get(k) != v}
    if changed and not distributed.is_secondary():
        print(f"jaxpar: elastic: on {len(devices)} devices, {' '.join(f'{k}={v}' for k, v in changed.items())} "
              f"({why}).", file=sys.stderr)
    return cfg.replace(**overrides)
