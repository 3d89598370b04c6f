"""Random layouts over the whole switch space, as tests/test_verify_sweep.py draws them: how many verify, how
many are refused (and each refusal's sentence), and any that fail.

    python benchmarks/verify_sweep.py --draws 100 --results sweep.jsonl > sweep.md

Prints a markdown summary (commit, date, CPU) with a row per draw, flushed as each finishes; --results also
writes each draw's whole verify result (every check's worst error, against which tolerances are measured) as a
JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=100, help="draws 0..N-1 (default %(default)s)")
    parser.add_argument("--first", type=int, default=0, help="the first draw's index (default %(default)s)")
    parser.add_argument("--results", type=Path, help="a JSON-lines file for each draw's whole result")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                               " --xla_backend_optimization_level=0").strip()  # the tests' level
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, str(TESTS))
    import test_verify_sweep as sweep
    from common import git_commit

    from jaxpar.config.presets import load_config
    from jaxpar.train.run_session import prepare
    from jaxpar.verify.run import verify

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    bf16 = "native bf16" if "avx512_bf16" in Path("/proc/cpuinfo").read_text() else "no native bf16"
    print(f"verify sweep at {git_commit()}, {datetime.date.today()}, {cpu} ({bf16}), draws {args.first}.."
          f"{args.first + args.draws - 1}\n")
    print("| draw | verdict | precision | seconds | layout or refusal |\n| --- | --- | --- | --- | --- |", flush=True)
    root = Path(tempfile.mkdtemp(prefix="jaxpar-sweep-"))
    folders = sweep.data_folders(root)
    counts = {"verified": 0, "refused": 0, "failed": 0}
    for index in range(args.first, args.first + args.draws):
        overrides = sweep.settle(sweep.draw(index), folders)
        precision = next(item.split("=")[1] for item in overrides if item.startswith("train.precision="))
        start = time.perf_counter()
        sentence = sweep.refusal(overrides, root / "run")
        if sentence is not None:
            counts["refused"] += 1
            print(f"| {index} | refused | {precision} | 0 | {sentence} |", flush=True)
            continue
        result = verify(prepare(load_config(None, [f"run.dir={root / 'run'}", *overrides])), log=lambda line: None)
        if args.results:
            with args.results.open("a") as out:
                out.write(json.dumps({"draw": index, "precision": precision, "overrides": overrides, **result},
                                     default=float) + "\n")
        verdict = "verified" if result["ok"] else "FAILED"
        counts["verified" if result["ok"] else "failed"] += 1
        detail = result["layout"] + ("" if result["ok"] else f"; {result.get('failures', [])[:2]}")
        print(f"| {index} | {verdict} | {precision} | {time.perf_counter() - start:.0f} | {detail} |", flush=True)
    print(f"\n{counts['verified']} verified, {counts['refused']} refused, {counts['failed']} failed")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
