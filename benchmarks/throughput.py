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
median, as a markdown table and, on the last line, as JSON. On a GPU host the table also has
model FLOPs utilization: 6 x active parameters (for a mixture of experts, the router and the
top-k experts a token uses, not all E) + attention FLOPs per token, against the device's peak
dense FLOP/s in the compute dtype (train.precision: bf16/fp16 tensor cores, or TF32 for fp32).
"""

from __future__ import annotations

import json
import sys

from common import (
    host_batches,
    load_settings,
    markdown,
    parse_steps,
    run_line,
    step_parser,
    time_steps,
    time_trainer,
    trainer_on,
)

from jaxpar.config import ConfigError
from jaxpar.runtime import setup_devices
from jaxpar.validation import validate

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

from jaxpar.model import Transformer  # noqa: E402
from jaxpar.plan.model_flops import flops_per_token  # noqa: E402

# Peak dense FLOP/s per device by compute dtype (fp32 runs its matmuls as TF32), matched by
# substring of device_kind (first match wins). Vendor datasheet figures, without sparsity.
PEAK_FLOPS = {
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 378e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 495e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 495e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12},
}


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


def peak_flops(device, precision: str) -> float | None:
    """Peak dense FLOP/s of one device in the compute dtype: --peak-tflops, else by device_kind."""
    if ARGS.peak_tflops is not None:
        return ARGS.peak_tflops * 1e12
    return next((v[precision] for k, v in PEAK_FLOPS.items() if k in device.device_kind), None)


def main() -> int:
    """Time the baseline and each layout, then print the table and the JSON line."""
    cfg, devices, warmup = CFG, DEVICES, ARGS.warmup
    batches = host_batches(cfg, warmup + ARGS.steps)
    tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
    print(run_line(devices, cfg, warmup, ARGS.steps), file=sys.stderr)

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

    on_gpu = devices[0].platform == "gpu"
    per_token, peak = (flops_per_token(cfg), peak_flops(devices[0], cfg.train.precision)) if on_gpu else (None, None)
    base_tps = tokens_per_step / timed[0][2]
    rows = []
    for name, n, seconds in timed:
        tps = tokens_per_step / seconds
        row = {"layout": name, "devices": n, "median_step_ms": round(seconds * 1e3, 3),
               "tokens_per_s": round(tps, 1), "ratio_vs_baseline": round(tps / base_tps, 3)}
        if on_gpu:
            row["mfu"] = round(per_token * tps / (peak * n), 4) if peak else None
        rows.append(row)

    header = ["layout", "devices", "median step ms", "tokens/s", "ratio vs baseline"] + (["MFU"] if on_gpu else [])
    table = []
    for r in rows:
        cells = [r["layout"], str(r["devices"]), f"{r['median_step_ms']:.2f}", f"{r['tokens_per_s']:,.0f}",
                 f"{r['ratio_vs_baseline']:.2f}"]
        if on_gpu:
            cells.append(f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a")
        table.append(cells)
    print(markdown(header, table))
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
