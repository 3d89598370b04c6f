"""Restoring a run from its in-memory copy (checkpoint.local_every) against its shared checkpoint.

Usage:
    python benchmarks/restore.py [CONFIG.yaml] [key=value ...] [--rounds R]

Model: jaxpar's defaults, then the config and overrides (run.dir is a temporary folder). One state
is initialized, saved once as an Orbax checkpoint under <run.dir>/checkpoints and once as the
in-memory copy (/dev/shm), and then restored from each in turn, alternately, R times (default 5):
what a restart does before its first step (`jaxpar.train.saves.resume`: the in-memory copy when it
is there, else `Checkpoints.restore_latest`), each restore waited for. The checkpoint is on this
machine's disk, and after the first round the operating system's page cache holds its files, so
the shared side is a lower bound of what a shared filesystem costs.
Printed: a markdown table (median seconds of each restore and of each save's blocking part, the
bytes per process), then one JSON line with every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

from common import load_settings, markdown


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="*", help="an optional CONFIG.yaml, then key=value overrides")
    parser.add_argument("--rounds", type=int, default=5, help="restores from each side (default %(default)s)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    run_dir = tempfile.mkdtemp(prefix="jaxpar-restore-")
    cfg = load_settings([*args.settings, f"run.dir={run_dir}"])
    from jaxpar.train.run_session import prepare

    session = prepare(cfg)
    import jax

    from jaxpar.train.checkpoint import Checkpoints, state_spec
    from jaxpar.train.local_copy import LocalCopies
    from jaxpar.train.trainer import Trainer

    trainer = Trainer(session)
    state = trainer.init()
    jax.block_until_ready(state)
    checkpoints, local = Checkpoints(f"{run_dir}/checkpoints", keep=1), LocalCopies(run_dir, every=1)
    saved = {"checkpoint": timed(lambda: checkpoints.save(1, state, trainer)),
             "memory": timed(lambda: local.save(1, state, {"step": 1, "seed": cfg.train.seed, "config": cfg.to_dict(),
                                                           "spec": state_spec(state)}))}
    checkpoints.wait()
    restores = {"checkpoint": [], "memory": []}
    try:
        for round_ in range(args.rounds):
            print(f"restore: round {round_ + 1} of {args.rounds}", file=sys.stderr)
            restores["checkpoint"].append(timed(lambda: jax.block_until_ready(
                checkpoints.restore_latest(trainer, warn=print).state)))
            restores["memory"].append(timed(lambda: jax.block_until_ready(
                local.restore(trainer, 1, run_dir).state)))
    finally:
        checkpoints.close()
        local.remove()
    median = {side: statistics.median(times) for side, times in restores.items()}
    state_bytes = sum(shard.data.nbytes for leaf in jax.tree.leaves(state) for shard in leaf.addressable_shards)
    print(markdown(["restored from", "median restore s", "save's blocking part s", "device bytes on this process"], [
        [side, f"{median[side]:.3f}", f"{saved[side]:.3f}", f"{state_bytes:,}"] for side in ("checkpoint", "memory")]))
    print(json.dumps({"layout": session.layout_name(), "rounds": args.rounds, "restore_s": restores,
                      "median_restore_s": median, "save_blocking_s": saved, "speedup": median["checkpoint"] /
                      median["memory"], "bytes": state_bytes}))
    return 0


def timed(work) -> float:
    began = time.perf_counter()
    work()
    return time.perf_counter() - began


if __name__ == "__main__":
    sys.exit(main())
