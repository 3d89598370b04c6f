"""What the benchmark scripts share: their command line and config, the device line of their
stderr header, the host batches every layout gets, step timing, markdown tables and figures.

Importing this module imports nothing outside the standard library, so the scripts import it
first: jax must not start before `jaxpar.runtime.devices.setup_devices` has set XLA_FLAGS (emulated CPU
devices), and peer_maxtext.py runs on any Python, jaxpar or not. Each helper imports what it
uses when it is called; the ones that start jax (time_steps, time_trainer, trainer_on) only
after the script has set up its devices.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"  # where the figures go
REPO = Path(__file__).resolve().parent.parent


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


# ---------------------------------------------------------------- command line and config

def step_parser(doc: str, *, steps: int, warmup: int, config_file: bool = False,
                steps_help: str = "timed steps per layout (default %(default)s)",
                warmup_help: str = "untimed warm-up steps, compile included (default %(default)s)",
                ) -> argparse.ArgumentParser:
    """The parser of a script that runs train steps, described by the first line of `doc`: the
    config settings (key=value overrides, after an optional CONFIG.yaml with `config_file`), then
    --steps and --warmup with these defaults; the script adds its own options after them."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    if config_file:
        parser.add_argument("settings", nargs="*", help="an optional CONFIG.yaml, then key=value overrides")
    else:
        parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--steps", type=int, default=steps, help=steps_help)
    parser.add_argument("--warmup", type=int, default=warmup, help=warmup_help)
    return parser


def parse_steps(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The command line, with --steps and --warmup at least 1 (else usage and exit status 2)."""
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1")
    return args


def load_settings(settings: list[str]):
    """jaxpar's config from the optional CONFIG.yaml among `settings` (a word ending in .yaml or
    .yml, without '='), then the other words as key=value overrides."""
    from jaxpar.config.presets import load_config

    yaml = [a for a in settings if a.endswith((".yaml", ".yml")) and "=" not in a]
    return load_config(yaml[0] if yaml else None, [a for a in settings if a not in yaml])


def device_line(devices: list) -> str:
    """'8 x cpu (cpu)': how many devices, of which kind, on which platform."""
    return f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform})"


def run_line(devices: list, cfg, warmup: int, steps: int) -> str:
    """The devices, the global batch and the steps of a timing run, for its stderr header."""
    return (f"{device_line(devices)}; batch {cfg.train.batch_size} x seq {cfg.model.seq_len}; "
            f"{warmup} warm-up + {steps} timed steps")


def machine_record(devices: list, dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> dict:
    """jaxpar.runtime.machine's record of the machine: processor, native bf16, and a 2048^3 matmul's rate in
    each of `dtypes`, measured now (a few seconds on a CPU). Every timing table carries it."""
    from jaxpar.runtime import machine

    return machine.describe(devices, dtypes)


def machine_line(record: dict) -> str:
    """'machine: AMD EPYC, 2 cores, no native bf16; 2048^3 matmul: fp32 95 GFLOP/s, bf16 16 GFLOP/s'."""
    from jaxpar.runtime import machine

    return f"machine: {machine.line(record)}"


# ---------------------------------------------------------------- batches, trainer, timing

def host_batches(cfg, count: int) -> list:
    """`count` (batch_size, seq_len+1) token batches (numpy), the same for every layout."""
    from jaxpar.data import BatchSampler, load_tokens, split_tokens

    m, t = cfg.model, cfg.train
    train_tokens, _ = split_tokens(load_tokens(cfg.data.source, m.vocab_size), cfg.data.val_fraction, m.seq_len)
    sampler = BatchSampler(train_tokens, m.seq_len, t.batch_size, t.seed)
    return [sampler.batch(i) for i in range(count)]


def trainer_on(cfg, devices: list):
    """jaxpar's Trainer for `cfg` on `devices` (already set up): `jaxpar.session.on_devices`
    validates the config and builds its mesh (raises UserError), then `Trainer(session)`."""
    from jaxpar.session import on_devices
    from jaxpar.train.trainer import Trainer

    return Trainer(on_devices(cfg, devices))


def time_steps(step, state, put, batches: list, warmup: int):
    """Run `state, out = step(state, batch)` over the batches; return (median seconds of the steps
    after `warmup`, the last step's output, the final state).

    Each batch is transferred (and waited for) before its timer starts, so host-to-device
    copies are excluded for every layout alike; each step is waited for before its timer stops.
    """
    import jax

    times, out = [], None
    for i, host in enumerate(batches):
        batch = jax.block_until_ready(put(host))
        start = time.perf_counter()
        state, out = step(state, batch)
        jax.block_until_ready((state, out))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), out, state


def time_trainer(trainer, batches: list, warmup: int):
    """`time_steps` of a Trainer's step from a freshly initialized state."""
    return time_steps(trainer.step, trainer.init(), trainer.put_batch, batches, warmup)


# ---------------------------------------------------------------- tables and figures

def markdown(header: list[str], rows: list[list]) -> str:
    """A markdown table from a header and rows of cells (already formatted)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display); ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Lay `fig` out tightly, write it to `path` (creating its folder), then close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


# ---------------------------------------------------------------- training curves

def curves_setup(doc: str, *, steps: int, min_steps: int, layout: list[str]):
    """(steps, base config, devices) of a script comparing training curves: its command line
    ([key=value ...] [--steps N], described by the first line of `doc`), the config of `layout`
    then the overrides, and the devices set up for it."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("settings", nargs="*", help="key=value overrides")
    parser.add_argument("--steps", type=int, default=steps, help="training steps of each run (default %(default)s)")
    args = parser.parse_args()
    if args.steps < min_steps:
        parser.error(f"--steps must be at least {min_steps}")
    base = load_settings([*layout, f"train.steps={args.steps}", *args.settings])
    from jaxpar.runtime.devices import setup_devices

    return args.steps, base, setup_devices(base)


def train_losses(cfg, devices: list, steps: int) -> tuple[list[float], float]:
    """(the training loss of each of `steps` steps of `cfg` from a fresh state, the median seconds
    of a step after the first, which compiles), on the batches jaxpar's loop would feed it
    (`RunSession.train_data`). Each step is waited for before the next is timed."""
    from jaxpar.train.run_session import prepare
    from jaxpar.train.trainer import Trainer

    session = prepare(cfg, devices)
    trainer = Trainer(session)
    state, losses, seconds = trainer.init(), [], []
    for index in range(steps):
        start = time.perf_counter()
        state, metrics = trainer.step(state, trainer.put_windows(session.train_data, session.train_data.starts(index)))
        losses.append(float(metrics["loss"]))
        seconds.append(time.perf_counter() - start)
    return losses, statistics.median(seconds[1:])


def data_axis_bytes_sent(cfg, devices: list) -> int:
    """Bytes each device sends per step over the `data` mesh axis (ring algorithms), from the
    compiled step (`jaxpar.plan.measure_step`): every collective whose groups span `data`, each
    counted as often as the program runs it (a conditional's branch: once)."""
    from jaxpar.plan import measure_step

    plan = measure_step(trainer_on(cfg, devices))
    return sum(op["wire_bytes"] * op["count"] for op in plan["collective_ops"] if "data" in op["mesh_axes"])
