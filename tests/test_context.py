"""Context parallelism (mesh.context): ring and all-gather attention against an attention written here
from scratch, layouts against the single-device reference, the schedule's balance, the ring's bytes
from the compiled program, and the memory a long sequence needs.

Config errors for these keys are rows of tests/test_cli_errors.py's BAD_INPUTS table."""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxpar.config.precision import POLICIES
from jaxpar.parallel import context
from jaxpar.plan import measure_step
from jaxpar.train.trainer import Trainer
from jaxpar.verify.run import verify

TINY = ("model.d_model=64", "model.n_layers=2", "model.d_ff=128", "model.seq_len=64", "train.batch_size=4")


def _attention_from_scratch(q, k, v, ids):
    """Causal softmax attention on whole sequences in natural order: q (B, L, H, K), k, v (B, L, G, K)."""
    groups = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, groups, axis=2) for x in (k, v))
    scores = jnp.einsum("blhk,bphk->bhlp", q, k) / math.sqrt(q.shape[-1])
    L = q.shape[1]
    visible = jnp.tril(jnp.ones((L, L), bool))[None] & (ids[:, :, None] == ids[:, None, :])
    scores = jnp.where(visible[:, None], scores, -jnp.inf)
    return jnp.einsum("bhlp,bphk->blhk", jax.nn.softmax(scores, axis=-1), v)


# The ring without documents (ids=None) is the quick tier's layout below, through the whole step.
KERNELS = {  # (attention, balanced, key/value heads, documents per row)
    "all-gather, unbalanced": ("allgather", False, 4, 1),
    "ring, balanced, GQA kv=2, three documents a row": ("ring", True, 2, 3),
    "all-gather, balanced, MQA, two documents a row": ("allgather", True, 1, 2),
}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_context_attention_matches_attention_on_whole_sequences(kernel):
    """Outputs and the gradients of q, k and v, on 4 context devices, the sequence in the devices' order."""
    mode, balance, kv_heads, documents = KERNELS[kernel]
    C, B, L, H, K = 4, 2, 64, 4, 8
    mesh = jax.make_mesh((C,), ("context",), axis_types=(AxisType.Auto,), devices=jax.devices()[:C])
    layout = types.SimpleNamespace(mesh=mesh, context_attention=mode, balanced_context=balance)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (B, L, H, K))
    k, v = (jax.random.normal(key, (B, L, kv_heads, K)) for key in keys[1:3])
    weight = jax.random.normal(keys[3], (B, L, H, K))
    ids = jnp.stack([jnp.sort(jax.random.randint(jax.random.PRNGKey(r), (L,), 0, documents)) for r in range(B)])
    order = context.device_order(L, C, balance)
    inverse = np.argsort(order)
    split = NamedSharding(mesh, PartitionSpec(None, "context"))

    def split_run(q, k, v):
        permuted = [jax.device_put(x[:, order], split) for x in (q, k, v)]
        out = context.attention(layout, *permuted, jax.device_put(ids[:, order], split) if documents > 1 else None,
                                (8, 4))
        return out[:, inverse]

    def whole_run(q, k, v):
        return _attention_from_scratch(q, k, v, ids)

    # jitted: run op by op, each side compiled some 300 programs of one primitive each
    out, grads = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(split_run(*a) * weight), argnums=(0, 1, 2)))(q, k, v)
    ref, ref_grads = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(whole_run(*a) * weight), argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_balanced_chunks_give_every_rank_the_same_attention_work():
    order = context.device_order(16, 4, balance=True)
    assert order.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]  # device i: chunks i, 7 - i
    balanced = context.blocks_per_rank(32768, 8, True, (512, 512))
    unbalanced = context.blocks_per_rank(32768, 8, False, (512, 512))
    assert max(balanced) / np.mean(balanced) <= 1.1
    assert 1.8 < max(unbalanced) / np.mean(unbalanced) < 1.9  # the last rank does almost twice the mean
    # causal work: half of the L x L pairs of blocks, and the diagonal blocks
    n = 32768 // 512
    assert sum(unbalanced) == n * (n + 1) // 2


# Each layout of the list that the kernels above do not already cover, through the whole step.
# Those on 8 devices are also the plain verifies of their factorisations (data=2 x context=4,
# tensor=2 x context=4, data=4 x context=2, ...: tests/test_factorisations.py leaves them here).
LAYOUTS = {
    "data=2 x context=4 ring": ["mesh.data=2", "mesh.context=4"],
    "context=8 all-gather, unbalanced, remat full, grad_accum=2": [
        "mesh.data=1", "mesh.context=8", "parallel.context_attention=allgather", "parallel.context_balance=false",
        "train.remat=full", "train.grad_accum=2"],
    "data=2 x context=2 x tensor=2, sequence, ZeRO-3": ["mesh.data=2", "mesh.context=2", "mesh.tensor=2",
                                                        "parallel.sequence=true", "parallel.zero=3"],
    "GQA kv=2, flash, tensor=2 x context=4": ["mesh.data=1", "mesh.tensor=2", "mesh.context=4", "model.n_kv_heads=2",
                                              "model.attention=flash", "model.flash_block_q=8",
                                              "model.flash_block_kv=4"],
    "packed rows, data=4 x context=2": ["mesh.data=4", "mesh.context=2", "data.packing=pack"],
    "context=2 x stage=2, 1F1B, all-gather": ["mesh.data=1", "mesh.context=2", "mesh.stage=2", "run.devices=4",
                                             "parallel.pipeline.schedule=1f1b", "parallel.pipeline.microbatches=2",
                                             "parallel.context_attention=allgather"],
    "MoE dropless, expert=2 x context=2, unbalanced": [
        "mesh.data=1", "mesh.expert=2", "mesh.context=2", "run.devices=4", "model.moe.experts=4",
        "model.moe.router=dropless", "parallel.context_balance=false"],
}


# The quick tier compiles the context step in the ring test below; these all train, so they are slow.
@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_device(layout, session_for):
    result = verify(session_for("train.steps=3", *TINY, *LAYOUTS[layout]), log=lambda line: None)
    loss_tol, param_tol = POLICIES["fp32"].tolerances
    assert result["ok"], result
    assert result["loss_max_rel_err"] <= loss_tol and result["param_max_rel_err"] <= param_tol, result
    assert "context=" in result["layout"], result["layout"]


def test_the_ring_sends_each_key_value_block_once_a_step(session_for):
    """From the compiled program: per layer, forward passes (C - 1) / C of one sequence's keys and values
    round the ring; backward passes them again with their gradients, and brings the gradients home."""
    C = 4
    session = session_for(*TINY, "mesh.data=1", f"mesh.context={C}", f"run.devices={C}")
    plan = measure_step(Trainer(session))
    m, t = session.cfg.model, session.cfg.train
    kv_bytes = 2 * t.batch_size * m.seq_len * m.kv_heads * m.head_size * 4  # keys and values, fp32
    forward = (C - 1) * kv_bytes // C
    backward = 2 * forward + kv_bytes // C  # keys, values and their gradients; then the gradients home
    assert plan["collectives"]["collective-permute"] == m.n_layers * (forward + backward)
    assert plan["context"]["max_over_mean"] == 1.0
    gathered = measure_step(Trainer(session_for(*TINY, "mesh.data=1", f"mesh.context={C}", f"run.devices={C}",
                                                "parallel.context_attention=allgather", "parallel.zero=3")))
    assert gathered["collectives"]["collective-permute"] == 0 and gathered["collectives"]["all-gather"] > 0
    # ZeRO-3 shards the state over `context` too: the weights are replicated there, their gradients summed
    assert gathered["params_bytes"] * C == plan["params_bytes"]


def _planned(*overrides: str) -> dict:
    """`jaxpar plan`'s figures (shapes only: no data is read, so the built-in corpus's length is no limit)."""
    from jaxpar.config.presets import load_config
    from jaxpar.runtime.devices import setup_devices
    from jaxpar.session import on_devices

    cfg = load_config(None, list(overrides))
    return measure_step(Trainer(on_devices(cfg, setup_devices(cfg))))


@pytest.mark.slow
def test_a_long_sequence_split_eight_ways_needs_a_fifth_of_the_memory():
    """seq 32768, d_model 128, 2 layers, batch 1, flash, full remat: temporaries per device."""
    long = ("model.seq_len=32768", "model.d_model=128", "model.n_layers=2", "train.batch_size=1",
            "model.attention=flash", "train.remat=full", "mesh.data=1")
    whole = _planned(*long, "run.devices=1")["temp_bytes"]
    split = _planned(*long, "mesh.context=8")["temp_bytes"]
    assert split <= 0.2 * whole, (split, whole)


def test_the_search_tries_context_sizes_while_a_chunk_holds_a_key_block():
    from jaxpar.config.presets import load_config
    from jaxpar.plan.search import enumerate_layouts

    long = load_config(None, ["model.seq_len=4096", "model.attention=flash"])  # key blocks of 512
    tried = {(rungs[0].get("mesh.context", 1), rungs[0].get("parallel.context_attention"))
             for rungs in enumerate_layouts(long, 8, {})}
    # context 8 would cut 4096 positions into chunks of 256, under a block
    assert tried == {(1, None), (2, "ring"), (2, "allgather"), (4, "ring"), (4, "allgather")}
    short = load_config(None)  # 128 positions: one block, nothing to split
    assert {rungs[0].get("mesh.context", 1) for rungs in enumerate_layouts(short, 8, {})} == {1}
