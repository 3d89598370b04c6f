"""The prepared GPU check: throughput, MFU and peak memory of two models on one GPU, and one verify.

Usage:
    python benchmarks/gpu_check.py [--dry-run] [--steps N] [--warmup W] [--results FILE]

A session that is lent a GPU runs this once, in a few minutes. Rows, each in a child process of
its own (so that each row's peak memory is its own):
  * configs/gpu_300m.yaml: batch 16 x 1024 tokens;
  * configs/llama3_2_1b.yaml (Llama-3.2-1B's shape): batch 4 x 4096 tokens, full remat;
in each precision jaxpar has for GPUs (bf16, and fp8: e4m3/e5m2 GEMMs in the blocks), all on one
device. MFU is against the datasheet's dense bf16 peak in both (the fp8 row's model FLOPs are the same;
its gain shows as a higher MFU against that peak, as torchtitan reports it). Per row: the compile
seconds, the median of the timed steps, tokens/s and MFU against the GPU's datasheet peak
(jaxpar.train.model_flops.utilization), and the device's peak bytes
in use after the steps against the compiled step's own figure (memory_analysis(): arguments +
outputs - aliases + temporaries).

Then `jaxpar verify` of one single-device layout (grad_accum=2, full remat, fp32), at XLA's default
matmul precision and at 'highest': on a GPU the default runs fp32 matmuls as TF32.

Output: the markdown table on stdout and, last, one JSON line. With --results FILE the table is
appended to FILE under a heading that names the commit, the date and the device.

--dry-run: the same code on the CPU, with the models shrunk to a few layers of width 64 and one timed
step (the test suite runs it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, git_commit, markdown, step_parser

MODELS = {  # name: the preset and the one-device batch
    "gpu_300m": ["configs/gpu_300m.yaml", "train.batch_size=16"],
    "llama3.2-1b shape": ["configs/llama3_2_1b.yaml", "train.batch_size=4"],
}
PRECISIONS = ("bf16", "fp8")  # jaxpar's GPU training precisions
TINY = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
        "model.seq_len=64", "model.vocab_size=512", "train.batch_size=4"]
VERIFY = ["configs/gpu_300m.yaml", "model.n_layers=4", "model.d_model=256", "model.n_heads=4", "model.d_ff=1024",
          "model.seq_len=256", "train.batch_size=8", "train.grad_accum=2", "train.remat=full",
          "train.precision=fp32", "train.steps=3"]
ONE_DEVICE = ["run.devices=1", "mesh.data=1"]


def row_settings(model: str, precision: str, dry_run: bool) -> list[str]:
    """The config words of one row."""
    preset, batch = MODELS[model]
    return [preset, *ONE_DEVICE, batch, f"train.precision={precision}", *(TINY if dry_run else [])]


def measure_row(settings: list[str], steps: int, warmup: int) -> dict:
    """In this process: compile the row's step, run warm-up and timed steps, and read the memory."""
    from common import host_batches, load_settings, machine_record, time_steps, trainer_on

    from jaxpar.config import precision
    from jaxpar.runtime.devices import setup_devices

    cfg = load_settings(settings)
    devices = setup_devices(cfg)
    from jaxpar.train.model_flops import utilization

    trainer = trainer_on(cfg, devices)
    start = time.perf_counter()
    compiled = trainer.compile_step()
    compile_s = time.perf_counter() - start
    stats = compiled.memory_analysis()
    program_bytes = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
                     + stats.temp_size_in_bytes)
    batches = host_batches(cfg, warmup + steps)
    seconds, out, _ = time_steps(compiled, trainer.init(), trainer.put_batch, batches, warmup)
    tokens_per_s = cfg.train.batch_size * cfg.model.seq_len / seconds
    compute = precision.of(cfg).compute
    used = utilization(cfg, tokens_per_s, devices[:1], compute, machine_record(devices[:1], (compute,)))
    memory = devices[0].memory_stats() or {}  # None on the CPU
    return {"device": devices[0].device_kind, "platform": devices[0].platform, "compile_s": round(compile_s, 1),
            "median_step_ms": round(seconds * 1e3, 2), "tokens_per_s": round(tokens_per_s, 1),
            "mfu": None if used["mfu"] is None else round(used["mfu"], 4), "peak_source": used["peak_source"],
            "model_flops_per_token": used["model_flops_per_token"], "final_loss": float(out["loss"]),
            "peak_bytes_in_use": memory.get("peak_bytes_in_use"), "program_bytes": int(program_bytes),
            "temp_bytes": int(stats.temp_size_in_bytes)}


def child(args: list[str], env: dict | None = None) -> tuple[int, str]:
    """Run this script or jaxpar in a child process; (exit status, its last stdout line)."""
    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
    lines = done.stdout.strip().splitlines()
    return done.returncode, lines[-1] if lines else ""


def run_rows(dry_run: bool, steps: int, warmup: int) -> list[dict]:
    """Every (model, precision) row, each measured in a child process."""
    rows = []
    for model in MODELS:
        for precision in PRECISIONS:
            settings = row_settings(model, precision, dry_run)
            print(f"gpu_check: {model} {precision} ...", file=sys.stderr, flush=True)
            status, last = child([__file__, "--row", json.dumps(settings), "--steps", str(steps),
                                  "--warmup", str(warmup)])
            found = json.loads(last) if status == 0 else {"error": f"exit status {status}"}
            rows.append({"model": model, "precision": precision, **found})
    return rows


def run_verify(dry_run: bool) -> list[dict]:
    """`jaxpar verify` of the one-device layout at each matmul precision."""
    results = []
    settings = [*VERIFY, *ONE_DEVICE, *(TINY if dry_run else [])]
    for matmul in ("default", "highest"):
        print(f"gpu_check: verify at matmul precision {matmul} ...", file=sys.stderr, flush=True)
        env = {} if matmul == "default" else {"JAX_DEFAULT_MATMUL_PRECISION": matmul}
        status, last = child(["-m", "jaxpar", "verify", *settings], env)
        try:
            found = json.loads(last)
        except json.JSONDecodeError:
            found = {"ok": False, "error": f"exit status {status}: {last[:200]}"}
        results.append({"matmul_precision": matmul, **found})
    return results


def table(rows: list[dict], verifies: list[dict]) -> str:
    """The rows and the verify results as markdown."""
    def gib(value):
        return "n/a" if value is None else f"{value / 2**30:.2f}"

    body = [[r["model"], r["precision"], r.get("compile_s", "-"), r.get("median_step_ms", r.get("error")),
             f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "-",
             f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a",
             gib(r.get("peak_bytes_in_use")), gib(r.get("program_bytes"))] for r in rows]
    header = ["model", "precision", "compile s", "median step ms", "tokens/s", "MFU",
              "peak GiB in use", "compiled step GiB"]
    def err(value):
        return f"{value:.1e}" if isinstance(value, float) else "-"

    checks = [[v["matmul_precision"], v.get("ok"), err(v.get("loss_max_rel_err")), err(v.get("param_max_rel_err")),
               v.get("error", "")] for v in verifies]
    return (markdown(header, body) + "\n\n" + f"verify `{' '.join(VERIFY[1:])}` on one device:\n\n"
            + markdown(["matmul precision", "ok", "loss max rel err", "param max rel err", "error"], checks))


def main() -> int:
    parser = step_parser(__doc__, steps=10, warmup=2)
    parser.add_argument("--dry-run", action="store_true", help="tiny models on the CPU, one timed step")
    parser.add_argument("--results", type=Path, help="append the table to this markdown file")
    parser.add_argument("--commit", default=git_commit(),
                        help="the commit to stamp (default: this checkout's; a device machine's copy of the tree "
                             "may carry an older .git)")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # a child's settings, as JSON
    args = parser.parse_args()
    if args.row is not None:
        print(json.dumps(measure_row(json.loads(args.row), args.steps, args.warmup)))
        return 0
    steps, warmup = (1, 1) if args.dry_run else (args.steps, args.warmup)
    rows = run_rows(args.dry_run, steps, warmup)
    verifies = run_verify(args.dry_run)
    device = next((r["device"] for r in rows if "device" in r), "unknown")
    text = table(rows, verifies)
    print(text)
    if args.results is not None:
        stamp = f"{datetime.date.today()}, commit {args.commit}, one {device}"
        with args.results.open("a") as out:
            out.write(f"\n### GPU check ({stamp}{', dry run' if args.dry_run else ''})\n\n"
                      f"`python benchmarks/gpu_check.py`: {warmup} warm-up + {steps} timed steps a row.\n\n{text}\n")
    print(json.dumps({"benchmark": "gpu_check", "dry_run": args.dry_run, "device": device, "commit": args.commit,
                      "rows": rows, "verify": verifies}))
    failed = [r for r in rows if "error" in r] + [v for v in verifies if not v.get("ok")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
