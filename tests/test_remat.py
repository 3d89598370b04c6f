"""The step's layer scan (jaxpar.train.remat): rematerialization policies and sqrt segments."""

import jax
import pytest
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.model import Transformer
from jaxpar.train.remat import layer_scan


def _run(model: Transformer, tokens, remat: str):
    """Logits of `model` with its blocks run by the step's layer scan under `remat`."""
    return model.logits(model.run_blocks(model.embed(tokens), layer_scan(remat))[0])


def _remat_gradients(n_layers: int, remat: str):
    """(value, gradient w.r.t. every parameter, compiled temp bytes) of a small model's summed output."""
    import jax.numpy as jnp

    cfg = ModelConfig(n_layers=n_layers, d_model=32, n_heads=2, d_ff=64, seq_len=64)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    tokens = jnp.arange(4 * cfg.seq_len).reshape(4, cfg.seq_len) % cfg.vocab_size

    def loss(p):
        return jnp.sum(_run(nnx.merge(graphdef, p), tokens, remat) ** 2) * 1e-4

    step = jax.jit(jax.value_and_grad(loss))
    return (*step(params), step.lower(params).compile().memory_analysis().temp_size_in_bytes)


@pytest.mark.slow
def test_sqrt_remat_with_a_prime_layer_count_uses_about_sqrt_l_segments():
    """L=13: segments of round(sqrt 13) = 4 layers and a last one of 1, not one segment of 13.
    Same values and gradients as no remat; far fewer temporaries than keeping every layer's."""
    from jaxpar.train.remat import sqrt_segment_size

    assert [sqrt_segment_size(n) for n in (1, 4, 7, 11, 13, 16)] == [1, 2, 3, 3, 4, 4]
    value, grads, none_bytes = _remat_gradients(13, "none")
    sqrt_value, sqrt_grads, sqrt_bytes = _remat_gradients(13, "sqrt")
    assert abs(float(sqrt_value) - float(value)) <= 1e-6 * abs(float(value))
    for a, b in zip(jax.tree.leaves(sqrt_grads), jax.tree.leaves(grads)):
        assert float(jax.numpy.linalg.norm(a - b)) <= 1e-5 * float(jax.numpy.linalg.norm(b)) + 1e-12
    # A single 13-layer segment would keep all 13 layers' activations while recomputing it.
    assert sqrt_bytes < 0.5 * none_bytes, (sqrt_bytes, none_bytes)
