"""Multi-token prediction (model.mtp): the modules' loss against a per-position loop, what it adds to
the objective, and a pipelined layout against one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import SMALL_MODEL

from jaxpar.config import Config
from jaxpar.model.mtp import mtp_loss
from jaxpar.model.transformer import Transformer
from jaxpar.verify.run import verify

B, L, V = 2, 12, 64


def _model(depth: int) -> tuple[Transformer, jax.Array]:
    cfg = Config().replace(**{"model.d_model": 32, "model.n_layers": 2, "model.seq_len": L, "model.vocab_size": V,
                              "model.mtp.depth": depth})
    tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, V, (B, L + 1)), jnp.int32)
    return Transformer(cfg.model, rngs=nnx.Rngs(0)), tokens_BT


def _log_softmax(row: np.ndarray) -> np.ndarray:
    shifted = row - row.max()
    return shifted - np.log(np.exp(shifted).sum())


def test_each_module_predicts_the_token_k_plus_one_ahead_where_there_is_one():
    """Module k at position i sees the embedding of token i + k and is scored on token i + k + 1,
    at the positions i <= L - k - 1 that have one; the modules' losses are averaged."""
    model, tokens_BT = _model(depth=2)
    h_BLD = model.run_blocks(model.embed(tokens_BT[:, :-1]))[0]
    tokens = np.asarray(tokens_BT)
    expected, h = [], model.final_norm(h_BLD)
    for k, module in enumerate(model.mtp, start=1):
        ahead = np.array([[tokens[b, i + k] if i + k <= L else 0 for i in range(L)] for b in range(B)])
        h = module(h, model.embed(jnp.asarray(ahead)))
        logits = np.asarray(model.project(module.out_norm(h)), np.float64)
        losses = [-_log_softmax(logits[b, i])[tokens[b, i + k + 1]] for b in range(B) for i in range(L - k)]
        expected.append(np.mean(losses))
    np.testing.assert_allclose(float(jax.jit(mtp_loss)(model, h_BLD, tokens_BT)), np.mean(expected), rtol=2e-6)


def test_the_objective_adds_the_weighted_mtp_loss(session_for):
    from jaxpar.train.step import _head_stats

    model, tokens_BT = _model(depth=1)
    from jaxpar.data.packed_rows import PackedRows

    batch = PackedRows.of(tokens_BT)
    h_BLD = model.run_blocks(model.embed(batch.inputs_BL))[0]
    loss, stats = _head_stats(model, h_BLD, batch, 1)
    assert float(loss) == pytest.approx(float(stats["loss"] + model.mtp_weight * stats["mtp_loss"]), rel=1e-6)
    assert float(stats["mtp_loss"]) > 0 and model.mtp_weight == 0.3


def test_the_modules_match_deepseek_v3s_definition_written_by_hand():
    """DeepSeek-V3 (section 2.2) with tests/reference_model.py's blocks, sharing no jaxpar code: h_0 the trunk's
    last hidden state after the final norm; h_k = Block_k(M_k [RMSNorm(emb(t_{i+k})); RMSNorm(h_{k-1})]); module
    k's loss the cross-entropy of t_{i+k+1} from RMSNorm(h_k) through the tied head, over the positions that
    have one; the modules' losses averaged."""
    import reference_model as ref

    model, tokens_BT = _model(depth=2)
    params = {"/".join(map(str, path)): jnp.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model))}
    tokens = np.asarray(tokens_BT)
    h = ref.final_hidden(params, tokens_BT[:, :-1])
    expected = []
    for k in (1, 2):
        w = {name.removeprefix(f"mtp/{k - 1}/"): value for name, value in params.items()
             if name.startswith(f"mtp/{k - 1}/")}
        ahead = np.array([[tokens[b, i + k] if i + k <= L else 0 for i in range(L)] for b in range(B)])
        x = (ref.rms_norm(params["embedding"][ahead], w["embed_norm/scale"]) @ w["w_proj"][0]
             + ref.rms_norm(h, w["hidden_norm/scale"]) @ w["w_proj"][1])
        h = ref.block(x, {name.removeprefix("block/"): v for name, v in w.items() if name.startswith("block/")})
        logits = np.asarray(ref.rms_norm(h, w["out_norm/scale"]) @ params["embedding"].T, np.float64)
        expected.append(np.mean([-_log_softmax(logits[b, i])[tokens[b, i + k + 1]]
                                 for b in range(B) for i in range(L - k)]))
    h_BLD = model.run_blocks(model.embed(tokens_BT[:, :-1]))[0]
    np.testing.assert_allclose(float(jax.jit(mtp_loss)(model, h_BLD, tokens_BT)), np.mean(expected), rtol=1e-5)


@pytest.mark.slow
def test_mtp_through_1f1b_matches_single_device(session_for):
    result = verify(session_for("train.steps=3", *SMALL_MODEL, "model.mtp.depth=1", "mesh.data=4", "mesh.stage=2",
                                "parallel.pipeline.schedule=1f1b"), log=lambda line: None)
    assert result["ok"], result
