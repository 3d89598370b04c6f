"""Zero-bubble pipelines (ZB-H1, ZB-V): their tables against the paper's formulas, the split
backward against the fused one, and the executor against the single-device reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMALL_MODEL

from jaxpar.parallel.schedule_timing import (
    Costs,
    bubble,
    formula_idle_fraction,
    idle_fraction,
    lockstep_seconds,
    paper_bubble,
)
from jaxpar.parallel.schedules import Action, build
from jaxpar.parallel.split_backward import SplitBackward
from jaxpar.parallel.stash_slots import Pool, assign, write_slots
from jaxpar.verify.run import verify

TABLES = [(schedule, S, M) for schedule in ("zb-h1", "zbv") for S in (2, 3, 4, 8)
          for M in sorted({S, 2 * S - 1, 2 * S, 16})]


@pytest.mark.parametrize("schedule, S, M", TABLES)
def test_table_runs_every_f_b_w_once_in_dependency_order_within_1f1b_memory(schedule, S, M):
    table = build(schedule, S, M)
    when = {}
    for t, row in enumerate(table.ticks):
        for s, action in enumerate(row):
            if action is not None:
                assert action not in when and table.stage_of(action.chunk) == s
                when[action] = t
    chunks = S * table.virtual
    assert len(when) == 3 * M * chunks
    for (kind, i, k), t in when.items():
        if kind == "F" and k > 0:
            assert when[Action("F", i, k - 1)] < t
        if kind == "B":
            assert when[Action("F", i, k)] < t and (k == chunks - 1 or when[Action("B", i, k + 1)] < t)
        if kind == "W":
            assert when[Action("B", i, k)] < t
    # 1F1B keeps at most S microbatches' activations on a stage; zbv's chunks are half a stage's
    assert max(table.in_flight(s) for s in range(S)) <= S * table.virtual
    assert table.idle_fraction == pytest.approx(formula_idle_fraction(schedule, S, M)) or M < 2 * S - 1


@pytest.mark.parametrize("S, M", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_bubbles_match_the_paper_and_shrink_against_1f1b(S, M):
    """With F = B = W = 1: 1F1B's bubble (S-1)(F+B+W), ZB-H1's (S-1)(F+B-W) = a third of it, ZB-V's
    none; and at S=4, M=8 the acceptance bounds, 0.40x and 0.15x of 1F1B's."""
    costs = Costs()
    found = {s: bubble(build(s, S, M), costs.of(build(s, S, M))) for s in ("1f1b", "zb-h1", "zbv")}
    assert found == {s: paper_bubble(s, S, costs) for s in found}
    assert found["zb-h1"] <= 0.40 * found["1f1b"] and found["zbv"] <= 0.15 * found["1f1b"]
    # over the whole step the idle time shrinks too (each chunk's share of the stage's work)
    fractions = {s: idle_fraction(build(s, S, M), costs.of(build(s, S, M))) for s in found}
    assert fractions["zbv"] < fractions["zb-h1"] < fractions["1f1b"] == pytest.approx((S - 1) / (M + S - 1))


def test_zb_h1_bubble_follows_the_formula_with_other_costs():
    """The paper's (S-1)(F+B-W) holds for the table's order with other costs too (these have W <= F <= B;
    where F > W it can exceed it, e.g. 4.5 against 3 at F=0.5, B=1.5, W=1); 1F1B's stays (S-1)(F+B+W)."""
    for costs in (Costs(1, 2, 1), Costs(2, 2, 1), Costs(1, 1, 0.5)):
        for schedule in ("1f1b", "zb-h1"):
            table = build(schedule, 4, 12)
            assert bubble(table, costs.of(table)) == pytest.approx(paper_bubble(schedule, 4, costs))


def test_lockstep_time_is_the_slowest_stage_per_tick():
    table = build("1f1b", 4, 8)
    # a fused backward (2) in most ticks: lockstep runs slower than each stage on its own
    assert lockstep_seconds(table, Costs().of(table)) == 40 > 3 * 8 + 9
    zb = build("zb-h1", 4, 8)
    assert lockstep_seconds(zb, Costs().of(zb)) == len(zb.ticks) == 27


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_stash_slots_never_hold_two_live_values(schedule):
    table = build(schedule, 4, 8)
    pools = [Pool("x", "sent F", "F", "not first"), Pool("res", "F", "W"), Pool("cross", "B", "W")]
    slots = assign(table, pools)
    tick = {a: t for t, row in enumerate(table.ticks) for a in row if a is not None}
    for pool, (start, end) in {"res": ("F", "W"), "cross": ("B", "W")}.items():
        lives = {}
        for (s, i, k), slot in slots.slot[pool].items():
            lives.setdefault((s, slot), []).append((tick[Action(start, i, k)], tick[Action(end, i, k)]))
        for spans in lives.values():
            spans.sort()
            assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:]))
    # F to W: the S (zbv: 2S half-size chunks) microbatches in flight on the first stage
    assert slots.count["res"] == 4 * table.virtual
    # a tick that keeps nothing writes where no value it would destroy lives
    last = table.stages * table.virtual - 1
    writes = write_slots(table, slots, "res", lambda a: pools[1].written_by(a, last))
    for t, row in enumerate(table.ticks):
        for s, action in enumerate(row):
            if action is None or action.kind != "F":
                assert all(not start <= t < end for start, end, slot in slots.lives["res"][s] if slot == writes[t][s])


def test_split_backward_divides_the_fused_backward_without_repeating_a_matmul():
    """A two-layer scanned MLP with norms, biases and a head: B gives the input's cotangent and the
    norm and bias gradients, W the matmul weights' gradients; together exactly the fused VJP's
    values, and its matmuls each run once: in B for the input, in W for the weights."""
    key = jax.random.PRNGKey(0)
    L, D, F = 2, 8, 16
    params = {"up": jax.random.normal(key, (L, D, F)), "down": jax.random.normal(jax.random.fold_in(key, 1), (L, F, D)),
              "scale": jnp.ones((L, D)), "head": jax.random.normal(jax.random.fold_in(key, 2), (D, 5)),
              "bias": jnp.zeros(5)}
    x = jax.random.normal(jax.random.fold_in(key, 3), (4, D))

    def model(p, x):
        def layer(h, w):
            up, down, scale = w
            n = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-5) * scale
            return h + jax.nn.gelu(n @ up) @ down, None
        h, _ = jax.lax.scan(layer, x, (p["up"], p["down"], p["scale"]))
        return jnp.sum(jnp.tanh(h @ p["head"] + p["bias"]))

    _, pullback = jax.vjp(model, params, x)
    residuals, tree = jax.tree.flatten(pullback)
    split = SplitBackward(lambda res: tree.unflatten(res)(1.0), residuals)
    dx, in_b, crossing = jax.jit(split.input_half)(residuals)
    in_w = jax.jit(split.weight_half)(residuals, crossing)
    names = sorted(params)  # the leaf order of the gradients
    assert sorted(names[g] for g in in_b) == ["bias", "scale"] and sorted(names[g] for g in in_w) == ["down", "head",
                                                                                                       "up"]
    fused_grads, fused_dx = pullback(1.0)
    for g, value in {**in_b, **in_w}.items():
        np.testing.assert_allclose(value, fused_grads[names[g]], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, fused_dx, rtol=1e-6)

    def matmuls(fn, *args) -> int:
        return str(jax.make_jaxpr(fn)(*args)).count("dot_general")

    b, w = matmuls(split.input_half, residuals), matmuls(split.weight_half, residuals, crossing)
    assert (b, w) == (3, 3) and b + w == matmuls(lambda: pullback(1.0))  # head, up and down: dx in B, dW in W


# The executor against the single-device reference: the minimal set of layouts that can each fail.
# zbv (the V's turn on the last stage, first, middle and last chunks, two chunks sharing a stage's
# pools; in the quick tier) and zbv in bf16 with full remat; zb-h1 with tensor and ZeRO-3 (manual
# batch axes; W reduce-scatters the weight gradients); zb-h1 on four stages with experts (router
# weights and auxiliary losses through B and W).
MOE = ("model.d_model=64", "model.n_heads=4", "model.d_ff=128", "model.seq_len=32", "train.batch_size=16",
       "model.moe.experts=4", "model.moe.every=1", "model.moe.aux_loss_weight=10", "model.moe.z_loss_weight=10")
LAYOUTS = {
    "zbv": (*SMALL_MODEL, "parallel.pipeline.schedule=zbv", "mesh.data=4", "mesh.stage=2",
            "parallel.pipeline.microbatches=4"),
    "zbv bf16 remat": (*SMALL_MODEL, "parallel.pipeline.schedule=zbv", "mesh.data=4", "mesh.stage=2",
                       "parallel.pipeline.microbatches=4", "train.precision=bf16", "train.remat=full"),
    "zb-h1 tensor zero3": (*SMALL_MODEL, "parallel.pipeline.schedule=zb-h1", "mesh.data=2", "mesh.tensor=2",
                           "mesh.stage=2", "parallel.zero=3", "parallel.pipeline.microbatches=4"),
    "zb-h1 experts": (*MOE, "parallel.pipeline.schedule=zb-h1", "mesh.expert=2", "mesh.stage=4", "model.n_layers=4",
                      "parallel.pipeline.microbatches=4"),
}


@pytest.mark.parametrize("name", [name if name == "zbv" else pytest.param(name, marks=pytest.mark.slow)
                                  for name in LAYOUTS])
def test_zero_bubble_layout_matches_single_device(name, session_for):
    result = verify(session_for("train.steps=2", *LAYOUTS[name]), log=lambda line: None)
    assert result["ok"], result  # an MoE layout's flips beyond the tie tolerance fail it


@pytest.mark.slow
def test_zero_bubble_runs_each_matmul_once_within_1f1b_memory():
    """S=4, M=16, remat none, 8 layers, seq 256 (activations dominate), compiled only: ZB-H1 and ZB-V
    execute exactly 1F1B's matmul FLOPs on every stage (each tick branch costed from its compiled
    computation, counted as often as the table takes it; 1F1B's equal data=8's,
    tests/test_pipeline.py), and need at most 1.1x (ZB-H1) and 1.2x (ZB-V) its temporaries."""
    import os

    from jaxpar.config.presets import load_config
    from jaxpar.plan import measure_step
    from jaxpar.train.run_session import prepare
    from jaxpar.train.trainer import Trainer

    # the 1F1B layout of test_1f1b_bounds_activation_memory_by_stages_not_microbatches (compiled once per run)
    base = ["mesh.data=2", "mesh.stage=4", "model.n_layers=8", "model.seq_len=256", "train.batch_size=64",
            "parallel.pipeline.microbatches=16", f"run.dir={os.devnull}"]
    plans = {s: measure_step(Trainer(prepare(load_config(None, base + [f"parallel.pipeline.schedule={s}"]))))
             for s in ("1f1b", "zb-h1", "zbv")}
    one = plans["1f1b"]
    for schedule in ("zb-h1", "zbv"):
        assert plans[schedule]["executed_flops"] == pytest.approx(one["executed_flops"], rel=1e-9)
        assert plans[schedule]["executed_flops"] < plans[schedule]["flops"]  # the bound counts every branch
    assert plans["zb-h1"]["executed_flops_per_stage"] == pytest.approx(one["executed_flops_per_stage"], rel=1e-9)
    # zbv's last chunk, with the head, is on the first stage
    assert plans["zbv"]["executed_flops_per_stage"] == pytest.approx(one["executed_flops_per_stage"][::-1], rel=1e-9)
    assert plans["zb-h1"]["temp_bytes"] <= 1.1 * one["temp_bytes"]
    assert plans["zbv"]["temp_bytes"] <= 1.2 * one["temp_bytes"]
