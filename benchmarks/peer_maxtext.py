"""Side-by-side training throughput of jaxpar and MaxText 0.2.5 on 8 emulated CPU devices.

Usage:
    python benchmarks/peer_maxtext.py [--rounds 3] [--layouts fsdp8,fsdp4_tp2,data8,fsdp4_pp2,tp8]
        [--steps 20] [--skip 5] [--cache-dir DIR] [--out benchmarks/results/peer_maxtext.png]
        [--python PATH] [--jaxpar-python PATH] [--timeout 1800] [--keep] [--setup-only]

On first use it creates a virtual environment in --cache-dir (default
~/.cache/jaxpar/maxtext-0.2.5) and pip-installs `maxtext[tpu]==0.2.5` into it from the package
index, showing pip's output (about 10 minutes and 2.8 GB, so it is not part of the test suite); a
stamp file there makes later runs reuse it. The interpreter is --python, else a Python 3.12 that
runs (this one, PATH, pyenv's versions), else this one or any newer one found.

Measured: for each layout and round, `jaxpar train` and MaxText's
`python -m maxtext.trainers.pre_train.train` run one after the other (the order flips every round)
as subprocesses with XLA_FLAGS=--xla_force_host_platform_device_count=8 and JAX_PLATFORMS=cpu, on
the same model shape, bf16 compute, full remat, global batch and mesh. Each trains --steps steps;
the first --skip are dropped (compilation, warm-up) and the median of the remaining per-step
times gives tokens/s = global batch * seq / seconds. jaxpar's per-step time is `step_time_s` in
<run.dir>/metrics.jsonl (time between the completions of successive steps); MaxText's is the
`seconds:` of its `completed step: N, seconds: S, ...` log lines (time between successive loop
iterations, which wait on the previous step's metrics; MaxText compiles before step 0, and its
steps 0 and 1 are dispatch only, hence --skip of at least 2). The table reports, per layout,
the median over rounds of those per-round medians and their ratio; a bar chart goes to --out and
one JSON line with everything ends the output.

The shape: vocab 32000, d_model 256, 4 heads of 64 (8 heads of 32 for tensor 8, which cannot split
4 heads), 4 layers, seq 256, global batch 8 (MaxText's per_device_batch_size 1), untied output
head (MaxText's default), RoPE. jaxpar's GeLU MLP with d_ff 1536 does the FLOPs of MaxText's
SwiGLU with mlp_dim 1024 (two matmuls of 1536 against three of 1024).
jaxpar reads its byte-level built-in corpus (bytes fit the 32000 vocab); MaxText uses synthetic
data. After its steps jaxpar evaluates one batch and writes no text sample (train.sample_tokens=0),
which keeps each run short; neither is timed. The CPU is shared and noisy: only the side-by-side ratios mean anything.

This script runs the rounds and reports them; peer_sides.py holds the two sides (the shape and
layouts, MaxText's environment, each side's command line, reading each run's step times).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import RESULTS, pyplot, save_figure
from peer_sides import (
    BATCH,
    D_MODEL,
    DEFAULT_CACHE,
    DEVICES,
    HEADS,
    JAXPAR_D_FF,
    LAYERS,
    LAYOUTS,
    MAXTEXT_MLP_DIM,
    MAXTEXT_REQUIREMENT,
    REPO,
    SEQ,
    VOCAB,
    BenchFailed,
    Layout,
    ensure_maxtext,
    maxtext_base_yml,
    run_jaxpar,
    run_maxtext,
    say,
)

DEFAULT_OUT = RESULTS / "peer_maxtext.png"


# ---------------------------------------------------------------- rounds, table, chart

@dataclass
class Result:
    """Per-round tokens/s of both sides on one layout, and the failures."""

    layout: Layout
    jaxpar: list[float] = field(default_factory=list)
    maxtext: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def median(self, side: str) -> float | None:
        values = getattr(self, side)
        return statistics.median(values) if values else None

    def ratio(self) -> float | None:
        ours, theirs = self.median("jaxpar"), self.median("maxtext")
        return ours / theirs if ours and theirs else None


def run_rounds(args, layouts: list[Layout], maxtext_python: Path, base_yml: Path, scratch: Path) -> list[Result]:
    """Each round runs every layout on both sides, alternating which side goes first."""
    results = [Result(layout) for layout in layouts]
    for round_index in range(args.rounds):
        for result in results:
            sides = ["jaxpar", "maxtext"] if round_index % 2 == 0 else ["maxtext", "jaxpar"]
            for side in sides:
                work = scratch / f"r{round_index + 1}-{result.layout.name}-{side}"
                work.mkdir(parents=True)
                _run_side(args, side, result, round_index, maxtext_python, base_yml, work)
    return results


def _run_side(args, side: str, result: Result, round_index: int, maxtext_python: Path, base_yml: Path,
              work: Path) -> None:
    """One side, one layout, one round: append its tokens/s, or record and print its failure."""
    side_name = "jaxpar" if side == "jaxpar" else "MaxText"
    label = f"round {round_index + 1}/{args.rounds} {result.layout.name} {side_name}"
    started = time.perf_counter()
    try:
        if side == "jaxpar":
            value = run_jaxpar(args.jaxpar_python, result.layout, args.steps, args.skip, work, args.timeout)
        else:
            value = run_maxtext(maxtext_python, base_yml, result.layout, args.steps, args.skip, work, args.timeout)
    except BenchFailed as e:
        result.failures.append(f"{label}: {e}")
        say(f"peer_maxtext: FAILED {label}: {e}")
        return
    getattr(result, side).append(value)
    say(f"peer_maxtext: {label}: {value:.0f} tokens/s ({time.perf_counter() - started:.0f} s wall)")


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(results: list[Result], commit: str) -> str:
    lines = [f"jaxpar {commit} vs MaxText 0.2.5, {DEVICES} emulated CPU devices, tokens/s (median over rounds)",
             "",
             "| layout | jaxpar tok/s | MaxText tok/s | jaxpar / MaxText | jaxpar per round | MaxText per round |",
             "| --- | ---: | ---: | ---: | --- | --- |"]
    for r in results:
        lines.append(f"| {r.layout.title} | {_fmt(r.median('jaxpar'))} | {_fmt(r.median('maxtext'))} | "
                     f"{_fmt(r.ratio(), 2)} | {', '.join(f'{v:.0f}' for v in r.jaxpar) or '-'} | "
                     f"{', '.join(f'{v:.0f}' for v in r.maxtext) or '-'} |")
    return "\n".join(lines)


def bar_chart(results: list[Result], commit: str, out: Path) -> None:
    """Grouped bars of the median tokens/s per layout, jaxpar beside MaxText."""
    fig, ax = pyplot().subplots(figsize=(max(6.0, 1.8 * len(results) + 2), 4.5))
    width = 0.38
    for offset, side, name in ((-width / 2, "jaxpar", f"jaxpar {commit}"), (width / 2, "maxtext", "MaxText 0.2.5")):
        ax.bar([i + offset for i in range(len(results))], [r.median(side) or 0 for r in results], width, label=name)
    for i, r in enumerate(results):
        if r.ratio() is not None:
            top = max(r.median("jaxpar"), r.median("maxtext"))
            ax.annotate(f"{r.ratio():.2f}x", (i, top), ha="center", va="bottom", fontsize=9)
        for offset, side in ((-width / 2, "jaxpar"), (width / 2, "maxtext")):
            if r.median(side) is None:
                ax.annotate("failed", (i + offset, 0), ha="center", va="bottom", fontsize=8, rotation=90)
    ax.set_xticks(range(len(results)), [r.layout.title.replace(" (", "\n(") for r in results], fontsize=8)
    ax.set_ylim(0, 1.25 * max([r.median(side) or 0 for r in results for side in ("jaxpar", "maxtext")] + [1]))
    ax.set_ylabel("tokens/s (median over rounds)")
    ax.set_title(f"Training throughput, {DEVICES} emulated CPU devices\n"
                 f"bf16, full remat, batch {BATCH} x {SEQ}; labels: jaxpar / MaxText", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    save_figure(fig, out, dpi=120)


def git_commit() -> str:
    """The short commit of this checkout, with +dirty when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def summary(args, results: list[Result], commit: str, failures: list[str]) -> dict:
    """Everything measured, with the settings that produced it, for the final JSON line."""
    return {
        "benchmark": "peer_maxtext", "commit": commit, "maxtext": MAXTEXT_REQUIREMENT, "devices": DEVICES,
        "shape": {"vocab": VOCAB, "d_model": D_MODEL, "heads": HEADS, "head_dim": D_MODEL // HEADS,
                  "layers": LAYERS, "seq": SEQ, "global_batch": BATCH, "jaxpar_d_ff_gelu": JAXPAR_D_FF,
                  "maxtext_mlp_dim_swiglu": MAXTEXT_MLP_DIM, "precision": "bf16", "remat": "full"},
        "rounds": args.rounds, "steps": args.steps, "skip": args.skip,
        "layouts": {r.layout.name: {"jaxpar": r.jaxpar, "maxtext": r.maxtext,
                                    "jaxpar_median": r.median("jaxpar"), "maxtext_median": r.median("maxtext"),
                                    "ratio": r.ratio(), "heads": r.layout.heads,
                                    "jaxpar_settings": r.layout.jaxpar, "maxtext_settings": r.layout.maxtext}
                    for r in results},
        "failures": failures,
    }


# ---------------------------------------------------------------- command line

def default_jaxpar_python() -> str:
    """The repository's .venv interpreter when there is one, else this one."""
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.is_file() else sys.executable


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="times each layout runs on each side (default 3)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"comma-separated subset of {','.join(LAYOUTS)} (default all)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")
    parser.add_argument("--skip", type=int, default=5,
                        help="first steps left out of the median (default 5; keep it at 2 or more: MaxText's "
                             "first two step times are dispatch only, before its loop first waits on the device)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                        help=f"where MaxText's virtual environment lives (default {DEFAULT_CACHE})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"bar chart PNG (default {DEFAULT_OUT})")
    parser.add_argument("--python", help="Python 3.12+ interpreter for MaxText's environment (first use only)")
    parser.add_argument("--jaxpar-python", default=default_jaxpar_python(),
                        help="interpreter that runs `-m jaxpar` (default: the repository's .venv, else this one)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one training run may take (default 1800)")
    parser.add_argument("--keep", action="store_true", help="keep the run folders and logs even when all runs succeed")
    parser.add_argument("--setup-only", action="store_true", help="only create (or check) MaxText's environment")
    args = parser.parse_args(argv)
    args.layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown or not args.layouts:
        parser.error(f"--layouts takes names from {','.join(LAYOUTS)}; got {','.join(unknown) or 'none'}")
    if args.rounds < 1 or args.steps < 1 or not 0 <= args.skip < args.steps:
        parser.error("--rounds and --steps must be at least 1, and --skip between 0 and --steps - 1")
    if args.skip < 2:
        say("peer_maxtext: warning: with --skip below 2, MaxText's first step times (dispatch only, taken before "
             "its loop waits on the device) enter the median and flatter it.")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cache = args.cache_dir.expanduser().resolve()
    maxtext_python = ensure_maxtext(cache, args.python)
    base_yml = maxtext_base_yml(cache)
    if args.setup_only:
        say(f"peer_maxtext: MaxText is ready in {cache / 'venv'} (config {base_yml})")
        return 0
    commit = git_commit()
    scratch = Path(tempfile.mkdtemp(prefix="peer_maxtext_"))
    say(f"peer_maxtext: jaxpar {commit} ({args.jaxpar_python}) vs {MAXTEXT_REQUIREMENT}, layouts "
         f"{','.join(args.layouts)}, {args.rounds} round(s) of {args.steps} steps (first {args.skip} dropped); "
         f"runs in {scratch}")
    results = run_rounds(args, [LAYOUTS[name] for name in args.layouts], maxtext_python, base_yml, scratch)
    failures = [line for r in results for line in r.failures]
    print(markdown_table(results, commit))
    for line in failures:
        print(f"FAILED {line}")
    try:
        bar_chart(results, commit, args.out)
        say(f"peer_maxtext: chart written to {args.out}")
    except ImportError as e:
        say(f"peer_maxtext: no chart: matplotlib is not importable here ({e}).")
    if failures or args.keep:
        say(f"peer_maxtext: run folders and logs kept in {scratch}")
    else:
        shutil.rmtree(scratch)
    print(json.dumps(summary(args, results, commit, failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
