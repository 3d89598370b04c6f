"""Per-device memory of jaxpar train steps under ZeRO, Adafactor, remat, flash attention and
sequence parallelism, from the compiled program.

Usage:
    python benchmarks/memory.py [key=value ...] [--tables LETTERS]

Nothing is trained: each layout's train step is lowered and compiled, then measured with
`jaxpar.plan.measure_step` (XLA's `memory_analysis()`, the state's shardings, and the
matmul FLOPs and collectives read from the HLO text). Three tables are printed as markdown:
  A. per-device MiB of parameters, optimizer state, gradients (after reduction),
     temporaries and arguments, plus reduce-scatter / all-reduce / all-gather bytes per step,
     for ZeRO stage 0-3 x optimizer {adamw, adafactor} on an 8.7M-parameter model on data=8
     (`key=value` overrides apply to this model, and to no other table);
  B. temporary MiB against the number of layers L in {4, 8, 16, 32} for each remat policy
     {none, full, dots, sqrt} (seq 256, global batch 64, data=8), and the FLOPs of each policy
     relative to none at L=32. FLOPs are matmul FLOPs per step with loop trip counts
     multiplied in (XLA's `cost_analysis()` counts a scanned layer body once); the per-L FLOPs
     of remat=none are printed under the table so their growth with L can be checked;
  C. long context, on a small model (d_model 128, 2 layers (C2: 8), 4 heads, d_ff 512, global batch 8,
     fp32, remat none; flash blocks 512 x 512) at sequence length L in {1024, 2048, 4096, 8192}:
     C1. temporary MiB per device for model.attention dot vs flash on data=8 (batch 1 per
         device), and flash / dot per L;
     C2. temporary MiB per device for parallel.sequence false vs true on data=2 x tensor=4
         (attention flash, so the L x L scores do not dominate; 8 layers, so what each layer keeps
         outweighs the logits and embedding), and true / false per L, with
         remat none and with remat full; then, for each remat, the all-reduce / reduce-scatter
         / all-gather bytes per step of both at L=2048: each result's size and the bytes each
         device sends with ring algorithms (on which reduce-scatter + all-gather = all-reduce),
         and the mesh axes each collective spans.
Options:
  --tables LETTERS  which tables to measure and print, any of A, B and C (`--tables C`,
                    `--tables AB`, `--tables A,C`); default ABC, all three.
  -h, --help        print this text and exit.
Figures: when both A and B run, a two-panel figure of them goes to benchmarks/results/memory.png;
when C runs, a two-panel figure of C1 and C2 goes to benchmarks/results/memory_long_context.png.
A figure whose tables did not run is left as it was. The last line printed is one JSON object
with every number of the tables that ran. On a CPU-only host 8 devices are emulated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from common import RESULTS, device_line, markdown, pyplot, save_figure, trainer_on

from jaxpar.config.presets import load_config
from jaxpar.runtime.devices import setup_devices

MODEL_A = ["model.d_model=256", "model.n_layers=11", "model.n_heads=8", "model.d_ff=1024", "mesh.data=8"]
DEEP_B = ["model.seq_len=256", "train.batch_size=64", "mesh.data=8"]
STAGES, OPTIMIZERS = (0, 1, 2, 3), ("adamw", "adafactor")
LAYERS, POLICIES = (4, 8, 16, 32), ("none", "full", "dots", "sqrt")
CATEGORIES = (("params", "params_bytes"), ("optimizer state", "opt_state_bytes"), ("gradients", "grads_bytes"),
              ("temporaries", "temp_bytes"), ("arguments", "argument_bytes"))
COLLECTIVES = ("reduce-scatter", "all-reduce", "all-gather")
SMALL_C = ["model.d_model=128", "model.n_layers=2", "model.n_heads=4", "model.d_ff=512", "train.batch_size=8",
           "train.precision=fp32", "train.remat=none", "model.flash_block_q=512", "model.flash_block_kv=512"]
# C2 is 8 layers deep: sequence parallelism shrinks what each layer keeps, and at 2 layers the
# logits and embedding (which it does not touch) would be most of the temporaries.
MESH_C1 = ["mesh.data=8", "mesh.tensor=1"]
MESH_C2 = ["mesh.data=2", "mesh.tensor=4", "model.attention=flash", "model.n_layers=8"]
SEQ_LENS, ATTENTIONS, SEQUENCE = (1024, 2048, 4096, 8192), ("dot", "flash"), (False, True)
REMATS_C2 = ("none", "full")
COLLECTIVE_L = 2048  # the sequence length of C2's collective bytes
OUT_PNG = RESULTS / "memory.png"
OUT_LONG_PNG = RESULTS / "memory_long_context.png"
MIB = 2 ** 20
TABLES = "ABC"


def parse_args(argv: list[str]) -> argparse.Namespace:
    """key=value overrides (table A's model) and --tables; -h prints the module docstring."""
    parser = argparse.ArgumentParser(usage="python benchmarks/memory.py [key=value ...] [--tables LETTERS]",
                                     add_help=False)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--tables", default=TABLES)
    parser.add_argument("-h", "--help", action="store_true")
    args = parser.parse_intermixed_args(argv)
    if args.help:
        print(__doc__)
        sys.exit(0)
    letters = args.tables.replace(",", "").replace(" ", "").upper()
    if not letters or set(letters) - set(TABLES):
        parser.error(f"--tables takes letters among {', '.join(TABLES)} (e.g. --tables C or --tables A,C), "
                     f"not {args.tables!r}")
    args.tables = "".join(t for t in TABLES if t in letters)
    return args


ARGS = parse_args(sys.argv[1:])
OVERRIDES = ARGS.overrides
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


def table_c1() -> dict:
    """Temporary bytes per sequence length for dot vs flash attention on data=8."""
    out = {attention: {} for attention in ATTENTIONS}
    for attention in ATTENTIONS:
        for n in SEQ_LENS:
            plan = measure(f"C1 attention={attention} seq={n}",
                           [*SMALL_C, *MESH_C1, f"model.seq_len={n}", f"model.attention={attention}"])
            out[attention][n] = {"temp_bytes": plan["temp_bytes"]}
    return out


def table_c2() -> dict:
    """Temporary bytes per sequence length, sequence parallelism off vs on (data=2 x tensor=4, flash),
    per remat policy; and at COLLECTIVE_L the collective bytes per op (result sizes and bytes sent)
    with the mesh axes they span."""
    out = {"temp": {}, "collectives": {}}
    for remat in REMATS_C2:
        out["temp"][remat], out["collectives"][remat] = {}, {}
        for on in SEQUENCE:
            key = str(on).lower()
            out["temp"][remat][key] = {}
            for n in SEQ_LENS:
                plan = measure(f"C2 remat={remat} sequence={key} seq={n}",
                               [*SMALL_C, *MESH_C2, f"model.seq_len={n}", f"parallel.sequence={key}",
                                f"train.remat={remat}"])
                out["temp"][remat][key][n] = {"temp_bytes": plan["temp_bytes"]}
                if n == COLLECTIVE_L:
                    out["collectives"][remat][key] = collective_bytes(plan)
    return out


def collective_bytes(plan: dict) -> dict:
    """A plan's reduce-scatter / all-reduce / all-gather bytes per step: result sizes ("total"),
    bytes each device sends ("sent"), and result sizes by the mesh axes each op spans."""
    by_axes: dict[str, dict[str, int]] = {op: {} for op in COLLECTIVES}
    for c in plan["collective_ops"]:
        if c["op"] in by_axes:
            axes = "+".join(c["mesh_axes"]) or "none"
            by_axes[c["op"]][axes] = by_axes[c["op"]].get(axes, 0) + c["bytes"] * c["count"]
    return {"total": {op: plan["collectives"][op] for op in COLLECTIVES},
            "sent": {op: plan["collective_wire_bytes"][op] for op in COLLECTIVES}, "by_axes": by_axes}


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


def markdown_c1(c1: dict) -> str:
    """Table C1 as markdown: temporary MiB per L for dot and flash attention, and flash / dot."""
    header = ["seq L", "dot temp MiB", "flash temp MiB", "flash / dot"]
    cells = [[str(n), f"{c1['dot'][n]['temp_bytes'] / MIB:.2f}", f"{c1['flash'][n]['temp_bytes'] / MIB:.2f}",
              f"{c1['flash'][n]['temp_bytes'] / c1['dot'][n]['temp_bytes']:.3f}"] for n in SEQ_LENS]
    return markdown(header, cells)


def markdown_c2(c2: dict) -> str:
    """Table C2 as markdown: temporary MiB per L with sequence parallelism off and on, and on / off,
    per remat policy; then the collective bytes per step at COLLECTIVE_L per remat policy."""
    temp = c2["temp"]
    header = ["seq L"]
    for remat in REMATS_C2:
        header += [f"remat={remat}: false MiB", "true MiB", "true / false"]
    cells = []
    for n in SEQ_LENS:
        row = [str(n)]
        for remat in REMATS_C2:
            off, on = temp[remat]["false"][n]["temp_bytes"], temp[remat]["true"][n]["temp_bytes"]
            row += [f"{off / MIB:.2f}", f"{on / MIB:.2f}", f"{on / off:.3f}"]
        cells.append(row)
    text = markdown(header, cells)
    for remat in REMATS_C2:
        coll = c2["collectives"][remat]

        def split(key: str, op: str, coll=coll) -> str:
            parts = coll[key]["by_axes"][op]
            return "; ".join(f"{axes}: {b:,d}" for axes, b in sorted(parts.items())) or "-"

        header2 = ["collective", "false: size B", "true: size B", "false: sent B", "true: sent B",
                   "false, by mesh axes", "true, by mesh axes"]
        cells2 = [[op, f"{coll['false']['total'][op]:,d}", f"{coll['true']['total'][op]:,d}",
                   f"{coll['false']['sent'][op]:,d}", f"{coll['true']['sent'][op]:,d}", split("false", op),
                   split("true", op)] for op in COLLECTIVES]
        cells2.append(["total", f"{sum(coll['false']['total'].values()):,d}",
                       f"{sum(coll['true']['total'].values()):,d}", f"{sum(coll['false']['sent'].values()):,d}",
                       f"{sum(coll['true']['sent'].values()):,d}", "", ""])
        text += (f"\n\nCollective bytes per step and device at L={COLLECTIVE_L}, remat={remat} (size: each "
                 "result's bytes x executions; sent: what each device sends with ring algorithms; axes: by "
                 "result size)\n\n" + markdown(header2, cells2))
    return text


def plot(rows: list[dict], remat: dict, path: Path) -> None:
    """Two panels: stacked per-device MiB per layout (left), temporary MiB against L per remat policy (right)."""
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(14, 5.5))
    xs = range(len(rows))
    bottom = [0.0] * len(rows)
    for name, key, color in (("params", "params_bytes", "tab:blue"),
                             ("optimizer state", "opt_state_bytes", "tab:orange"),
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


def plot_long(c1: dict, c2: dict, path: Path) -> None:
    """Two panels against L: temporary MiB for dot vs flash (left), sequence parallelism off vs on (right)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, (left, right) = pyplot().subplots(1, 2, figsize=(13, 5))
    panels = ((left, "C1: attention dot vs flash (data=8, batch 1 per device)", "model.attention",
               {a: c1[a] for a in ATTENTIONS}, "dot", "flash"),
              (right, "C2: sequence parallelism off vs on (data=2 x tensor=4, flash, 8 layers, remat none)",
               "parallel.sequence", c2["temp"]["none"], "false", "true"))
    for ax, title, legend, curves, base, other in panels:
        for key, marker in ((base, "o"), (other, "s")):
            ax.plot(SEQ_LENS, [curves[key][n]["temp_bytes"] / MIB for n in SEQ_LENS], marker=marker, label=key)
        for n in SEQ_LENS:  # the ratio other / base under each point of the lower curve
            ratio = curves[other][n]["temp_bytes"] / curves[base][n]["temp_bytes"]
            ax.annotate(f"x{ratio:.2g}", (n, curves[other][n]["temp_bytes"] / MIB), textcoords="offset points",
                        xytext=(0, -14), ha="center", fontsize=8)
        ax.set_title(title)
        ax.legend(title=f"{legend} (x: {other} / {base})", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_ylim(bottom=0.6 * min(curves[other][n]["temp_bytes"] for n in SEQ_LENS) / MIB)  # room for labels
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(SEQ_LENS, [str(n) for n in SEQ_LENS])
        ax.set_xlabel("sequence length L")
        ax.set_ylabel("temporary MiB per device")
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle("Temporaries vs sequence length (d_model 128, 4 heads, global batch 8, fp32; C1 2 layers, C2 8)")
    save_figure(fig, path)


def main() -> int:
    """Measure the selected tables, print them as markdown, write their figures, print the JSON line."""
    tables = ARGS.tables
    count = {"A": len(STAGES) * len(OPTIMIZERS), "B": len(LAYERS) * len(POLICIES),
             "C": len(SEQ_LENS) * (len(ATTENTIONS) + len(SEQUENCE) * len(REMATS_C2))}
    print(f"{device_line(DEVICES)}; tables {tables}; compiling {sum(count[t] for t in tables)} layouts",
          file=sys.stderr)
    model = [*MODEL_A, *OVERRIDES]
    result = {}
    if "A" in tables:
        rows = table_a(model)
        print("Table A: per-device bytes by ZeRO stage and optimizer (" + " ".join(model) + ")\n")
        print(markdown_a(rows) + "\n")
        result["table_a"] = {"overrides": model, "rows": rows}
    if "B" in tables:
        remat = table_b()
        print("Table B: temporaries vs layers per remat policy (" + " ".join(DEEP_B) + ")\n")
        print(markdown_b(remat) + "\n")
        result["table_b"] = {"overrides": DEEP_B, "remat": remat}
    if "C" in tables:
        c1, c2 = table_c1(), table_c2()
        print("Table C1: temporaries vs sequence length, dot vs flash attention ("
              + " ".join([*SMALL_C, *MESH_C1]) + ")\n")
        print(markdown_c1(c1) + "\n")
        print("Table C2: temporaries vs sequence length, sequence parallelism off vs on ("
              + " ".join([*SMALL_C, *MESH_C2]) + ")\n")
        print(markdown_c2(c2) + "\n")
        result["table_c"] = {"overrides": SMALL_C, "c1": {"mesh": MESH_C1, "attention": c1},
                             "c2": {"mesh": MESH_C2, **c2}}
    if "A" in tables and "B" in tables:
        plot(result["table_a"]["rows"], result["table_b"]["remat"], OUT_PNG)
        print(f"figure: {OUT_PNG}", file=sys.stderr)
    if "C" in tables:
        plot_long(c1, c2, OUT_LONG_PNG)
        print(f"figure: {OUT_LONG_PNG}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
