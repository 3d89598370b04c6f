"""The compiled step communicates exactly what Megatron and data parallelism predict."""

import math

import jax
import pytest

from jaxpar.plan import collectives
from jaxpar.train.trainer import Trainer


def _compiled(session):
    trainer = Trainer(session)
    return trainer, collectives(trainer.compile_step().as_text(), session.mesh_sizes)


def _gradient_reduction_bytes(found, axes=("data",)):
    """Bytes of (fp32) arrays all-reduced over `axes` per step, leaving out scalars (loss, norms)."""
    total = 0
    for c in found:
        if c.mesh_axes == axes:
            dims = [shape[shape.index("[") + 1:-1] for shape in c.shapes]
            total += c.count * sum(4 * math.prod(int(d) for d in dim.split(",")) for dim in dims if dim)
    return total


def _local_param_bytes(trainer):
    """Bytes of one device's shard of every parameter."""
    abstract = jax.eval_shape(trainer.init).params
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(trainer.state_shardings.params)):
        total += math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return total


def _reduced_once_bytes(trainer):
    """Bytes of every local gradient reduced once over `data`, plus the tied embedding's local
    shard once more: the partitioner sums its two contributions (lookup and logits) over the
    devices separately before adding them. (XLA:GPU's AllReduceReassociate pass merges such a
    pair into one all-reduce; XLA:CPU keeps both.)"""
    cfg = trainer.cfg.model
    embedding = cfg.vocab_size // trainer.layout.sizes["tensor"] * cfg.d_model * 4
    return _local_param_bytes(trainer) + (embedding if cfg.tie_embeddings else 0)


def test_megatron_collectives_for_data4_tensor2(session_for):
    session = session_for("mesh.data=4", "mesh.tensor=2")
    trainer, found = _compiled(session)
    cfg = session.cfg
    local_batch = cfg.train.batch_size // session.mesh_sizes["data"]
    activation_bytes = local_batch * cfg.model.seq_len * cfg.model.d_model * 4

    assert not [c for c in found if c.op != "all-reduce"], "no all-gather of weights (or anything else)"
    tensor_in_layers = [c for c in found if c.mesh_axes == ("tensor",) and c.in_loop]
    # Per block: forward all-reduces after attention and after the MLP (row-parallel outputs);
    # backward all-reduces of dx into the column-parallel QKV and MLP-up projections.
    assert len(tensor_in_layers) == 4
    assert all(c.bytes == activation_bytes and c.count == cfg.model.n_layers for c in tensor_in_layers)
    # Data-parallel gradient all-reduce covers every (tensor-sharded) parameter exactly once.
    assert _gradient_reduction_bytes(found) == _reduced_once_bytes(trainer)


@pytest.mark.slow
def test_pure_data_parallel_only_all_reduces_gradients(session_for):
    session = session_for("mesh.data=8")
    trainer, found = _compiled(session)
    assert {c.mesh_axes for c in found} <= {("data",)}
    assert {c.op for c in found} == {"all-reduce"}
    assert _gradient_reduction_bytes(found) == _reduced_once_bytes(trainer)


@pytest.mark.slow
def test_an_untied_head_reduces_each_weight_once(session_for):
    """Untied, the embedding (lookup only) and the head (logits only) each have one gradient
    contribution, and every gradient is reduced exactly once; tied, the shared weight's two
    contributions are reduced separately, so the two cost the same traffic."""
    tied, tied_found = _compiled(session_for("mesh.data=8"))
    untied, untied_found = _compiled(session_for("mesh.data=8", "model.tie_embeddings=false"))
    cfg = tied.cfg.model
    head_bytes = cfg.vocab_size * cfg.d_model * 4
    assert _local_param_bytes(untied) - _local_param_bytes(tied) == head_bytes
    assert _gradient_reduction_bytes(untied_found) == _local_param_bytes(untied)
    assert _gradient_reduction_bytes(tied_found) == _local_param_bytes(tied) + head_bytes


@pytest.mark.parametrize("group", ["[4,2]<=[8]", "{{0,1},{2,3},{4,5},{6,7}}", "mesh['a'=4,'b'=2] {'b'}"])
def test_replica_group_formats_map_to_the_tensor_axis(group):
    line = f"  %all-reduce.1 = f32[8,16]{{1,0}} all-reduce(%x), channel_id=1, replica_groups={group}, to_apply=%add"
    hlo = f"ENTRY %main (x: f32[8,16]) -> f32[8,16] {{\n{line}\n}}"
    (found,) = collectives(hlo, {"data": 4, "tensor": 2})
    assert found.mesh_axes == ("tensor",) and found.bytes == 8 * 16 * 4 and found.count == 1
