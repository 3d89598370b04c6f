"""Dropless routing's dispatch by ragged all-to-all (parallel.expert_dispatch=ragged): the CPU's emulation of
jax.lax.ragged_all_to_all equals a NumPy model of the op's documented semantics, forward and backward, on
random sizes; training with it matches one device; the plan counts the routed rows; bad configs are refused."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMALL_MODEL
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.cli import main
from jaxpar.config.presets import load_config
from jaxpar.model.dropless import dropless_experts, ragged_dropless_experts
from jaxpar.parallel.ragged import Exchange, emulated
from jaxpar.plan import collectives, format_report, measure_step
from jaxpar.train.run_session import prepare
from jaxpar.train.trainer import Trainer
from jaxpar.verify.run import verify

N_DEVICES = 4


def model_of_the_op(operands, outputs, input_offsets, send_sizes, output_offsets, recv_sizes):
    """jax.lax.ragged_all_to_all as its docstring writes it, one device at a time (lists over the devices):
    slice i of device s goes to device i // (K / n), which writes it at output_offsets[i] (an offset in the
    receiver's output); every other output row keeps its value."""
    n, K = len(operands), len(input_offsets[0])
    per_device = K // n
    results = [out.copy() for out in outputs]
    for source in range(n):
        for i in range(K):
            target, size = i // per_device, send_sizes[source][i]
            assert recv_sizes[target][source * per_device + i % per_device] == size  # the op's precondition
            start = input_offsets[source][i]
            results[target][output_offsets[source][i]:output_offsets[source][i] + size] = \
                operands[source][start:start + size]
    return results


def model_of_the_transpose(cotangents, operand_rows, input_offsets, send_sizes, output_offsets):
    """The op's adjoint: each sent operand row gets the cotangent of the row it was written to; an output row
    gets its own cotangent unless a slice wrote it."""
    n, K = len(cotangents), len(input_offsets[0])
    per_device = K // n
    operand_t = [np.zeros((operand_rows, *t.shape[1:]), t.dtype) for t in cotangents]
    output_t = [t.copy() for t in cotangents]
    for source in range(n):
        for i in range(K):
            target, size, start, land = i // per_device, send_sizes[source][i], input_offsets[source][i], \
                output_offsets[source][i]
            operand_t[source][start:start + size] += cotangents[target][land:land + size]
            output_t[target][land:land + size] = 0
    return operand_t, output_t


def _laid_out(sizes, rows, rng):
    """Offsets for slices of these sizes, placed in a random order with random gaps in `rows` rows."""
    order = rng.permutation(len(sizes))
    gaps = rng.multinomial(rows - sum(sizes), np.ones(len(sizes) + 1) / (len(sizes) + 1))
    offsets, at = np.zeros(len(sizes), np.int32), 0
    for k, slice_index in enumerate(order):
        at += gaps[k]
        offsets[slice_index] = at
        at += sizes[slice_index]
    return offsets


def random_case(rng, n, per_device, N, M, sizes_SK=None):
    """Arguments of one call on every device: sizes_SK[s, i] rows from device s's slice i (random where not
    given: some empty), each device's slices placed at random in its operand and in their receivers' outputs."""
    K = n * per_device
    while sizes_SK is None:
        drawn = rng.integers(0, 4, (n, K)) * (rng.random((n, K)) < 0.6)
        received = [sum(drawn[s, t * per_device + k] for s in range(n) for k in range(per_device)) for t in range(n)]
        sizes_SK = drawn if drawn.sum(1).max() <= N and max(received) <= M else None
    input_offsets = [_laid_out(sizes_SK[s], N, rng) for s in range(n)]
    output_offsets = [np.zeros(K, np.int32) for _ in range(n)]
    recv_sizes = [np.zeros(K, np.int32) for _ in range(n)]
    for t in range(n):
        incoming = [(s, t * per_device + k) for s in range(n) for k in range(per_device)]
        landed = _laid_out([sizes_SK[s, i] for s, i in incoming], M, rng)
        for j, (s, i) in enumerate(incoming):
            output_offsets[s][i] = landed[j]
            recv_sizes[t][j] = sizes_SK[s, i]
    send_sizes = [np.asarray(sizes_SK[s], np.int32) for s in range(n)]
    operands = [rng.standard_normal((N, 3)).astype(np.float32) for _ in range(n)]
    outputs = [rng.standard_normal((M, 3)).astype(np.float32) for _ in range(n)]
    return operands, outputs, input_offsets, send_sizes, output_offsets, recv_sizes


@functools.cache
def _emulation_and_its_vjp():
    """jitted (operands, outputs, offsets and sizes, cotangents) -> (result, operand_t, output_t), stacked over
    N_DEVICES devices, the emulation run under shard_map: one compile for each shape."""
    mesh = jax.make_mesh((N_DEVICES,), ("x",), devices=jax.devices()[:N_DEVICES])
    body = jax.shard_map(lambda *args: emulated(*args, "x"), mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x"))

    def run(operand, output, ints, cotangent):
        result, pullback = jax.vjp(lambda a, b: body(a, b, *ints), operand, output)
        return result, *pullback(cotangent)

    return jax.jit(run), NamedSharding(mesh, P("x"))


CASES = {
    "random": dict(per_device=1, N=12, M=16),
    "random, two slices per device": dict(per_device=2, N=12, M=16),
    "empty sends": dict(per_device=1, N=6, M=8, sizes=np.array([[0, 0, 0, 0], [0, 3, 0, 2], [0, 0, 0, 0],
                                                                 [1, 0, 0, 0]])),
    "all to one": dict(per_device=1, N=5, M=20, sizes=np.array([[5, 0, 0, 0]] * 4)),
    "all to oneself": dict(per_device=1, N=5, M=5, sizes=np.diag([5, 5, 5, 5])),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_emulation_is_the_op_forward_and_backward(name, seed):
    spec = CASES[name]
    rng = np.random.default_rng(seed)
    case = random_case(rng, N_DEVICES, spec["per_device"], spec["N"], spec["M"], spec.get("sizes"))
    cotangents = [rng.standard_normal(out.shape).astype(np.float32) for out in case[1]]
    run, sharded = _emulation_and_its_vjp()
    operand, output, *ints, cotangent = (jax.device_put(np.concatenate(parts), sharded)
                                         for parts in (*case, cotangents))
    result, operand_t, output_t = run(operand, output, ints, cotangent)
    np.testing.assert_array_equal(np.asarray(result), np.concatenate(model_of_the_op(*case)))  # rows moved, bit for bit
    expected_operand_t, expected_output_t = model_of_the_transpose(cotangents, spec["N"], case[2], case[3], case[4])
    np.testing.assert_array_equal(np.asarray(operand_t), np.concatenate(expected_operand_t))
    np.testing.assert_array_equal(np.asarray(output_t), np.concatenate(expected_output_t))


# case -> (arguments, words the one sentence must contain)
BAD_CONFIGS = {
    "ragged without an expert axis": (["model.moe.experts=4", "model.moe.router=dropless",
                                       "parallel.expert_dispatch=ragged"],
                                      "parallel.expert_dispatch=ragged sends rows between expert devices, so it needs "
                                      "mesh.expert > 1."),
    "ragged with a capacity router": (["mesh.data=4", "mesh.expert=2", "model.moe.experts=4", "model.moe.router=topk",
                                       "parallel.expert_dispatch=ragged"],
                                      "parallel.expert_dispatch=ragged dispatches model.moe.router=dropless only, but "
                                      "the model has router=topk"),
    "ragged with a dense model": (["mesh.data=4", "mesh.expert=2", "parallel.expert_dispatch=ragged"],
                                  "but the model has no experts (model.moe.experts=0)"),
}


@pytest.mark.parametrize("command", ["train", "verify", "plan"])
@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_a_ragged_dispatch_it_cannot_run_exits_2_with_one_sentence(case, command, tmp_path, capsys):
    args, message = BAD_CONFIGS[case]
    run_dir = tmp_path / "run"
    assert main([command, f"run.dir={run_dir}", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1 and err.startswith("jaxpar: error: ") and err.endswith(".")
    assert not run_dir.exists()


MOE = ("model.moe.experts=8", "model.moe.router=dropless", "model.n_layers=2", *SMALL_MODEL)
LAYOUTS = {"data=2 expert=4": ("model.moe.every=2", "mesh.data=2", "mesh.expert=4"),
           "data=2 expert=2 stage=2 1f1b": ("model.moe.every=1", "mesh.data=2", "mesh.expert=2", "mesh.stage=2",
                                            "parallel.pipeline.schedule=1f1b", "parallel.pipeline.microbatches=4")}


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_training_with_ragged_dispatch_matches_one_device(name, session_for):
    """Three full training steps (the emulation's gradients in them) against one device's, routing replayed."""
    result = verify(session_for("train.steps=3", *MOE, *LAYOUTS[name], "parallel.expert_dispatch=ragged"),
                    log=lambda line: None)
    assert result["ok"] and result["routing_changes"]["flips"] == 0, result
    assert result["layout"].endswith("dispatch=ragged")


@pytest.mark.slow
def test_the_plan_counts_the_routed_rows_where_all_gather_moves_every_row_to_every_expert_device():
    """Per MoE layer and step, dispatch and return and their transposes in backward: ragged moves each
    device's A = tokens x top_k rows four times; the all-gather brings every expert shard's tokens forward
    and the gradient's backward (mesh.expert x the tokens), each with its reduce-scatter."""
    plans, cfg = {}, None
    for dispatch in ("allgather", "ragged"):
        session = prepare(load_config(None, ["run.dir=/dev/null", *MOE, *LAYOUTS["data=2 expert=4"],
                                             f"parallel.expert_dispatch={dispatch}"]))
        cfg = session.cfg
        plans[dispatch] = measure_step(Trainer(session))
    tokens = cfg.train.batch_size // 8 * cfg.model.seq_len  # per device
    row_bytes, moe_layers = cfg.model.d_model * 4, cfg.model.n_layers // cfg.model.moe.every
    ragged, gathered = plans["ragged"]["collectives"], plans["allgather"]["collectives"]
    assert ragged["ragged-all-to-all"] == 4 * moe_layers * tokens * cfg.model.moe.top_k * row_bytes
    assert ragged["all-to-all"] == 0  # the emulation's padded blocks are not counted as such
    assert ragged["all-gather"] == moe_layers * 8 * 4 * 4  # every shard's counts per expert: 8 int32 each
    assert gathered["ragged-all-to-all"] == 0
    rows_gathered = [op for op in plans["allgather"]["collective_ops"]
                     if op["op"] == "all-gather" and op["bytes"] == 4 * tokens * row_bytes]
    assert len(rows_gathered) == 2 * moe_layers  # x forward, its gradient's all-gather backward
    assert "ragged-all-to-all: the rows each device routes" in format_report(plans["ragged"])


def test_a_compiled_ragged_all_to_all_counts_its_routed_rows():
    """The op as XLA:GPU prints it: its output buffer holds 4 x 8 rows; the 8 it sends are what it moves."""
    hlo = """HloModule step
ENTRY %main (rows: f32[8,16]) -> f32[32,16] {
  %rows = f32[8,16]{1,0} parameter(0)
  %zero = f32[] constant(0)
  %buffer = f32[32,16]{1,0} broadcast(%zero), dimensions={}
  %offsets = s32[4]{0} constant({0, 2, 4, 6})
  %sizes = s32[4]{0} constant({2, 2, 2, 2})
  ROOT %ragged-all-to-all = f32[32,16]{1,0} ragged-all-to-all(%rows, %buffer, %offsets, %sizes, %offsets, %sizes), \
channel_id=1, replica_groups={{0,1,2,3}}
}
"""
    (found,) = collectives(hlo, {"expert": 4})
    assert (found.op, found.bytes, found.wire_bytes, found.mesh_axes) == ("ragged-all-to-all", 8 * 16 * 4,
                                                                           6 * 16 * 4, ("expert",))


S, T, K, HELD, D, F = N_DEVICES, 6, 2, 2, 8, 16  # shards, tokens per shard, choices, experts per shard, widths


def _dispatch_inputs(rng, all_to_one: bool):
    """Every shard's tokens, their K distinct experts (all on shard 0's experts: all_to_one), gates and weights."""
    if all_to_one:
        experts = np.tile(np.arange(K, dtype=np.int32), (S * T, 1))
    else:
        experts = np.stack([rng.choice(S * HELD, K, replace=False) for _ in range(S * T)]).astype(np.int32)
    return (rng.standard_normal((S * T, D)).astype(np.float32), experts,
            rng.random((S * T, K)).astype(np.float32), rng.standard_normal((S * HELD, D, F)).astype(np.float32),
            rng.standard_normal((S * HELD, F, D)).astype(np.float32))


def _experts(x, experts, gates, w_up, w_down, exchange):
    """The dropless experts (a GeLU MLP each) on one device (exchange None), or a shard's tokens by ragged dispatch."""
    hidden = lambda x_AD, sizes_E: jax.nn.gelu(jax.lax.ragged_dot(x_AD, w_up, sizes_E))  # noqa: E731
    if exchange is None:
        return dropless_experts(x, experts, gates, hidden, w_down)
    return ragged_dropless_experts(x, experts, gates, hidden, w_down, exchange)


def _loss_and_grads(dispatch, cotangent):
    return jax.value_and_grad(lambda x, e, g, u, w: jnp.sum(dispatch(x, e, g, u, w) * cotangent), (0, 2, 3, 4))


def _dispatched(real: bool, inputs):
    """The ragged dispatch over S devices, and the inputs split over them (tokens, and experts by shard)."""
    mesh = jax.make_mesh((S,), ("x",), devices=jax.devices()[:S])
    exchange = Exchange("x", S, real)
    body = jax.shard_map(lambda *args: _experts(*args, exchange), mesh=mesh, in_specs=(P("x"),) * 5,
                         out_specs=P("x"))
    return body, [jax.device_put(a, NamedSharding(mesh, P("x"))) for a in inputs]


@pytest.mark.parametrize("all_to_one", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["random routes", "every row to one shard"])
def test_ragged_dispatch_computes_what_one_device_computes_forward_and_backward(all_to_one):
    """All the shards' assignments may go to one shard's experts: its receive buffer takes them all, none dropped."""
    rng = np.random.default_rng(3)
    inputs = _dispatch_inputs(rng, all_to_one)
    cotangent = rng.standard_normal((S * T, D)).astype(np.float32)
    expected = jax.jit(_loss_and_grads(lambda *args: _experts(*args, None), cotangent))(*inputs)
    dispatched, split = _dispatched(False, inputs)
    found = jax.jit(_loss_and_grads(dispatched, cotangent))(*split)
    for name, want, got in zip(("loss", "d x", "d gates", "d w_up", "d w_down"), jax.tree.leaves(expected),
                               jax.tree.leaves(found)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=name)


def test_the_op_itself_takes_the_dispatch_and_its_transpose():
    """Where the backend has the op (GPU, TPU): the same step lowers to four of them, two forward and their
    transposes (XLA:CPU cannot compile it, so lowered only)."""
    inputs = _dispatch_inputs(np.random.default_rng(0), False)
    cotangent = np.ones((S * T, D), np.float32)
    dispatched, split = _dispatched(True, inputs)
    lowered = jax.jit(_loss_and_grads(dispatched, cotangent)).lower(*split).as_text()
    assert lowered.count("@ragged_all_to_all") == 4
