"""train.precision=fp8: the fp8 GEMM against a quantization written here in NumPy (ml_dtypes' fp8 casts), its
f8 operands in the program, current scaling through an amax jump, the power-of-two scale's invariance, the
layouts against their one-device fp8 reference, and the config it refuses."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import SMALL_MODEL
from jax.extend import core as jex_core

from jaxpar.cli import main
from jaxpar.config.precision import INITIAL_FP16_SCALE, POLICIES, of
from jaxpar.config.presets import load_config
from jaxpar.features import layout_name, problem
from jaxpar.model.fp8 import E4M3, E5M2, fp8_einsum, fp8_ragged_dot, quantize
from jaxpar.sampling.batched import BatchedGenerator, Shape
from jaxpar.sampling.choice import Sampling
from jaxpar.train.trainer import Trainer
from jaxpar.verify import run as verify_module
from jaxpar.verify.run import reference_config, verify

NP_FP8 = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}


def reference_quantized(x: np.ndarray, dtype) -> np.ndarray:
    """x rounded as fp8 with the power-of-two scale 2^floor(log2(max / amax)), descaled, in float64."""
    top = float(ml_dtypes.finfo(NP_FP8[dtype]).max)
    scale = 2.0 ** np.floor(np.log2(top / np.max(np.abs(x))))
    return (x * scale).astype(np.float32).astype(NP_FP8[dtype]).astype(np.float64) / scale


def _random(key: int, shape, scale=1.0) -> np.ndarray:
    return scale * np.asarray(jax.random.normal(jax.random.key(key), shape, jnp.float32), np.float64)


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def _dots(jaxpr) -> list[tuple[str, str]]:
    """The operand dtypes of every dot in a jaxpr, its sub-jaxprs' (jit, scans, custom VJPs) included."""
    return [pair[:2] for pair in _dots_out(jaxpr)]


def _dots_out(jaxpr) -> list[tuple[str, str, tuple]]:
    """(operand dtype, operand dtype, result shape) of every dot in a jaxpr and its sub-jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
            found.append((str(eqn.invars[0].aval.dtype), str(eqn.invars[1].aval.dtype), eqn.outvars[0].aval.shape))
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(item, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
                    found += _dots_out(getattr(item, "jaxpr", item))
    return found


def test_fp8_einsum_and_its_gradients_match_a_numpy_quantization():
    x, w, g = _random(0, (4, 8, 32)), _random(1, (32, 3, 16), 0.05), _random(2, (4, 8, 3, 16), 1e-3)
    y, pullback = jax.vjp(lambda a, b: fp8_einsum("BLD,DQF->BLQF", a, b), jnp.float32(x), jnp.float32(w))
    dx, dw = pullback(jnp.float32(g))
    xq, wq, gq = reference_quantized(x, E4M3), reference_quantized(w, E4M3), reference_quantized(g, E5M2)
    assert _rel(y, np.einsum("BLD,DQF->BLQF", xq, wq)) < 1e-6
    assert _rel(dx, np.einsum("BLQF,DQF->BLD", gq, wq)) < 1e-6
    assert _rel(dw, np.einsum("BLD,BLQF->DQF", xq, gq)) < 1e-6
    # and quantized it is: e4m3 (3 mantissa bits) and e5m2 (2) are far from the exact product
    assert _rel(y, np.einsum("BLD,DQF->BLQF", x, w)) > 1e-2 and _rel(dw, np.einsum("BLD,BLQF->DQF", x, g)) > 1e-2


def test_fp8_ragged_dot_and_its_gradients_match_a_numpy_quantization():
    sizes = np.array([3, 0, 5, 2])  # 10 rows of 12: the last two belong to no group
    x, w, g = _random(3, (12, 16)), _random(4, (4, 16, 8)), _random(5, (12, 8))
    y, pullback = jax.vjp(lambda a, b: fp8_ragged_dot(a, b, jnp.asarray(sizes, jnp.int32)), jnp.float32(x),
                          jnp.float32(w))
    dx, dw = pullback(jnp.float32(g))
    xq, wq, gq = reference_quantized(x, E4M3), reference_quantized(w, E4M3), reference_quantized(g, E5M2)
    group = np.repeat(np.arange(4), sizes)  # each row's group
    rows = len(group)
    want_y, want_dx, want_dw = np.zeros((12, 8)), np.zeros((12, 16)), np.zeros((4, 16, 8))
    want_y[:rows] = np.einsum("MK,MKN->MN", xq[:rows], wq[group])
    want_dx[:rows] = np.einsum("MN,MKN->MK", gq[:rows], wq[group])
    np.add.at(want_dw, group, np.einsum("MK,MN->MKN", xq[:rows], gq[:rows]))
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_the_dots_multiply_f8_operands_forward_and_backward():
    """In the jaxpr and in the lowered program XLA compiles: e4m3 x e4m3 forward; e5m2 x e4m3 (dx) and
    e4m3 x e5m2 (dw) backward, never e5m2 x e5m2."""
    x, w = jnp.ones((4, 16), jnp.bfloat16), jnp.ones((16, 8), jnp.bfloat16)

    def loss(x, w):
        return jnp.sum(fp8_einsum("MK,KN->MN", x, w).astype(jnp.float32) ** 2)

    grads = jax.grad(loss, (0, 1))
    assert sorted(_dots(jax.make_jaxpr(grads)(x, w).jaxpr)) == sorted([("float8_e4m3fn", "float8_e4m3fn"),
                                                                  ("float8_e5m2", "float8_e4m3fn"),
                                                                  ("float8_e4m3fn", "float8_e5m2")])
    lowered = jax.jit(grads).lower(x, w).as_text()
    dots = [line for line in lowered.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 3 and all("f8E4M3FN" in line for line in dots)
    assert sum("f8E5M2" in line for line in dots) == 2
    dx, dw = jax.jit(grads)(x, w)  # XLA:CPU runs it (upcasting inside the dot)
    assert np.all(np.isfinite(np.asarray(dx, np.float32))) and np.all(np.isfinite(np.asarray(dw, np.float32)))


def test_saved_residuals_keep_e4m3fns_top_binade():
    """Under jax.checkpoint with a policy that saves the residuals (ZeRO-3's layer policy does), the f8
    residuals come back whole: every amax lands in e4m3fn's top binade (256 to 448), which jax's remat
    would turn into infinity were they saved as floats (reduce_precision reads e4m3 as IEEE, max 240)."""
    x, w, g = _random(11, (16, 32)), _random(12, (32, 24)), _random(13, (16, 24))

    def pullback(policy):
        f = jax.checkpoint(lambda a, b: fp8_einsum("MK,KN->MN", a, b), policy=policy)
        return jax.jit(lambda a, b, c: jax.vjp(f, a, b)[1](c))(jnp.float32(x), jnp.float32(w), jnp.float32(g))

    saved, recomputed = pullback(jax.checkpoint_policies.everything_saveable), pullback(None)
    for a, b in zip(saved, recomputed):
        assert np.all(np.isfinite(np.asarray(a))) and np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("jump", [1e2, 1e4])
def test_current_scaling_takes_an_amax_jump_in_the_same_step(jump):
    """One compiled program, called with a tensor and then with the same tensor `jump` times larger: its
    scale follows at once, so the outputs and gradients stay finite and as accurate as before (e4m3 rounds
    to 2^-4 of a value, e5m2 to 2^-3). The previous call's scale, as delayed scaling would use it, would
    have sent the large tensor out of e4m3's range."""
    x, w, g = _random(6, (32, 64)), _random(7, (64, 48), 0.1), _random(8, (32, 48))
    step = jax.jit(lambda a, b, c: jax.vjp(lambda p, q: fp8_einsum("MK,KN->MN", p, q), a, b)[1](c)
                   + (fp8_einsum("MK,KN->MN", a, b),))
    errors = []
    for factor in (1.0, jump):
        dx, dw, y = (np.asarray(v, np.float64) for v in step(jnp.float32(x * factor), jnp.float32(w),
                                                             jnp.float32(g)))
        assert np.all(np.isfinite(y)) and np.all(np.isfinite(dx)) and np.all(np.isfinite(dw))
        errors.append((_rel(y, factor * x @ w), _rel(dx, g @ w.T), _rel(dw, factor * x.T @ g)))
    for before, after in zip(*errors):  # y, dx, dw: as accurate after the jump as before it
        assert after < 2.0 ** -3 and abs(after - before) < 0.1 * before
    assert errors[1][0] < 2.0 ** -4  # the forward product, all e4m3 (measured: 3.9%; the gradients' 5.9%)
    stale = quantize(jnp.float32(x), E4M3)[1]  # 1 / the first call's scale
    assert not np.all(np.isfinite(np.asarray((jnp.float32(x * jump) / stale).astype(E4M3), np.float32)))


def test_power_of_two_scales_quantize_alike_whatever_the_amax_except_the_subnormal_tail():
    """A tensor quantized with its whole amax, and each half with its own (a shard, a microbatch), gives the
    same values except where a scaled value is one of e4m3's subnormals (below 2^-6). A scale of max / amax,
    not a power of two, differs almost everywhere."""
    magnitudes = np.exp(_random(9, (2, 4096), 3.0))  # a wide range, so some values fall into the tail
    x = np.where(_random(10, (2, 4096)) > 0, 1.0, -1.0) * magnitudes
    x[0] /= 37.0  # the halves' amaxes differ by far more than a factor of 2
    x = x.astype(np.float32)
    whole_q, whole_inverse = quantize(jnp.asarray(x), E4M3)
    whole = np.asarray(whole_q, np.float64) * float(whole_inverse)
    parts = [quantize(jnp.asarray(half), E4M3) for half in x]
    halves = np.stack([np.asarray(q, np.float64) * float(inverse) for q, inverse in parts])
    half_inverses = np.array([[float(inverse)] for _, inverse in parts])
    tail = (np.abs(x) / float(whole_inverse) < 2.0 ** -6) | (np.abs(x) / half_inverses < 2.0 ** -6)
    assert np.array_equal(whole[~tail], halves[~tail])
    assert tail.any() and not np.array_equal(whole[tail], halves[tail])  # the tail is there, and differs
    # the first half's own scale max / amax against the whole's: not a power of two apart (x[1] holds the
    # whole's amax, so its scale is the whole's either way)
    exact = [(h * (448.0 / np.abs(h).max())).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
             / (448.0 / np.abs(h).max()) for h in (x, x[0])]
    assert np.mean(exact[0][0][~tail[0]] == exact[1][~tail[0]]) < 0.1


# fp8 layouts against their one-device fp8 reference (jaxpar.config.precision: FP8_TOLERANCES)
MOE = ("model.moe.experts=8", "model.moe.every=2", "model.n_layers=2")
DATA_TENSOR = ("mesh.data=4", "mesh.tensor=2")  # verified by the ten-step test below
FP8_LAYOUTS = {
    "data=4 x tensor=2, sequence parallel": ("mesh.data=4", "mesh.tensor=2", "parallel.sequence=true"),
    # bf16 key/value gradients summed over context (an XLA:CPU abort once: jaxpar.parallel.reductions)
    "data=2 x context=4, all-gather": ("mesh.data=2", "mesh.context=4", "parallel.context_attention=allgather"),
    "top-k experts, data=4 x expert=2": (*MOE, "model.moe.router=topk", "mesh.data=4", "mesh.expert=2"),
    "dropless experts, data=2 x expert=4, ragged": (*MOE, "model.moe.router=dropless", "mesh.data=2", "mesh.expert=4",
                                                    "parallel.expert_dispatch=ragged"),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", FP8_LAYOUTS)
def test_fp8_layout_matches_its_fp8_reference(layout, session_for):
    result = verify(session_for("train.steps=3", *SMALL_MODEL, "train.precision=fp8", *FP8_LAYOUTS[layout]),
                    log=lambda line: None)
    assert result["ok"], result
    assert result["loss_max_rel_err"] <= POLICIES["fp8"].tolerances[0]
    assert result["update_max_rel_err"] <= POLICIES["fp8"].update_tolerance
    assert result.get("routing_changes", {}).get("flips", 0) == 0


@pytest.mark.slow
def test_fp8_verify_tells_its_reference_from_bf16_gemms(session_for, monkeypatch):
    """Ten steps: against the one-device fp8 reference the layout stays within fp8's tolerances, its rounding share
    too (jaxpar.config.precision.FP8_ROUNDING_SHARE: it does not grow with the steps); against a reference whose
    GEMMs run in bf16, gauged by fp8's, it sits a whole rounding away and fails at the first step."""
    args = ("train.steps=10", *SMALL_MODEL, "train.precision=fp8", *DATA_TENSOR)
    result = verify(session_for(*args), log=lambda line: None)
    assert result["ok"], result
    original = verify_module.reference_config
    # the reference with bf16 GEMMs, gauged by the fp8 one
    monkeypatch.setattr(verify_module, "gauge_config", original)
    monkeypatch.setattr(verify_module, "reference_config", lambda cfg: original(cfg).replace(
        **{"train.precision": "bf16"}))
    result = verify(session_for(*args), log=lambda line: None)
    assert result["first_rounding_share"] > POLICIES["fp8"].rounding_share[0], result


@pytest.mark.slow
def test_the_step_its_evaluation_and_generation_multiply_in_fp8_but_not_the_logits(session_for):
    """The layout's hooks carry the policy's GEMM into every program of a run: the train step (e4m3 forward,
    e5m2 x e4m3 backward), the validation loss and batched decoding (e4m3); the logits stay bf16 x bf16."""
    session = session_for(*SMALL_MODEL, "model.d_ff=128", "model.n_layers=2", "train.precision=fp8", "mesh.data=4",
                          "mesh.tensor=2")  # d_ff != vocab_size: the logits are the dots into 256 columns
    trainer = Trainer(session)
    state, batch = trainer.init(), trainer.put_batch(session.train_data.batch(0))
    step_dots = _dots_out(jax.make_jaxpr(trainer.step)(state, batch).jaxpr)
    eval_dots = _dots_out(jax.make_jaxpr(trainer.eval_loss)(state.params, batch).jaxpr)
    generator = BatchedGenerator(trainer.graphdef, session.cfg.model, session.precision, Shape(4, 8, 4), Sampling(),
                                 layout=trainer.layout)
    prompts = [jnp.zeros((4, 8), jnp.int32), jnp.zeros((4,), jnp.int32), jnp.arange(4, dtype=jnp.int32)]
    decode_dots = _dots_out(jax.make_jaxpr(generator._generate)(state.params, *prompts).jaxpr)
    vocab = session.cfg.model.vocab_size
    e4m3, e5m2 = "float8_e4m3fn", "float8_e5m2"
    assert {(a, b) for a, b, _ in step_dots} >= {(e4m3, e4m3), (e5m2, e4m3), (e4m3, e5m2)}
    for dots in (eval_dots, decode_dots):
        assert (e4m3, e4m3) in {(a, b) for a, b, _ in dots} and not any(e5m2 in (a, b) for a, b, _ in dots)
    for dots in (step_dots, eval_dots, decode_dots):
        logits = [(a, b) for a, b, shape in dots if shape[-1:] == (vocab,)]
        assert logits and all(pair == ("bfloat16", "bfloat16") for pair in logits)


def test_fp8_with_dynamic_loss_scaling_is_refused_in_one_sentence(tmp_path, capsys):
    code = main(["train", f"run.dir={tmp_path / 'run'}", "train.precision=fp8", "train.loss_scaling=dynamic"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == ("jaxpar: error: train.loss_scaling=dynamic cannot go with train.precision=fp8: its GEMMs already "
                   "scale every gradient into e5m2 by that tensor's own amax, so a loss scale has no underflow left "
                   "to rescue; use train.loss_scaling=auto.")
    assert not (tmp_path / "run").exists()


def test_dynamic_loss_scaling_is_forced_for_bf16_and_refused_for_fp32():
    """train.loss_scaling=dynamic gives bf16 fp16's dynamic loss scaling; verify's fp32 reference takes `auto`;
    fp32, which does not underflow, refuses it."""
    sizes = {"data": 8, "context": 1, "tensor": 1, "expert": 1, "stage": 1}
    cfg = load_config(None, ["train.precision=bf16", "train.loss_scaling=dynamic"])
    assert of(cfg).loss_scaling and of(cfg).initial_loss_scale == INITIAL_FP16_SCALE
    assert not of(load_config(None, ["train.precision=bf16"])).loss_scaling
    assert problem(cfg, sizes) is None and layout_name(cfg, sizes) == "data=8 bf16 loss_scaling=dynamic"
    reference = reference_config(cfg)
    assert (reference.train.precision, reference.train.loss_scaling) == ("fp32", "auto")
    assert reference_config(load_config(None, ["train.precision=fp8"])).train.precision == "fp8"
    assert problem(load_config(None, ["train.loss_scaling=dynamic"]), sizes) == (
        "train.loss_scaling=dynamic needs train.precision=bf16 or fp16: fp32 gradients do not underflow; use "
        "train.loss_scaling=auto.")
