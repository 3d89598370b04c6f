"""fp16 with dynamic loss scaling: skips overflowing steps exactly, rescues underflowing gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import SMALL_MODEL, metrics, run_jaxpar_commands_at_level_1

from jaxpar.config import ModelConfig
from jaxpar.config.precision import INITIAL_FP16_SCALE, POLICIES
from jaxpar.data import BatchSampler, load_tokens
from jaxpar.laid_out.forward import token_loss
from jaxpar.model import Transformer
from jaxpar.train.loss_scale import LossScale
from jaxpar.train.trainer import Trainer


@pytest.mark.slow
def test_fp16_follows_the_fp32_loss_curve(tmp_path):
    """The tiny preset's shape, 100 steps: fp16 with loss scaling stays within 2% of fp32 at every step.
    Both runs are `jaxpar train`, one after the other in one process at XLA's level 1: their time goes into
    the 100 steps, not the compile, and jax is imported once."""
    runs = {precision: ["train", "--no-progress", "configs/tiny_test.yaml", "mesh.data=8", "mesh.tensor=1",
                        "train.steps=100", f"train.precision={precision}", "train.log_every=1",
                        "train.sample_tokens=0", f"run.dir={tmp_path / precision}"] for precision in ("fp32", "fp16")}
    done = run_jaxpar_commands_at_level_1(*runs.values())
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {precision: metrics(tmp_path / precision) for precision in runs}
    losses = {precision: np.array([row["loss"] for row in history]) for precision, history in rows.items()}
    assert len(losses["fp16"]) == len(losses["fp32"]) == 100
    assert np.max(np.abs(losses["fp16"] - losses["fp32"]) / losses["fp32"]) < 0.02
    assert losses["fp16"][-1] < 0.6 * losses["fp16"][0]
    assert rows["fp16"][-1]["loss_scale"] == INITIAL_FP16_SCALE and rows["fp16"][-1]["skipped_steps"] == 0


@pytest.mark.slow
def test_overflowing_step_is_skipped_and_the_scale_halves(session_for):
    # the small model of the fp16 verify on the same layout
    session = session_for(*SMALL_MODEL, "mesh.data=4", "mesh.tensor=2", "train.precision=fp16")
    trainer = Trainer(session)
    state = trainer.init()
    for index in range(2):
        state, _ = trainer.step(state, trainer.put_batch(session.train_data.batch(index)))
    # Inject an overflow at step 3: a scale of 2^100 makes the fp16 backward pass infinite.
    huge = jax.device_put(jnp.asarray(2.0 ** 100, jnp.float32), trainer.replicated)  # placed: no recompile
    state = type(state)(state.step, state.params, state.opt_state,
                        LossScale(huge, state.loss_scale.good_steps, state.loss_scale.skipped_steps))
    before = jax.device_get((state.params, state.opt_state))
    state, metrics = trainer.step(state, trainer.put_batch(session.train_data.batch(2)))
    after = jax.device_get((state.params, state.opt_state))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)  # bit-identical
    assert float(state.loss_scale.scale) == 2.0 ** 99
    assert int(metrics["skipped_steps"]) == 1 and int(state.step) == 3
    # the next step with the halved (still huge) scale is skipped again; training is not stuck on NaN
    state, metrics = trainer.step(state, trainer.put_batch(session.train_data.batch(3)))
    assert int(metrics["skipped_steps"]) == 2 and float(state.loss_scale.scale) == 2.0 ** 98


def test_scale_doubles_after_a_window_of_good_steps():
    scale = LossScale.initial(POLICIES["fp16"])
    good = jnp.asarray(True)
    scale = scale.update(good, window=2)
    assert float(scale.scale) == INITIAL_FP16_SCALE and int(scale.good_steps) == 1
    scale = scale.update(good, window=2)
    assert float(scale.scale) == 2 * INITIAL_FP16_SCALE and int(scale.good_steps) == 0
    scale = scale.update(jnp.asarray(False), window=2)
    assert float(scale.scale) == INITIAL_FP16_SCALE and int(scale.skipped_steps) == 1
    assert float(LossScale.initial(POLICIES["bf16"]).scale) == 1.0


@pytest.mark.slow
def test_gradients_that_underflow_in_fp16_survive_with_loss_scaling():
    """A small loss term (weight 1e-4) has gradients below fp16's range; scaling brings them back."""
    cfg = ModelConfig()
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    tokens = BatchSampler(load_tokens("builtin", 256), cfg.seq_len, 32, 0).batch(0)

    # one compiled gradient per precision (run op by op, the four gradients compiled 114 programs)
    jitted = {precision: jax.jit(jax.grad(lambda p, weight, scale, precision=precision:
                                          token_loss(graphdef, p, tokens, POLICIES[precision]) * weight * scale))
              for precision in ("fp32", "fp16")}

    def grads(precision, scale, weight=1e-4):
        g = jitted[precision](params, jnp.float32(weight), jnp.float32(scale))
        return np.asarray(g["blocks"]["mlp"]["w_up"].get_value()) * (weight * 1e4) / scale

    def error(g):
        return np.linalg.norm(g - reference) / np.linalg.norm(reference)

    reference = grads("fp32", 1.0)
    unscaled = grads("fp16", 1.0)
    scaled = grads("fp16", INITIAL_FP16_SCALE)
    alive = reference != 0
    assert np.mean(unscaled[alive] == 0) > 0.5, "without scaling most of these gradients flush to zero"
    assert np.mean(scaled[alive] == 0) < 0.01
    # Scaling adds nothing to fp16's own rounding: the scaled gradients are at least as close to
    # fp32 as fp16's gradients of the same loss at weight 1, where nothing underflows (measured:
    # about 1.0% against 3.3%; unscaled, more than half of them are lost).
    assert error(scaled) <= error(grads("fp16", 1.0, weight=1.0))


TINY = ("model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.n_layers=2", "model.seq_len=16",
        "train.batch_size=8")


@pytest.mark.slow
def test_fp32_nonfinite_step_is_skipped_under_on_nonfinite_skip(session_for):
    """fp32 with train.on_nonfinite=skip: a step whose gradients are not finite leaves parameters and
    optimizer state bit-identical and counts one skipped step; the next finite step updates again."""
    session = session_for(*TINY, "mesh.data=8", "train.on_nonfinite=skip")
    trainer = Trainer(session)
    state, _ = trainer.step(trainer.init(), trainer.put_batch(session.train_data.batch(0)))
    assert int(state.loss_scale.skipped_steps) == 0
    # Inject: fp32 keeps a constant loss scale of 1; an infinite one makes every gradient inf/nan.
    # (Placed like the state's scalars, so the step is not compiled again.)
    infinite = jax.device_put(jnp.asarray(jnp.inf, jnp.float32), trainer.replicated)
    state = type(state)(state.step, state.params, state.opt_state,
                        LossScale(infinite, state.loss_scale.good_steps, state.loss_scale.skipped_steps))
    before = jax.device_get((state.params, state.opt_state))
    state, metrics = trainer.step(state, trainer.put_batch(session.train_data.batch(1)))
    after = jax.device_get((state.params, state.opt_state))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)  # bit-identical
    assert not np.isfinite(float(metrics["grad_norm"]))
    assert int(metrics["skipped_steps"]) == 1 and int(state.step) == 2
    # back to a scale of 1: the next step is finite and applied, and the count stays at 1
    one = jax.device_put(jnp.asarray(1.0, jnp.float32), trainer.replicated)
    state = type(state)(state.step, state.params, state.opt_state,
                        LossScale(one, state.loss_scale.good_steps, state.loss_scale.skipped_steps))
    state, metrics = trainer.step(state, trainer.put_batch(session.train_data.batch(2)))
    assert np.isfinite(float(metrics["grad_norm"])) and int(metrics["skipped_steps"]) == 1
    moved = jax.device_get(state.params)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(moved)))


@pytest.mark.slow
def test_on_nonfinite_skip_trains_on_where_stop_would_end_the_run(tmp_path, capsys):
    """The loop under train.on_nonfinite=skip: a learning rate of 1e30 overflows the weights after
    step 1, every later step is skipped and counted, and the run ends normally (exit 0). (The stop
    side, exit 1 with one sentence, is tests/test_checkpoint.py's non-finite test.)"""
    import json

    from jaxpar.cli import main

    run_dir = tmp_path / "run"
    code = main(["train", "--no-progress", *TINY, "run.devices=1", "train.steps=4", "train.log_every=1",
                 "train.eval_batches=1", "train.lr=1e30", "train.warmup=0", "train.on_nonfinite=skip",
                 f"run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 0, err
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert np.isfinite(rows[0]["grad_norm"]) and rows[0]["skipped_steps"] == 0
    assert [r["skipped_steps"] for r in rows[1:]] == [1, 2, 3]
    assert not any(np.isfinite(r["grad_norm"]) for r in rows[1:])


def _fp32_matmul_share(trainer) -> float:
    """The share of the compiled step's matmul FLOPs whose operands are fp32 (loop trip counts included)."""
    import math
    import re

    from jaxpar.plan.hlo import array_shapes, parse

    module = parse(trainer.compile_step().as_text())
    flops = {"f32": 0.0, "other": 0.0}
    for name, instructions in module.computations.items():
        shapes = {i.name: i.shape for i in instructions}
        for inst in (i for i in instructions if i.op == "dot"):
            lhs, rhs = (array_shapes(shapes[o])[0] for o in re.findall(r"%([^\s,)]+)", inst.rest)[:2])
            contracted = math.prod(lhs[1][int(d)] for d in re.search(r"lhs_contracting_dims=\{([\d,]*)\}",
                                                                       inst.rest)[1].split(","))
            work = 2 * math.prod(array_shapes(inst.shape)[0][1]) * contracted * module.executions(name)
            flops["f32" if "f32" in (lhs[0], rhs[0]) else "other"] += work
    return flops["f32"] / (flops["f32"] + flops["other"])


@pytest.mark.parametrize("chunks", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_bf16_step_runs_the_output_projection_backward_in_bf16(session_for, chunks):
    """A model whose step is mostly the output projection (vocabulary 4096, width 64): its fp32 logits'
    gradient re-enters the backward matmuls in bf16 (the policy's output_grad), so next to no matmul
    FLOPs have fp32 operands (autodiff's fp32 gradient would make 2/3 of the projection's fp32: over
    half the step). Compile only, with and without loss chunks."""
    session = session_for("model.vocab_size=4096", "model.d_model=64", "model.n_layers=1", "model.d_ff=128",
                          "model.seq_len=64", "train.batch_size=8", "mesh.data=8", "mesh.tensor=1",
                          "train.precision=bf16", "model.tie_embeddings=false", f"train.loss_chunks={chunks}")
    assert session.precision.output_grad == "bfloat16"
    assert _fp32_matmul_share(Trainer(session)) < 0.02
