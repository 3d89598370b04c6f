"""train.loss_chunks: the chunked output projection and cross-entropy give the whole logits' loss and
update, and the step no longer holds the whole fp32 logits (read from the compiled program)."""

import os

import jax
import numpy as np
import pytest
from helpers import SMALL_MODEL

from jaxpar.config import Config
from jaxpar.config.presets import load_config
from jaxpar.features.training import automatic_loss_chunks
from jaxpar.interop.checkpoint_files import flat_by_path
from jaxpar.plan import measure_step
from jaxpar.train.run_session import prepare
from jaxpar.train.trainer import Trainer


def _one_step(*overrides):
    """(the loss of the first step, the validation loss of its batch, the updated weights by path)."""
    session = prepare(load_config(None, [f"run.dir={os.devnull}", *SMALL_MODEL, *overrides]))
    trainer = Trainer(session)
    batch = trainer.put_windows(session.train_data, session.train_data.starts(0))
    state, metrics = trainer.step(trainer.init(), batch)
    weights = jax.jit(lambda tree: tree, out_shardings=trainer.replicated)(state.params)
    return (float(metrics["loss"]), float(trainer.eval_loss(state.params, batch)),
            {k: np.asarray(v) for k, v in flat_by_path(jax.device_get(weights)).items()})


# The pipeline's last stage is verified with chunks by tests/test_pipeline.py (GPipe, and 1F1B over
# tensor x stage in bf16).
@pytest.mark.slow
def test_chunked_loss_equals_the_whole_logits():
    """One step with 4 chunks against the same layout with none: the loss within 1e-6, the
    validation loss too, and every updated weight within fp32's verify tolerance. The untied head is
    split by vocabulary over tensor, the residual stream by sequence (each chunk's all-gather), and
    the rows are packed (weighted targets)."""
    layout = ("mesh.data=2", "mesh.tensor=4", "model.tie_embeddings=false", "parallel.sequence=true",
              "data.packing=pack", "model.n_layers=2", "train.batch_size=8")
    loss, val, weights = _one_step(*layout, "train.loss_chunks=1")
    chunked_loss, chunked_val, chunked = _one_step(*layout, "train.loss_chunks=4")
    assert abs(chunked_loss - loss) <= 1e-6 * abs(loss)
    assert abs(chunked_val - val) <= 1e-6 * abs(val)
    for key, w in weights.items():
        assert np.linalg.norm(chunked[key] - w) <= 1e-5 * np.linalg.norm(w), key


def test_chunked_loss_drops_the_whole_fp32_logits_from_the_temporaries():
    """8 sequences of 256 tokens on data=8, a 16k vocabulary: one device's fp32 logits are 16 MiB.
    With 8 chunks the step's temporaries are smaller by more than that (compile only)."""
    shape = ("model.vocab_size=16384", "model.seq_len=256", "model.d_model=32", "model.n_layers=1",
             "model.n_heads=2", "model.d_ff=64", "train.batch_size=8", "mesh.data=8")
    temp = {}
    for chunks in (1, 8):
        session = prepare(load_config(None, [f"run.dir={os.devnull}", *shape, f"train.loss_chunks={chunks}"]))
        temp[chunks] = measure_step(Trainer(session))["temp_bytes"]
    logits_bytes = 256 * 16384 * 4
    assert temp[1] - temp[8] >= logits_bytes, temp


def test_automatic_chunks_keep_the_logits_near_the_hidden_states():
    """train.loss_chunks=0: about V / D chunks per tensor rank (Liger-Kernel's rule), never below 512
    tokens per device in a chunk, a divisor of the sequence; 1 where the logits are no larger."""
    sizes = {"data": 8, "tensor": 1, "expert": 1, "stage": 1}
    llama = Config().replace(**{"model.vocab_size": 128256, "model.d_model": 4096, "model.seq_len": 8192})
    assert automatic_loss_chunks(llama, sizes, 16384) == 32  # 128256 / 4096 = 31.3
    assert automatic_loss_chunks(llama, {**sizes, "tensor": 8}, 8192) == 4  # 16032 columns a rank
    assert automatic_loss_chunks(llama, sizes, 2048) == 4  # 512 tokens a chunk at most
    assert automatic_loss_chunks(Config(), sizes, 1024) == 2  # the default model: V = 2D
    assert automatic_loss_chunks(Config().replace(**{"model.d_model": 256}), sizes, 4096) == 1
