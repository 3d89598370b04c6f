"""Elastic runs before jax starts: the rows each device takes, kept across device counts, and the checks
of `jaxpar launch`'s restart flags. Pure Python (no jax), so the launcher can check before anything starts.

A run's global batch (train.batch_size) never changes. What a device holds of it at once is its rows
per microbatch, batch / (data x expert x microbatches), microbatches being train.grad_accum (or
parallel.pipeline.microbatches with stages). An elastic run keeps that number when its device count
changes: 16 rows on data=8 are 2 rows a device; on 4 devices, data=4 with grad_accum=2 keeps 2. The
first elastic start records it in <run.dir>/elastic.json; every later start reads it.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

from jaxpar.config import Config, ConfigError
from jaxpar.config.mesh import resolve_mesh
from jaxpar.features.validation import validate

RECORD = "elastic.json"
GRAD_ACCUMS = (1, 2, 4, 8, 16)  # what a re-planned layout may accumulate over, when the config's mesh cannot be kept


def microbatch_key(sizes: dict[str, int]) -> str:
    """The key that splits each step's batch into microbatches on this mesh."""
    return "parallel.pipeline.microbatches" if sizes["stage"] > 1 else "train.grad_accum"


def rows_per_device(cfg: Config, sizes: dict[str, int]) -> float:
    """Rows of the global batch each device holds per microbatch on a mesh of `sizes`."""
    microbatches = cfg.parallel.pipeline.microbatches if sizes["stage"] > 1 else cfg.train.grad_accum
    return cfg.train.batch_size / (sizes["data"] * sizes["expert"] * microbatches)


def read_record(run_dir: str | Path) -> tuple[float, int] | None:
    """(rows per device, devices) as the run's first elastic start recorded them, or None."""
    try:
        record = json.loads((Path(run_dir) / RECORD).read_text())
        return float(record["rows_per_device"]), int(record["devices"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def record_rows(run_dir: str | Path, cfg: Config, sizes: dict[str, int]) -> None:
    """Record this layout's rows per device, unless the run has a record already (the first start's stands)."""
    path = Path(run_dir) / RECORD
    if not path.exists():
        devices = math.prod(sizes.values())
        path.write_text(json.dumps({"rows_per_device": rows_per_device(cfg, sizes), "devices": devices}) + "\n")


def keep_rows(cfg: Config, n_devices: int, rows: float) -> dict | None:
    """The overrides that run the config's own mesh on `n_devices` with `rows` rows per device (the
    microbatch count raised or lowered to match), or None when the config's mesh does not lay out on
    them. Raises ConfigError when it does but the global batch cannot be cut into such rows."""
    try:
        sizes = resolve_mesh(cfg.mesh, n_devices)
    except ConfigError:
        return None
    ways = sizes["data"] * sizes["expert"]
    microbatches = cfg.train.batch_size / (ways * rows)
    if microbatches < 1 or microbatches != int(microbatches):
        layout = " x ".join(f"{axis}={sizes[axis]}" for axis in ("data", "expert") if sizes[axis] > 1) or "1 device"
        raise ConfigError(f"an elastic run cannot keep train.batch_size={cfg.train.batch_size} on {n_devices} devices: "
                          f"its {rows:g} rows per device do not divide it over {layout}; choose a batch size they "
                          f"divide on every device count the run may have.")
    return {microbatch_key(sizes): int(microbatches)}


def _some_layout(cfg: Config, n: int, processes: int) -> bool:
    """Whether any mesh of n devices (with some accumulation) passes validation: what the planner needs."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    for tensor, expert, stage, accum in itertools.product(divisors, divisors, divisors, GRAD_ACCUMS):
        if n % (tensor * expert * stage) == 0:
            mesh = {"mesh.data": n // (tensor * expert * stage), "mesh.tensor": tensor, "mesh.expert": expert,
                    "mesh.stage": stage, "train.grad_accum": 1 if stage > 1 else accum}
            try:
                validate(cfg.replace(**mesh), n, processes)
                return True
            except ConfigError:
                continue
    return False


def check_shrinkable(cfg: Config, processes: int, devices_per_process: int, fewest: int) -> None:
    """Raise ConfigError unless the run can go on, with its global batch, on every count of processes from
    `fewest` up (`jaxpar launch --elastic --min-processes`)."""
    try:
        rows = rows_per_device(cfg, resolve_mesh(cfg.mesh, processes * devices_per_process))
    except ConfigError:
        return  # the run itself says what is wrong with its mesh
    for count in range(fewest, processes):
        n = count * devices_per_process
        if keep_rows(cfg, n, rows) is None and not _some_layout(cfg, n, count):
            raise ConfigError(f"an elastic run cannot go on with train.batch_size={cfg.train.batch_size} on the {n} "
                              f"devices of {count} processes: no layout of them passes validation; raise "
                              f"--min-processes.")


def check_restart_flags(restarts: int, elastic: bool, fewest: int | None, regrow_after: float | None,
                        health_check: str | None, backoff: float, processes: int, devices_per_process: int | None,
                        command: list[str], cfg: Config | None) -> None:
    """The restart flags of `jaxpar launch`, with the config of a `train` command (`cfg`, else None)."""
    if restarts < 0 or backoff < 0:
        raise ConfigError("--restarts and --backoff must be 0 or more.")
    shrinking = {"--min-processes": fewest is not None, "--regrow-after": regrow_after is not None,
                 "--health-check": health_check is not None}
    named = " and ".join(flag for flag, given in shrinking.items() if given)
    if named and not elastic:
        leave, take = ("leave", "take") if " and " in named else ("leaves", "takes")
        raise ConfigError(f"{named} {leave} processes out of a run and {take} them back; add --elastic.")
    if (elastic or restarts) and cfg is None:
        raise ConfigError("--restarts and --elastic restart training runs; give them a train command after '--'.")
    if elastic and not restarts:
        raise ConfigError("--elastic leaves out processes when the launcher restarts the run; give --restarts N too.")
    if restarts and cfg.checkpoint.every <= 0:
        raise ConfigError(f"--restarts {restarts} goes on from the last checkpoint, but checkpoint.every="
                          f"{cfg.checkpoint.every} writes none; set checkpoint.every=N (saves are asynchronous, so a "
                          f"small N costs little).")
    if fewest is not None and not 1 <= fewest <= processes:
        raise ConfigError(f"--min-processes must be between 1 and --processes={processes}, got {fewest}.")
    if regrow_after is not None and not regrow_after > 0:
        raise ConfigError(f"--regrow-after must be positive, got {regrow_after:g}.")
    if elastic:
        if devices_per_process is None:
            raise ConfigError("--elastic needs --devices-per-process, to know the devices that are left when a "
                              "process is left out.")
        check_shrinkable(cfg, processes, devices_per_process, fewest or 1)
