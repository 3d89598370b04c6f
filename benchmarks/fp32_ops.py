"""Where a step computes, writes and sends fp32: every op of the compiled train step by dtype, grouped
by the source line that made it, per device and step (compile only, nothing runs).

Usage:
    python benchmarks/fp32_ops.py [CONFIG.yaml] [key=value ...] [--top K] [--rates FP32,BF16]

Defaults to the bf16 fsdp 8 layout of benchmarks/peer_sides.py (vocab 32000, d_model 256, 4 layers,
seq 256, batch 8, untied head, ZeRO-3 on data=8, full remat); key=value settings override it. The
compiled program's HLO gives, with loop trip counts multiplied in (jaxpar.plan.hlo):
  * matmul FLOPs by operand and result dtype: "f32 x f32" matmuls run in fp32 (XLA converts a
    bf16 operand up when the other is fp32);
  * every other op's written bytes by result dtype (what elementwise work costs on a CPU), and
    whether a fusion computes in fp32 inside (a bf16 result of fp32 arithmetic: RMSNorm's);
  * collective bytes by dtype (XLA:CPU widens bf16 all-gathers to fp32).
Each op is named by the innermost jaxpar or optax frame of its stack trace (the plumbing that only
routes a matmul, jaxpar/model/axes.py, jaxpar/model/matmul.py and the layout's hooks, is looked
through), and grouped into the issue's categories: ZeRO gathers and reductions, master-weight
casts, logits / softmax / cross-entropy, RMSNorm, optimizer update, and the rest by module.
--rates turns matmul FLOPs into seconds at given GFLOP/s (default 452,803: the native-bf16 AMD
EPYC of issue 28, not measured here) to show each category's share of the matmul time there.

It imports nothing newer than jaxpar.plan.hlo, so PYTHONPATH=<an older checkout> runs it on older
code for a before/after table. The last line is JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import re
import sys

from peer_sides import BATCH, D_MODEL, HEADS, JAXPAR_D_FF, LAYERS, SEQ, VOCAB

PEER_FSDP8 = [f"model.vocab_size={VOCAB}", f"model.d_model={D_MODEL}", f"model.n_heads={HEADS}",
              f"model.n_layers={LAYERS}", f"model.d_ff={JAXPAR_D_FF}", f"model.seq_len={SEQ}",
              "model.tie_embeddings=false", f"train.batch_size={BATCH}", "train.precision=bf16",
              "train.remat=full", "parallel.zero=3", "mesh.data=8", "mesh.tensor=1", "run.devices=8"]

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("settings", nargs="*", help="an optional CONFIG.yaml, then key=value overrides")
parser.add_argument("--top", type=int, default=12, help="how many single fp32 ops to list (default %(default)s)")
parser.add_argument("--rates", default="452,803", help="fp32,bf16 GFLOP/s for the matmul time shares")
ARGS = parser.parse_args()
RATES = dict(zip(("f32", "bf16"), (float(r) * 1e9 for r in ARGS.rates.split(","))))

from common import load_settings  # noqa: E402

CFG = load_settings([*PEER_FSDP8, *ARGS.settings])

from jaxpar.runtime.devices import setup_devices  # noqa: E402

DEVICES = setup_devices(CFG)

from jaxpar.plan.hlo import array_shapes, nbytes, parse  # noqa: E402
from jaxpar.session import on_devices  # noqa: E402
from jaxpar.train.trainer import Trainer  # noqa: E402

# Frames that only route an op (the einsum helpers, the layout's matmul hooks): looked through.
PLUMBING = ("jaxpar/model/axes.py", "jaxpar/model/matmul.py", "jaxpar/model/fp8.py", "jaxpar/train/remat.py",
            "jaxpar/parallel/sequence_matmul.py")
PLUMBING_FUNCTIONS = ("column_parallel", "row_parallel", "fp32_einsum", "_over_tensor", "_sequence_matmul")
# (category, file suffix, function name prefixes or None for any)
CATEGORIES = (
    ("logits / softmax / cross-entropy", "/optax/losses/", None),
    ("optimizer update", "/optax/", None),
    ("ZeRO gathers / reductions", "jaxpar/parallel/hooks.py", None),
    ("ZeRO gathers / reductions", "jaxpar/parallel/reductions.py", None),
    ("master-weight casts", "jaxpar/config/precision.py", None),
    ("RMSNorm", "jaxpar/model/layers.py", ("RMSNorm",)),
    ("logits / softmax / cross-entropy", "jaxpar/model/transformer.py", ("Transformer.logits",)),
    ("logits / softmax / cross-entropy", "jaxpar/model/chunked_loss.py", None),
    ("logits / softmax / cross-entropy", "jaxpar/train/step.py", ("_loss_stats", "_head_stats")),
    ("logits / softmax / cross-entropy", "jaxpar/laid_out/forward.py", ("logits_losses", "head_losses")),
    ("attention", "jaxpar/model/attention.py", None),
    ("rotary", "jaxpar/model/layers.py", ("rotary",)),
    ("MLP", "jaxpar/model/mlp.py", None),
    ("embedding", "jaxpar/model/transformer.py", ("Transformer.embed",)),
)
_META = re.compile(r"stack_frame_id=(\d+)")
_ARITHMETIC_F32 = re.compile(r"^f32\[")
_NOT_ARITHMETIC = {"parameter", "constant", "convert", "bitcast", "broadcast", "copy", "reshape", "transpose",
                   "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "tuple", "get-tuple-element",
                   "iota", "pad", "select", "compare", "gather", "scatter"}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def frame_tables(text: str) -> dict[int, list[tuple[str, str]]]:
    """stack_frame_id -> [(file, function), ...] innermost first, from the HLO text's tables."""
    sections = dict.fromkeys(("FileNames", "FunctionNames", "FileLocations", "StackFrames"))
    current = None
    for line in text.splitlines():
        if line.strip() in sections:
            current, sections[line.strip()] = line.strip(), {}
            continue
        if current and (m := re.match(r"^(\d+) (.*)$", line)):
            sections[current][int(m[1])] = m[2]
        elif current and not line.strip():
            current = None
    if not sections["StackFrames"]:
        return {}
    files = {k: v.strip('"') for k, v in sections["FileNames"].items()}
    names = {k: v.strip('"') for k, v in sections["FunctionNames"].items()}
    locations = {k: (files[int(re.search(r"file_name_id=(\d+)", v)[1])],
                     names[int(re.search(r"function_name_id=(\d+)", v)[1])])
                 for k, v in sections["FileLocations"].items()}
    # the text prints a frame's parent as its 1-based id plus one: 1 is the root's "no parent"
    frames = {k: (int(re.search(r"file_location_id=(\d+)", v)[1]), int(re.search(r"parent_frame_id=(\d+)", v)[1]) - 1)
              for k, v in sections["StackFrames"].items()}

    def chain(frame: int) -> list[tuple[str, str]]:
        out, seen = [], set()
        while frame in frames and frame not in seen:
            seen.add(frame)
            location, parent = frames[frame]
            out.append(locations[location])
            frame = parent
        return out

    return {k: chain(k) for k in frames}


def source(chain: list[tuple[str, str]]) -> tuple[str, str]:
    """(category, 'file:function') of an op from its frames, innermost first."""
    for file, function in chain:
        if file.endswith(PLUMBING) or function.split(".")[-1].split("<")[0] in PLUMBING_FUNCTIONS:
            continue
        if "/jaxpar/" not in file and "/optax/" not in file:
            continue
        short = file[file.rfind("/jaxpar/") + 1:] if "/jaxpar/" in file else file[file.rfind("/optax/") + 1:]
        for category, suffix, functions in CATEGORIES:
            if suffix in file and (functions is None or function.startswith(functions)):
                return category, f"{short}:{function}"
        return short.removesuffix(".py").removeprefix("jaxpar/"), f"{short}:{function}"
    return "other", "?"


def dot_flops(inst, shapes: dict) -> tuple[float, str]:
    """(2 x output x contracted size, 'lhs x rhs -> out' dtypes) of a dot instruction."""
    operands = re.findall(r"%([^\s,)]+)", inst.rest)[:2]
    arrays = [array_shapes(shapes.get(o, "")) for o in operands]
    contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.rest)
    if not all(arrays) or not contract:
        return 0.0, "?"
    (lhs_dtype, lhs_dims), (rhs_dtype, _) = arrays[0][0], arrays[1][0]
    out_dtype, out_dims = array_shapes(inst.shape)[0]
    contracted = math.prod(lhs_dims[int(d)] for d in contract[1].split(",") if d)
    return 2.0 * math.prod(out_dims) * contracted, f"{lhs_dtype} x {rhs_dtype} -> {out_dtype}"


def fp32_inside(body: list) -> bool:
    """Whether a fused computation does fp32 arithmetic (not just moving or converting fp32 data)."""
    return any(i.op not in _NOT_ARITHMETIC and _ARITHMETIC_F32.match(i.shape) for i in body)


class _Counts:
    """Per-device, per-step totals by dtype and category, and the single fp32 ops."""

    def __init__(self, text: str):
        self.module, self.frames = parse(text), frame_tables(text)
        self.fused = {c for insts in self.module.computations.values() for i in insts if i.op == "fusion"
                      for c in re.findall(r"\bcalls=%([^\s,)}]+)", i.rest)}
        self.matmuls, self.written, self.sent = collections.Counter(), collections.Counter(), collections.Counter()
        self.singles = []
        for name, insts in self.module.computations.items():
            runs = self.module.executions(name)
            shapes = {i.name: i.shape for i in insts}
            for inst in insts if runs else ():
                if inst.op == "dot":
                    self._dot(inst, shapes, runs)
                elif name not in self.fused and inst.op.startswith(COLLECTIVES) and not inst.op.endswith("-done"):
                    self._collective(inst, runs)
                elif name not in self.fused:
                    self._other(inst, runs)

    def where(self, inst, fallback=None) -> tuple[str, str]:
        """(category, source line) of an instruction, from its stack frame."""
        m = _META.search(inst.rest)
        if m:
            return source(self.frames.get(int(m[1]), []))
        if fallback:
            return fallback
        if inst.op.startswith(COLLECTIVES):  # the SPMD partitioner's own: no source line
            return f"partitioner's {inst.op.removesuffix('-start')}", "?"
        return "no source line (XLA's own)", "?"

    def _dot(self, inst, shapes: dict, runs: int) -> None:
        flops, kinds = dot_flops(inst, shapes)
        category, line = self.where(inst)
        self.matmuls[(kinds, category)] += flops * runs
        if kinds.startswith("f32 x f32"):
            self.singles.append(("matmul", inst.name, inst.shape.split("{")[0], category, line, flops * runs, 0))

    def _collective(self, inst, runs: int) -> None:
        dtype = (array_shapes(inst.shape) or [("-", ())])[0][0]
        category, line = self.where(inst)
        moved = nbytes(inst.shape) * runs
        self.sent[(inst.op.removesuffix("-start"), dtype, category)] += moved
        if dtype == "f32":
            self.singles.append((inst.op, inst.name, inst.shape.split("{")[0], category, line, 0, moved))

    def _other(self, inst, runs: int) -> None:
        """An unfused op or a fusion without a matmul: the bytes it writes, in the dtype it computes in."""
        if inst.op not in ("fusion", "convert", "copy", "transpose") and not inst.op.startswith(
                ("add", "multiply", "reduce", "divide", "subtract", "select", "exponential")):
            return
        callees = re.findall(r"\bcalls=%([^\s,)}]+)", inst.rest)
        body = self.module.computations.get(callees[0], []) if callees else []
        if any(i.op == "dot" for i in body):
            return  # a matmul's fusion: counted as a matmul
        inner = next((i for i in reversed(body) if _META.search(i.rest)), None)
        category, line = self.where(inst, self.where(inner) if inner is not None else None)
        dtype = (array_shapes(inst.shape) or [("-", ())])[0][0]
        computes = "f32" if (dtype == "f32" or fp32_inside(body)) else dtype
        kind = "convert" if "convert" in inst.name and inst.op in ("fusion", "convert") else "elementwise"
        written = nbytes(inst.shape) * runs
        self.written[(kind, dtype, computes, category)] += written
        if computes == "f32":
            self.singles.append((kind, inst.name, inst.shape.split("{")[0], category, line, 0, written))


def analyse(text: str) -> dict:
    counts = _Counts(text)
    return {"matmuls": counts.matmuls, "written": counts.written, "sent": counts.sent, "singles": counts.singles}


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def report(found: dict, title: str) -> dict:
    """Print the tables; return the JSON figures."""
    matmuls, written, sent = found["matmuls"], found["written"], found["sent"]
    flops = sum(matmuls.values())
    seconds = {k: v / RATES["f32" if k[0].startswith("f32 x f32") else "bf16"] for k, v in matmuls.items()}
    print(f"{title}\n\nmatmuls (GFLOP per device and step; time at {ARGS.rates} GFLOP/s fp32,bf16)\n")
    print("| operands -> result | category | GFLOP | share of FLOPs | share of matmul time |\n|---|---|---:|---:|---:|")
    for (kinds, category), value in sorted(matmuls.items(), key=lambda kv: -kv[1]):
        print(f"| {kinds} | {category} | {value / 1e9:.3f} | {_share(value, flops)} | "
              f"{_share(seconds[(kinds, category)], sum(seconds.values()))} |")
    total = sum(written.values())
    print("\nother ops: bytes written (MB per device and step), by result dtype and the dtype they compute in\n")
    print("| kind | result | computes in | category | MB | share |\n|---|---|---|---|---:|---:|")
    for (kind, dtype, computes, category), value in sorted(written.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {dtype} | {computes} | {category} | {value / 1e6:.2f} | {_share(value, total)} |")
    moved = sum(sent.values())
    print("\ncollectives: result bytes (MB per device and step)\n")
    print("| op | dtype | category | MB | share |\n|---|---|---|---:|---:|")
    for (op, dtype, category), value in sorted(sent.items(), key=lambda kv: -kv[1]):
        print(f"| {op} | {dtype} | {category} | {value / 1e6:.2f} | {_share(value, moved)} |")
    singles = sorted(found["singles"], key=lambda s: (-s[5], -s[6]))[:ARGS.top]
    print(f"\nthe {len(singles)} largest fp32 ops\n\n| kind | instruction | shape | category | source | GFLOP | MB |"
          "\n|---|---|---|---|---|---:|---:|")
    for kind, name, shape, category, line, f, b in singles:
        print(f"| {kind} | {name} | {shape} | {category} | {line} | {f / 1e9:.3f} | {b / 1e6:.2f} |")
    f32_flops = sum(v for k, v in matmuls.items() if k[0].startswith("f32 x f32"))
    f32_written = sum(v for k, v in written.items() if k[2] == "f32")
    f32_sent = sum(v for k, v in sent.items() if k[1] == "f32")
    print(f"\nfp32: {_share(f32_flops, flops)} of matmul FLOPs ({f32_flops / 1e9:.3f} of {flops / 1e9:.3f} GFLOP), "
          f"{_share(f32_written, total)} of other ops' bytes, {_share(f32_sent, moved)} of collective bytes")
    return {"matmul_flops": flops, "fp32_matmul_flops": f32_flops, "written_bytes": total,
            "fp32_written_bytes": f32_written, "collective_bytes": moved, "fp32_collective_bytes": f32_sent,
            "matmul_seconds_at_rates": sum(seconds.values()), "rates_gflops": ARGS.rates,
            "by_category": {f"{k[0]} | {k[1]}": v for k, v in matmuls.items()}}


def main() -> int:
    import jax

    session = on_devices(CFG, DEVICES)
    text = Trainer(session).compile_step().as_text()
    title = f"{session.layout_name()} ({len(DEVICES)} x {DEVICES[0].device_kind}, jax {jax.__version__})"
    figures = report(analyse(text), title)
    print(json.dumps({"benchmark": "fp32_ops", "layout": session.layout_name(), **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
