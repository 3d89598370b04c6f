"""Where a train step's time goes: a jax.profiler trace of a few steps, broken down by XLA op.

Usage:
    python benchmarks/profile_step.py [CONFIG.yaml] [key=value ...] [--steps N] [--warmup W] [--top K]

It builds jaxpar's Trainer for the config (8 emulated CPU devices on a CPU-only host), runs W
untimed steps, then traces N steps with `jax.profiler.trace` and reads the trace back with
`jax.profiler.ProfileData`. Every op XLA ran (the thunk events of its worker threads) is named
by its HLO instruction, which the compiled step's text maps to an opcode and shape. Reported,
per step and per device (thread time divided by steps x devices):
  * categories: matmul (dot fusions), collective (all-gather, reduce-scatter, all-reduce,
    all-to-all, collective-permute), collective wait (rendezvous of the emulated devices),
    convert (dtype casts), other fusions (elementwise, reductions, softmax), copy/transpose,
    control (while, conditional), and idle workers waiting for each other;
  * the top K ops with their opcode and output shape.
Thread time on emulated devices is CPU time shared by all devices, so compare shares, not
absolute milliseconds, and only from runs on an otherwise idle machine. The machine's line
(jaxpar.runtime.machine: processor, native bf16, matmul rates) heads the tables; the last line is JSON.
benchmarks/fp32_ops.py gives the same step's ops by dtype from the compiled program alone.
"""

from __future__ import annotations

import collections
import glob
import json
import re
import sys
import tempfile

from common import git_commit, load_settings, machine_line, machine_record, parse_steps, step_parser

from jaxpar.runtime.devices import setup_devices

parser = step_parser(__doc__, steps=3, warmup=2, config_file=True, steps_help="traced steps (default %(default)s)",
                     warmup_help="untimed steps first, compile included (default %(default)s)")
parser.add_argument("--top", type=int, default=15, help="how many single ops to list (default 15)")
ARGS = parse_steps(parser)
CFG = load_settings(ARGS.settings)
setup_devices(CFG)  # before jax starts: emulated CPU devices

import jax  # noqa: E402

from jaxpar.train.run_session import prepare  # noqa: E402
from jaxpar.train.trainer import Trainer  # noqa: E402

COLLECTIVES = {"all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"}
# An HLO instruction line: "%name = type[shape]{layout} opcode(...), ..., kind=kCustom, calls=..."
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = (\S+?\[[^\]]*\])\S*\s+([\w-]+)\((.*)$")
# Thread-pool bookkeeping rather than work: left out, except waits, which are idle time.
_BOOKKEEPING = ("ThunkExecutor::Execute", "ThreadpoolListener")


def hlo_ops(hlo_text: str) -> dict[str, tuple[str, str, str]]:
    """Instruction name -> (opcode, output type, fusion kind) of the compiled step."""
    ops = {}
    for line in hlo_text.splitlines():
        if match := _INSTRUCTION.match(line):
            name, shape, opcode, rest = match.groups()
            kind = re.search(r"kind=(\w+)", rest)
            ops[name] = (opcode, shape, kind.group(1) if kind else "")
    return ops


def category(event: str, op: tuple[str, str, str] | None) -> str:
    if event.startswith("Wait"):
        return "idle workers"
    if event == "Rendezvous":
        return "collective wait"
    if op is None:
        return "other"
    opcode, _, kind = op
    if opcode in COLLECTIVES or opcode.endswith(("-start", "-done")) and opcode.rsplit("-", 1)[0] in COLLECTIVES:
        return "collective"
    if opcode == "dot" or (opcode == "fusion" and kind == "kCustom" and event.startswith(("ynn", "dot", "onednn"))):
        return "matmul"
    if opcode == "convert" or event.startswith(("wrapped_convert", "convert")):
        return "convert"
    if opcode in ("copy", "transpose") or event.startswith(("copy", "transpose")):
        return "copy/transpose"
    if opcode in ("while", "conditional", "call"):
        return "control"
    return "other fusions"


def trace_events(trace_dir: str) -> list[tuple[str, float]]:
    """(event name, seconds) of every event on XLA's CPU worker threads."""
    path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
    data = jax.profiler.ProfileData.from_file(path)
    events = []
    for plane in data.planes:
        for line in plane.lines:
            if line.name.startswith("tf_XLAEigen"):
                events += [(e.name, e.duration_ns / 1e9) for e in line.events if not e.name.startswith(_BOOKKEEPING)]
    return events


def main() -> int:
    session = prepare(CFG)
    machine = machine_record(session.devices)
    trainer = Trainer(session)
    ops = hlo_ops(trainer.compile_step().as_text())
    state = trainer.init()
    sampler = session.train_data
    for index in range(ARGS.warmup):
        state, metrics = trainer.step(state, trainer.put_windows(sampler, sampler.starts(index)))
        jax.block_until_ready(metrics)
    batches = [trainer.put_windows(sampler, sampler.starts(ARGS.warmup + i)) for i in range(ARGS.steps)]
    with tempfile.TemporaryDirectory(prefix="jaxpar-profile-") as trace_dir:
        with jax.profiler.trace(trace_dir):
            for batch in batches:
                state, metrics = trainer.step(state, batch)
                jax.block_until_ready(metrics)
        events = trace_events(trace_dir)
    per = ARGS.steps * len(session.devices)  # thread time per step and device
    by_category, by_op = collections.Counter(), collections.Counter()
    for name, seconds in events:
        by_category[category(name, ops.get(name))] += seconds / per
        if not name.startswith("Wait") and name != "Rendezvous":
            by_op[name] += seconds / per
    total = sum(by_category.values())
    print(machine_line(machine) + f"; jaxpar {git_commit()}")
    print(f"{session.mesh_name()}, zero {session.cfg.parallel.zero}, {session.cfg.train.precision}, "
          f"remat {session.cfg.train.remat}: "
          f"{total * 1e3:.1f} ms of thread time per step and device\n")
    print("| category | ms | share |\n| --- | --- | --- |")
    for name, seconds in by_category.most_common():
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / total:.1%} |")
    print("\n| op | opcode | shape | ms | share |\n| --- | --- | --- | --- | --- |")
    for name, seconds in by_op.most_common(ARGS.top):
        opcode, shape, _ = ops.get(name, ("?", "?", ""))
        print(f"| {name} | {opcode} | {shape} | {seconds * 1e3:.1f} | {seconds / total:.1%} |")
    print(json.dumps({"layout": session.mesh_name(), "machine": machine, "commit": git_commit(),
                      "zero": session.cfg.parallel.zero,
                      "precision": session.cfg.train.precision,
                      "ms_per_step_device": round(total * 1e3, 2),
                      "categories": {k: round(v / total, 4) for k, v in by_category.most_common()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
