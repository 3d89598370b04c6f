"""Training throughput of jaxpar layouts against a plain single-device JAX train step.

Usage:
    python benchmarks/throughput.py [CONFIG.yaml] [key=value ...] [--steps N] [--warmup W]
                                    [--peak-tflops T]

The config is jaxpar's (defaults: the tiny model). In one process the script times
  * a baseline: a hand-written `jax.jit` AdamW step of the same model and global batch on
    devices[0], without any jaxpar machinery (no Trainer, rules or make_train_step), and
  * jaxpar's Trainer on data=N (all devices on data) and data=N/2 x tensor=2, N being the
    device count (8 emulated CPU devices on a CPU-only host).
Each runs W warm-up steps (compilation included), then N steps timed one by one, each ending
in `jax.block_until_ready`. Reported: median step time and tokens/s = batch_size*seq_len /
median, and model FLOPs utilization, as a markdown table under the machine's line and, on the
last line, as JSON. MFU is jaxpar.train.model_flops: 6 x the active parameters a token multiplies
by (for a mixture of experts, the router and the top-k experts a token uses, not all E) +
attention FLOPs per token, against the peak in the compute dtype (the precision policy's): on a
CPU the machine's measured 2048^3 matmul rate (jaxpar.runtime.machine, measured at the start; every
emulated device shares it), on a GPU its datasheet peak x the devices (bf16/fp16 tensor cores,
TF32 for fp32; --peak-tflops overrides the per-device peak).
"""

from __future__ import annotations

import json
import sys

from common import (
    host_batches,
    load_settings,
    machine_line,
    machine_record,
    markdown,
    parse_steps,
    run_line,
    step_parser,
    time_steps,
    time_trainer,
    trainer_on,
)

from jaxpar.config import ConfigError
from jaxpar.features.validation import validate
from jaxpar.runtime.devices import setup_devices

# jax must not start before setup_devices has set XLA_FLAGS (emulated CPU devices).
parser = step_parser(__doc__, steps=10, warmup=3, config_file=True)
parser.add_argument("--peak-tflops", type=float, default=None,
                    help="peak dense TFLOP/s per device in the compute dtype, for MFU")
ARGS = parse_steps(parser)
CFG = load_settings(ARGS.settings)
DEVICES = setup_devices(CFG)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.config import precision  # noqa: E402
from jaxpar.model import Transformer  # noqa: E402
from jaxpar.train.model_flops import utilization  # noqa: E402


def baseline_seconds(cfg, device, batches: list[np.ndarray], warmup: int) -> float:
    """Time a plain jitted train step of the same model on one device, without jaxpar's trainer."""
    t = cfg.train
    graphdef, params = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(t.seed)))
    compute_dtype = jnp.bfloat16 if t.precision == "bf16" else jnp.float32
    # Same clipping and AdamW hyperparameters as jaxpar (no decay on norm scales), but a
    # constant learning rate instead of warmup + cosine: the schedule costs nothing measurable.
    # The whole batch is one pass (train.grad_accum is not applied here).
    decay = jax.tree_util.tree_map_with_path(lambda path, _: "norm" not in jax.tree_util.keystr(path), params)
    tx = optax.chain(optax.clip_by_global_norm(t.clip_norm),
                     optax.adamw(t.lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=t.weight_decay, mask=decay))
    # Commit the whole state to the device, or the second call would recompile for committed inputs.
    state = jax.device_put((params, tx.init(params)), device)

    def loss_fn(params, tokens_BT):
        model = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(compute_dtype), params))
        logits = model(tokens_BT[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BT[:, 1:]).mean()

    def train_step(state, tokens_BT):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens_BT)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    step = jax.jit(train_step, donate_argnums=0)
    return time_steps(step, state, lambda b: jax.device_put(b, device), batches, warmup)[0]


def layouts(n: int) -> list[tuple[int, int]]:
    """(data, tensor) sizes to try on n devices: all on data, then half data x tensor=2."""
    return [(n, 1)] + ([(n // 2, 2)] if n >= 2 and n % 2 == 0 else [])


def trainer_seconds(cfg, devices, batches: list[np.ndarray], warmup: int) -> float:
    """Time jaxpar's Trainer step for cfg's mesh over `devices`."""
    return time_trainer(trainer_on(cfg, devices), batches, warmup)[0]


def mfu(cfg, tokens_per_s: float, devices: list, record: dict) -> dict:
    """utilization() of a row run on `devices`: against --peak-tflops per device when given."""
    compute = precision.of(cfg).compute
    found = utilization(cfg, tokens_per_s, devices, compute, record)
    if ARGS.peak_tflops is not None:
        peak = ARGS.peak_tflops * 1e12 * len(devices)
        found = {**found, "mfu": found["model_flops_per_token"] * tokens_per_s / peak, "peak_flops": peak,
                 "peak_source": f"--peak-tflops {ARGS.peak_tflops:g}"}
    return found


def main() -> int:
    """Time the baseline and each layout, then print the table and the JSON line."""
    cfg, devices, warmup = CFG, DEVICES, ARGS.warmup
    batches = host_batches(cfg, warmup + ARGS.steps)
    tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
    print(run_line(devices, cfg, warmup, ARGS.steps), file=sys.stderr)
    record = machine_record(devices, tuple(dict.fromkeys(("float32", "bfloat16", precision.of(cfg).compute))))

    try:  # the model and training settings themselves, before anything is compiled
        validate(cfg.replace(**{"mesh.data": 1, "mesh.tensor": 1, "mesh.expert": 1, "mesh.stage": 1}), 1)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    timed = [("baseline (plain jit, 1 device)", 1, baseline_seconds(cfg, devices[0], batches, warmup))]
    for data, tensor in layouts(len(devices)):
        name = f"data={data}" + (f" x tensor={tensor}" if tensor > 1 else "")
        layout_cfg = cfg.replace(**{"mesh.data": data, "mesh.tensor": tensor, "mesh.expert": 1, "mesh.stage": 1})
        try:
            timed.append((name, len(devices), trainer_seconds(layout_cfg, devices, batches, warmup)))
        except ConfigError as e:
            print(f"skipping {name}: {e}")

    base_tps = tokens_per_step / timed[0][2]
    rows = []
    for name, n, seconds in timed:
        tps = tokens_per_step / seconds
        used = mfu(cfg, tps, devices[:n], record)
        rows.append({"layout": name, "devices": n, "median_step_ms": round(seconds * 1e3, 3),
                     "tokens_per_s": round(tps, 1), "ratio_vs_baseline": round(tps / base_tps, 3),
                     "mfu": None if used["mfu"] is None else round(used["mfu"], 4), "peak_source": used["peak_source"]})

    header = ["layout", "devices", "median step ms", "tokens/s", "ratio vs baseline", "MFU"]
    table = [[r["layout"], str(r["devices"]), f"{r['median_step_ms']:.2f}", f"{r['tokens_per_s']:,.0f}",
              f"{r['ratio_vs_baseline']:.2f}", f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"] for r in rows]
    print(machine_line(record) + f"; MFU against {rows[0]['peak_source']}\n")
    print(markdown(header, table))
    print(json.dumps({"benchmark": "throughput", "machine": record, "precision": cfg.train.precision,
                      "model_flops_per_token": used["model_flops_per_token"], "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
