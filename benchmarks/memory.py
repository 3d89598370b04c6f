"""Per-device memory of jaxpar train steps under ZeRO, Adafactor and remat, from the compiled program.

Usage:
    python benchmarks/memory.py [key=value ...]

Nothing is trained: each layout's train step is lowered and compiled, then measured with
`jaxpar.plan.measure_step` (XLA's `memory_analysis()`, the state's shardings, and the
matmul FLOPs and collectives read from the HLO text). Two tables are printed as markdown:
  A. per-device MiB of parameters, optimizer state, gradients (after reduction),
     temporaries and arguments, plus reduce-scatter / all-reduce / all-gather bytes per step,
     for ZeRO stage 0-3 x optimizer {adamw, adafactor} on an 8.7M-parameter model on data=8
     (`key=value` overrides apply to this model);
  B. temporary MiB against the number of layers L in {4, 8, 16, 32} for each remat policy
     {none, full, dots, sqrt} (seq 256, global batch 64, data=8), and the FLOPs of each policy
     relative to none at L=32. FLOPs are matmul FLOPs per step with loop trip counts
     multiplied in (XLA's `cost_analysis()` counts a scanned layer body once); the per-L FLOPs
     of remat=none are printed under the table so their growth with L can be checked.
It writes both as a two-panel figure to benchmarks/results/memory.png; the last line printed
is one JSON object with every number. On a CPU-only host 8 devices are emulated.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from common import RESULTS, device_line, markdown, pyplot, save_figure, trainer_on
from jaxpar.config import load_config
from jaxpar.runtime import setup_devices

MODEL_A = ["model.d_model=256", "model.n_layers=11", "model.n_heads=8", "model.d_ff=1024", "mesh.data=8"]
DEEP_B = ["model.seq_len=256", "train.batch_size=64", "mesh.data=8"]
STAGES, OPTIMIZERS = (0, 1, 2, 3), ("adamw", "adafactor")
LAYERS, POLICIES = (4, 8, 16, 32), ("none", "full", "dots", "sqrt")
CATEGORIES = (("params", "params_bytes"), ("optimizer state", "opt_state_bytes"), ("gradients", "grads_bytes"),
              ("temporaries", "temp_bytes"), ("arguments", "argument_bytes"))
COLLECTIVES = ("reduce-scatter", "all-reduce", "all-gather")
OUT_PNG = RESULTS / "memory.png"
MIB = 2 ** 20

if any(a in ("-h", "--help") for a in sys.argv[1:]):
    print(__doc__)
    sys.exit(0)
OVERRIDES = sys.argv[1:]
# jax must not start before setup_devices has set XLA_FLAGS (emulated CPU devices).
DEVICES = setup_devices(load_config(None, [*MODEL_A, *OVERRIDES]))

from jaxpar.plan import measure_step  # noqa: E402


def measure(label: str, overrides: list[str]) -> dict:
    """Compile one layout's train step (nothing runs) and return `measure_step`'s figures."""
    cfg = load_config(None, [f"run.dir={os.devnull}", *overrides])
    start = time.perf_counter()
    plan = measure_step(trainer_on(cfg, DEVICES))
    print(f"{label}: compiled and measured in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return plan


def table_a(model: list[str]) -> list[dict]:
    """Per-device bytes by category and collective bytes for every ZeRO stage x optimizer."""
    rows = []
    for optimizer in OPTIMIZERS:
        for stage in STAGES:
            plan = measure(f"A zero={stage} {optimizer}", [*model, f"parallel.zero={stage}",
                                                          f"train.optimizer={optimizer}"])
            row = {"zero": stage, "optimizer": optimizer}
            row.update({key: plan[key] for _, key in CATEGORIES})
            row.update({op: plan["collectives"][op] for op in COLLECTIVES})
            rows.append(row)
    return rows


def table_b() -> dict:
    """Temporary bytes and FLOPs for every remat policy x number of layers."""
    out = {policy: {} for policy in POLICIES}
    for policy in POLICIES:
        for n in LAYERS:
            plan = measure(f"B remat={policy} L={n}", [*DEEP_B, f"model.n_layers={n}", f"train.remat={policy}"])
            out[policy][n] = {"temp_bytes": plan["temp_bytes"], "flops": plan["flops"]}
    return out


def markdown_a(rows: list[dict]) -> str:
    """Table A as markdown: MiB with 2 decimals per category, collectives in bytes per step."""
    header = ["zero", "optimizer"] + [f"{name} MiB" for name, _ in CATEGORIES] + [f"{op} B" for op in COLLECTIVES]
    cells = [[str(r["zero"]), r["optimizer"]] + [f"{r[key] / MIB:.2f}" for _, key in CATEGORIES]
             + [f"{r[op]:,d}" for op in COLLECTIVES] for r in rows]
    return markdown(header, cells)


def markdown_b(remat: dict) -> str:
    """Table B as markdown: temporary MiB per (policy, L), temp and FLOPs ratios vs none at the largest L."""
    top = LAYERS[-1]
    header = ["remat"] + [f"L={n} temp MiB" for n in LAYERS] + [f"temp / none (L={top})", f"FLOPs / none (L={top})"]
    base = remat["none"][top]
    cells = [[policy] + [f"{remat[policy][n]['temp_bytes'] / MIB:.2f}" for n in LAYERS]
             + [f"{remat[policy][top]['temp_bytes'] / base['temp_bytes']:.3f}",
                f"{remat[policy][top]['flops'] / base['flops']:.3f}"] for policy in POLICIES]
    per_l = ", ".join(f"L={n}: {remat['none'][n]['flops']:.4g}" for n in LAYERS)
    return markdown(header, cells) + f"\n\nmatmul FLOPs per step and device, remat=none: {per_l}"


def plot(rows: list[dict], remat: dict, path: Path) -> None:
    """Two panels: stacked per-device MiB per layout (left), temporary MiB against L per remat policy (right)."""
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(14, 5.5))
    xs = range(len(rows))
    bottom = [0.0] * len(rows)
    for name, key, color in (("params", "params_bytes", "tab:blue"), ("optimizer state", "opt_state_bytes", "tab:orange"),
                             ("temporaries", "temp_bytes", "tab:gray")):
        heights = [r[key] / MIB for r in rows]
        left.bar([x - 0.12 for x in xs], heights, 0.55, bottom=bottom, label=name, color=color)
        bottom = [b + h for b, h in zip(bottom, heights)]
    left.bar([x + 0.3 for x in xs], [r["grads_bytes"] / MIB for r in rows], 0.18, color="tab:green",
             label="gradients (after reduction)")
    left.set_xticks(list(xs), [f"zero {r['zero']}\n{r['optimizer']}" for r in rows], fontsize=8)
    left.set_ylabel("MiB per device")
    left.set_title(f"Per-device memory by category (fp32 params P = {rows[0]['params_bytes'] / MIB:.1f} MiB)")
    left.legend(fontsize=8)
    for policy, marker in zip(POLICIES, "osD^"):
        right.plot(LAYERS, [remat[policy][n]["temp_bytes"] / MIB for n in LAYERS], marker=marker, label=policy)
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xticks(LAYERS, [str(n) for n in LAYERS])
    right.set_xlabel("layers L")
    right.set_ylabel("temporary MiB per device")
    right.set_title("Temporaries vs depth per remat policy (seq 256, batch 64, data=8)")
    right.legend(title="remat", fontsize=8)
    save_figure(fig, path)


def main() -> int:
    """Measure both tables, print them as markdown, write the figure, print the JSON line."""
    print(f"{device_line(DEVICES)}; compiling {len(STAGES) * len(OPTIMIZERS) + len(LAYERS) * len(POLICIES)} layouts",
          file=sys.stderr)
    model = [*MODEL_A, *OVERRIDES]
    rows, remat = table_a(model), table_b()
    print("Table A: per-device bytes by ZeRO stage and optimizer (" + " ".join(model) + ")\n")
    print(markdown_a(rows) + "\n")
    print("Table B: temporaries vs layers per remat policy (" + " ".join(DEEP_B) + ")\n")
    print(markdown_b(remat) + "\n")
    plot(rows, remat, OUT_PNG)
    print(f"figure: {OUT_PNG}", file=sys.stderr)
    print(json.dumps({"table_a": {"overrides": model, "rows": rows},
                      "table_b": {"overrides": DEEP_B, "remat": remat}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
