"""The packing plan of many documents (data.packing=pack): seconds and peak memory to plan them, to plan
and keep the plan in a token folder (a first run), and to read it back (every later run).

Usage:
    taskset -c 0 python benchmarks/pack_plan.py [--documents N] [--width W] [--seed S] [--pairs]

Lengths: N documents (default 10,000,000) drawn from a lognormal of mean 1000 tokens (sigma 1.2: about
4% are longer than a row of the default width 4097 and are cut into pieces), at least 1 token each;
--pairs plans them as preference pairs (documents 2k and 2k + 1 one unit). Each phase runs in a
process of its own, so its peak RSS (resource.getrusage: the interpreter, jax and the lengths
included) is its own, and the seconds are those of the call alone (the lengths drawn before):
plan (jaxpar.data.pack_plan.pack_plan), first run (cached_pack_plan in an empty folder: plan, then
write), second run (cached_pack_plan reading what the first wrote). Run it pinned to one core
(`taskset -c 0`): the acceptance is at most 30 s and 1 GB for a first run of 10 million documents.
Printed: the machine's line, a markdown table, then one JSON line with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import git_commit, markdown

PHASES = ("plan", "first run", "second run")


def lengths_of(count: int, seed: int):
    """`count` document lengths, lognormal with mean 1000 tokens, at least 1."""
    import numpy as np

    rng = np.random.default_rng(seed)
    sigma = 1.2
    return np.maximum(1, np.ceil(rng.lognormal(np.log(1000) - sigma ** 2 / 2, sigma, count))).astype(np.int64)


def run_phase(args) -> dict:
    """One phase, timed in this process: seconds, peak RSS, and what the plan holds."""
    from jaxpar.data.pack_plan import cached_pack_plan, pack_plan

    lengths = lengths_of(args.documents, args.seed)
    start = time.perf_counter()
    if args.phase == "plan":
        plan = pack_plan(lengths, args.width, args.seed, args.pairs)
    else:
        plan = cached_pack_plan(lengths, args.width, args.seed, args.pairs, Path(args.folder))
    seconds = time.perf_counter() - start
    used = int(plan.piece_length.sum())
    return {"phase": args.phase, "seconds": seconds, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            / 1024, "rows": len(plan), "pieces": len(plan.piece_doc), "efficiency": used / (len(plan) * args.width),
            "kept_mb": sum(p.stat().st_size for p in Path(args.folder).glob("pack-plan-*")) / 2 ** 20}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=10_000_000, help="documents (default %(default)s)")
    parser.add_argument("--width", type=int, default=4097, help="row width, model.seq_len + 1 (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="lengths' and shuffle's seed (default %(default)s)")
    parser.add_argument("--pairs", action="store_true", help="plan the documents as preference pairs")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # a child process's one phase
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(run_phase(args)))
        return 0
    import jax
    from common import machine_line, machine_record

    record = machine_record(jax.devices("cpu"), ("float32",))
    cores = len(os.sched_getaffinity(0))
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for phase in PHASES:
            command = [sys.executable, __file__, "--phase", phase, "--folder", folder, "--documents",
                       str(args.documents), "--width", str(args.width), "--seed", str(args.seed)]
            done = subprocess.run(command + (["--pairs"] if args.pairs else []), capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"pack_plan: the {phase} phase failed:\n{done.stderr[-3000:]}")
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"{phase}: {results[-1]['seconds']:.2f} s, {results[-1]['peak_rss_mb']:.0f} MB", file=sys.stderr)
    print(f"{machine_line(record)}; {cores} core(s) allowed; commit {git_commit()}; jax {jax.__version__}\n")
    print(f"{args.documents:,} {'documents as pairs' if args.pairs else 'documents'} (lognormal, mean 1000 tokens), "
          f"rows of {args.width} tokens, seed {args.seed}\n")
    print(markdown(["phase", "seconds", "peak RSS (MB)", "rows", "pieces", "efficiency", "kept in the folder (MB)"],
                   [[r["phase"], f"{r['seconds']:.2f}", f"{r['peak_rss_mb']:.0f}", f"{r['rows']:,}",
                     f"{r['pieces']:,}", f"{r['efficiency']:.4f}", f"{r['kept_mb']:.0f}"] for r in results]))
    print(json.dumps({"benchmark": "pack_plan", "commit": git_commit(), "machine": record, "cores": cores,
                      "documents": args.documents, "width": args.width, "seed": args.seed, "pairs": args.pairs,
                      "phases": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
