"""What one layout's compiled step measures (`measure_step`), kept on disk so that a repeated
search, or a benchmark after a search, compiles nothing it compiled before.

An entry is keyed by everything its program depends on: the config (less the run section,
which names folders and devices), the devices (count, platform, kind and processes: a GPU target's
programs are XLA:GPU's), the jax and jaxlib versions, and the
source of the jaxpar package less the modules that only read entries (CONSUMERS), so a change
to the code that builds or measures a program makes the old entries unused.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from jaxpar.config import Config
from jaxpar.runtime.machine import cache_dir, store_json

PACKAGE = Path(__file__).resolve().parent.parent
CONSUMERS = {"cli.py", "runtime/hardware.py", "runtime/launch.py", "plan/search.py", "plan/search_report.py",
             "plan/roofline.py", "plan/calibrate.py", "plan/schedule_chart.py"}


@functools.cache
def _source_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() in CONSUMERS:
            continue
        digest.update(str(path.relative_to(PACKAGE)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def entry_path(cfg, n_devices: int, kind: tuple = ()) -> Path:
    """The cache file of `cfg` compiled for `n_devices` devices of `kind` (platform, device kind, processes:
    XLA:CPU's emulated devices and a GPU target's compile different programs)."""
    import jax
    import jaxlib

    program = {k: v for k, v in cfg.to_dict().items() if k != "run"}
    key = json.dumps([program, n_devices, *kind, jax.__version__, jaxlib.__version__, _source_digest()],
                     sort_keys=True)
    return cache_dir() / "plans" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def load(path: Path) -> dict | None:
    """A cached entry, or None when there is none (or it cannot be read: then it is compiled anew)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def measure(layout: Config, devices: list, budget: float) -> tuple[dict, bool]:
    """(the cache entry of `layout`, whether it came from the cache); compiles unless cached. An
    entry whose state alone exceeds `budget` holds only the state's bytes."""
    kind = (devices[0].platform, devices[0].device_kind, len({d.process_index for d in devices}))
    path = entry_path(layout, len(devices), kind)
    entry = load(path)
    if entry is not None and (not entry.get("state_only") or entry["bytes_per_device"] > budget):
        return entry, True

    from jaxpar.plan.memory import measure_step, shard_bytes
    from jaxpar.session import on_devices
    from jaxpar.train.trainer import Trainer

    trainer = Trainer(on_devices(layout, devices))
    state = trainer.abstract_state()
    state_bytes = (shard_bytes(state.params, trainer.state_shardings.params)
                   + shard_bytes(state.opt_state, trainer.state_shardings.opt_state))
    if state_bytes > budget:
        entry = {"state_only": True, "bytes_per_device": state_bytes}
    else:
        plan = measure_step(trainer)
        table = trainer.pipeline.table
        entry = {"state_only": False, "bytes_per_device": plan["argument_bytes"] + plan["temp_bytes"],
                 "idle_fraction": table.idle_fraction if table is not None else 0.0,
                 # what the roofline reads
                 "plan": {k: plan[k] for k in ("executed_flops_per_stage", "written_bytes_per_stage",
                                               "collective_ops")}}
    store_json(path, entry)
    return entry, False
