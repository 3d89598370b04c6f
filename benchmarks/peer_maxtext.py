"""Side-by-side training throughput of jaxpar and MaxText 0.2.5 on 8 emulated CPU devices.

Usage:
    python benchmarks/peer_maxtext.py [--rounds 3] [--layouts fsdp8,fsdp4_tp2,data8,fsdp4_pp2,tp8]
        [--precisions bf16] [--steps 20] [--skip 5] [--cache-dir DIR] [--out benchmarks/results/peer_maxtext.png]
        [--python PATH] [--jaxpar-python PATH] [--timeout 1800] [--keep] [--setup-only]

On first use it creates a virtual environment in --cache-dir (default
~/.cache/jaxpar/maxtext-0.2.5) and pip-installs `maxtext[tpu]==0.2.5` into it from the package
index, showing pip's output (about 10 minutes and 2.8 GB, so it is not part of the test suite); a
stamp file there makes later runs reuse it. The interpreter is --python, else a Python 3.12 that
runs (this one, PATH, pyenv's versions), else this one or any newer one found.

Measured: for each layout and round, `jaxpar train` and MaxText's
`python -m maxtext.trainers.pre_train.train` run one after the other (the order flips every round)
as subprocesses with XLA_FLAGS=--xla_force_host_platform_device_count=8 and JAX_PLATFORMS=cpu, on
the same model shape, compute dtype (--precisions: bf16, or fp32,bf16 for both and their ratio),
full remat, global batch and mesh. Each trains --steps steps;
the first --skip are dropped (compilation, warm-up) and the median of the remaining per-step
times gives tokens/s = global batch * seq / seconds. jaxpar's per-step time is `step_time_s` in
<run.dir>/metrics.jsonl (time between the completions of successive steps); MaxText's is the
`seconds:` of its `completed step: N, seconds: S, ...` log lines (time between successive loop
iterations, which wait on the previous step's metrics; MaxText compiles before step 0, and its
steps 0 and 1 are dispatch only, hence --skip of at least 2). The table reports, per layout,
the median over rounds of those per-round medians and their ratio, and each side's MFU: the model
FLOPs per token (jaxpar.train.model_flops, the same for both sides) x tokens/s over the machine's
2048^3 matmul rate in that dtype, measured at the start by jaxpar's interpreter (jaxpar.runtime.machine,
whose line heads the table, with the processor and whether it has native bf16). With two
precisions a second table gives each side's bf16 / fp32 ratio. A bar chart goes to --out and
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
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import RESULTS, git_commit, pyplot, save_figure
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
    PRECISIONS,
    REPO,
    SEQ,
    VOCAB,
    BenchFailed,
    Layout,
    ensure_maxtext,
    jaxpar_facts,
    maxtext_base_yml,
    run_jaxpar,
    run_maxtext,
    say,
)

DEFAULT_OUT = RESULTS / "peer_maxtext.png"


# ---------------------------------------------------------------- rounds, table, chart

@dataclass
class Result:
    """Per-round tokens/s of both sides on one layout in one precision, and the failures."""

    layout: Layout
    precision: str = "bf16"
    jaxpar: list[float] = field(default_factory=list)
    maxtext: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.layout.name} {self.precision}"

    def median(self, side: str) -> float | None:
        values = getattr(self, side)
        return statistics.median(values) if values else None

    def ratio(self) -> float | None:
        ours, theirs = self.median("jaxpar"), self.median("maxtext")
        return ours / theirs if ours and theirs else None

    def mfu(self, side: str, facts: dict) -> float | None:
        """Model FLOPs per token x the side's median tokens/s over the measured matmul rate of the dtype."""
        tokens_per_s = self.median(side)
        rate = facts["machine"]["matmul_flops"].get(PRECISIONS[self.precision])
        return facts["flops_per_token"] * tokens_per_s / rate if tokens_per_s and rate else None


def run_rounds(args, results: list[Result], maxtext_python: Path, base_yml: Path, scratch: Path) -> list[Result]:
    """Each round runs every layout and precision on both sides, alternating which side goes first."""
    for round_index in range(args.rounds):
        for result in results:
            sides = ["jaxpar", "maxtext"] if round_index % 2 == 0 else ["maxtext", "jaxpar"]
            for side in sides:
                work = scratch / f"r{round_index + 1}-{result.layout.name}-{result.precision}-{side}"
                work.mkdir(parents=True)
                _run_side(args, side, result, round_index, maxtext_python, base_yml, work)
    return results


def _run_side(args, side: str, result: Result, round_index: int, maxtext_python: Path, base_yml: Path,
              work: Path) -> None:
    """One side, one layout, one round: append its tokens/s, or record and print its failure."""
    side_name = "jaxpar" if side == "jaxpar" else "MaxText"
    label = f"round {round_index + 1}/{args.rounds} {result.name} {side_name}"
    started = time.perf_counter()
    try:
        if side == "jaxpar":
            value = run_jaxpar(args.jaxpar_python, result.layout, args.steps, args.skip, work, args.timeout,
                               result.precision)
        else:
            value = run_maxtext(maxtext_python, base_yml, result.layout, args.steps, args.skip, work, args.timeout,
                                result.precision)
    except BenchFailed as e:
        result.failures.append(f"{label}: {e}")
        say(f"peer_maxtext: FAILED {label}: {e}")
        return
    getattr(result, side).append(value)
    say(f"peer_maxtext: {label}: {value:.0f} tokens/s ({time.perf_counter() - started:.0f} s wall)")


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def markdown_table(results: list[Result], commit: str, facts: dict) -> str:
    lines = [f"jaxpar {commit} vs MaxText 0.2.5, {DEVICES} emulated CPU devices, tokens/s (median over rounds)",
             f"machine: {facts['machine']['line']}; MFU: {facts['flops_per_token'] / 1e6:.1f} MFLOP per token "
             f"x tokens/s over the measured matmul rate of the run's dtype",
             "",
             "| layout | precision | jaxpar tok/s | MaxText tok/s | jaxpar / MaxText | jaxpar MFU | MaxText MFU "
             "| jaxpar per round | MaxText per round |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in results:
        lines.append(f"| {r.layout.title} | {r.precision} | {_fmt(r.median('jaxpar'))} | {_fmt(r.median('maxtext'))} | "
                     f"{_fmt(r.ratio(), 2)} | {_pct(r.mfu('jaxpar', facts))} | {_pct(r.mfu('maxtext', facts))} | "
                     f"{', '.join(f'{v:.0f}' for v in r.jaxpar) or '-'} | "
                     f"{', '.join(f'{v:.0f}' for v in r.maxtext) or '-'} |")
    return "\n".join(lines)


def precision_ratios(results: list[Result]) -> list[dict]:
    """Per layout run in both fp32 and bf16: each side's bf16 / fp32 tokens/s, and jaxpar's over MaxText's."""
    by = {(r.layout.name, r.precision): r for r in results}
    rows = []
    for r in results:
        fp32, bf16 = by.get((r.layout.name, "fp32")), by.get((r.layout.name, "bf16"))
        if r.precision != "bf16" or fp32 is None:
            continue
        gains = {side: (bf16.median(side) / fp32.median(side) if bf16.median(side) and fp32.median(side) else None)
                 for side in ("jaxpar", "maxtext")}
        rows.append({"layout": r.layout.name, "title": r.layout.title, "jaxpar": gains["jaxpar"],
                     "maxtext": gains["maxtext"], "jaxpar_over_maxtext": (gains["jaxpar"] / gains["maxtext"]
                                                                          if all(gains.values()) else None)})
    return rows


def ratio_table(rows: list[dict]) -> str:
    lines = ["bf16 / fp32 tokens/s of each side (medians over rounds)", "",
             "| layout | jaxpar bf16 / fp32 | MaxText bf16 / fp32 | jaxpar's gain / MaxText's |",
             "| --- | ---: | ---: | ---: |"]
    lines += [f"| {r['title']} | {_fmt(r['jaxpar'], 2)} | {_fmt(r['maxtext'], 2)} | "
              f"{_fmt(r['jaxpar_over_maxtext'], 2)} |" for r in rows]
    return "\n".join(lines)


def bar_chart(results: list[Result], commit: str, out: Path, machine: str) -> None:
    """Grouped bars of the median tokens/s per layout and precision, jaxpar beside MaxText."""
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
    ax.set_xticks(range(len(results)), [f"{r.layout.title} {r.precision}".replace(" (", "\n(") for r in results],
                  fontsize=8)
    ax.set_ylim(0, 1.25 * max([r.median(side) or 0 for r in results for side in ("jaxpar", "maxtext")] + [1]))
    ax.set_ylabel("tokens/s (median over rounds)")
    ax.set_title(f"Training throughput, {DEVICES} emulated CPU devices; {machine}\n"
                 f"full remat, batch {BATCH} x {SEQ}; labels: jaxpar / MaxText", fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    save_figure(fig, out, dpi=120)


def summary(args, results: list[Result], commit: str, failures: list[str], facts: dict) -> dict:
    """Everything measured, with the settings and the machine that produced it, for the final JSON line."""
    return {
        "benchmark": "peer_maxtext", "commit": commit, "maxtext": MAXTEXT_REQUIREMENT, "devices": DEVICES,
        "machine": facts["machine"], "model_flops_per_token": facts["flops_per_token"],
        "shape": {"vocab": VOCAB, "d_model": D_MODEL, "heads": HEADS, "head_dim": D_MODEL // HEADS,
                  "layers": LAYERS, "seq": SEQ, "global_batch": BATCH, "jaxpar_d_ff_gelu": JAXPAR_D_FF,
                  "maxtext_mlp_dim_swiglu": MAXTEXT_MLP_DIM, "remat": "full"},
        "rounds": args.rounds, "steps": args.steps, "skip": args.skip, "precisions": args.precisions,
        "layouts": {r.name: {"precision": r.precision, "jaxpar": r.jaxpar, "maxtext": r.maxtext,
                             "jaxpar_median": r.median("jaxpar"), "maxtext_median": r.median("maxtext"),
                             "ratio": r.ratio(), "jaxpar_mfu": r.mfu("jaxpar", facts),
                             "maxtext_mfu": r.mfu("maxtext", facts), "heads": r.layout.heads,
                             "jaxpar_settings": r.layout.jaxpar, "maxtext_settings": r.layout.maxtext}
                    for r in results},
        "bf16_over_fp32": precision_ratios(results),
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
    parser.add_argument("--precisions", default="bf16",
                        help="comma-separated compute dtypes, each layout run in each: bf16, fp32 (default bf16; "
                             "fp32,bf16 adds each side's bf16 / fp32 ratio)")
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
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if not args.precisions or any(p not in PRECISIONS for p in args.precisions):
        parser.error(f"--precisions takes names from {','.join(PRECISIONS)}; got {','.join(args.precisions) or 'none'}")
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
    machine, flops_per_token = jaxpar_facts(args.jaxpar_python, LAYOUTS[args.layouts[0]])
    facts = {"machine": machine, "flops_per_token": flops_per_token}
    say(f"peer_maxtext: jaxpar {commit} ({args.jaxpar_python}) vs {MAXTEXT_REQUIREMENT}, layouts "
         f"{','.join(args.layouts)} in {','.join(args.precisions)}, {args.rounds} round(s) of {args.steps} steps "
         f"(first {args.skip} dropped); runs in {scratch}; machine: {machine['line']}")
    results = [Result(LAYOUTS[name], precision) for name in args.layouts for precision in args.precisions]
    results = run_rounds(args, results, maxtext_python, base_yml, scratch)
    failures = [line for r in results for line in r.failures]
    print(markdown_table(results, commit, facts))
    if ratios := precision_ratios(results):
        print("\n" + ratio_table(ratios))
    for line in failures:
        print(f"FAILED {line}")
    try:
        bar_chart(results, commit, args.out, machine["line"])
        say(f"peer_maxtext: chart written to {args.out}")
    except ImportError as e:
        say(f"peer_maxtext: no chart: matplotlib is not importable here ({e}).")
    if failures or args.keep:
        say(f"peer_maxtext: run folders and logs kept in {scratch}")
    else:
        shutil.rmtree(scratch)
    print(json.dumps(summary(args, results, commit, failures, facts)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
