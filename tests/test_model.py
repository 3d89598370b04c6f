"""The model names logical axes only; the rules table turns them into mesh layouts."""

import re
from pathlib import Path

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.config import ModelConfig
from jaxpar.model import LOGICAL_AXES, Transformer
from jaxpar.parallel import RULES, Layout, logical_to_spec
from jaxpar.runtime import make_mesh

MODEL_DIR = Path(__file__).resolve().parent.parent / "jaxpar" / "model"


def test_model_code_imports_no_parallel_or_train_and_names_no_mesh_axis():
    for path in MODEL_DIR.glob("*.py"):
        source = path.read_text()
        assert not re.search(r"^\s*(from|import) jaxpar\.(parallel|train|runtime)", source, re.M), path
        assert not re.search(r"[\"'](data|tensor|stage)[\"']", source), path


def test_every_parameter_has_logical_names_from_the_table():
    model = nnx.eval_shape(lambda: Transformer(ModelConfig(), rngs=nnx.Rngs(0)))
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        names = variable.get_metadata()["out_sharding"]
        assert len(names) == len(variable.shape), path
        assert set(names) - {None} <= set(LOGICAL_AXES) and set(names) - {None} <= set(RULES)


def test_megatron_layout_of_the_weights():
    model = nnx.eval_shape(lambda: Transformer(ModelConfig(), rngs=nnx.Rngs(0)))
    mesh = make_mesh({"data": 4, "tensor": 2, "expert": 1, "stage": 1}, jax.devices())
    specs = Layout(mesh).param_specs(nnx.state(model))
    blocks = specs["blocks"]
    # the stacked layers dimension goes to the pipeline axis `stage` (size 1 here)
    assert blocks["mlp"]["w_up"].get_value() == P("stage", None, "tensor")      # column split
    assert blocks["mlp"]["w_down"].get_value() == P("stage", "tensor", None)    # row split
    assert blocks["attn"]["w_qkv"].get_value() == P("stage", None, None, "tensor", None)  # by heads
    assert blocks["attn"]["wo"].get_value() == P("stage", "tensor", None, None)
    assert specs["embedding"].get_value() == P("tensor", None)               # vocab-parallel
    assert logical_to_spec(("batch", "seq", "embed")) == P(("data", "expert"), None, None)


def test_stacked_layers_scan_gives_the_same_output_as_a_python_loop():
    import jax.numpy as jnp

    cfg = ModelConfig(d_model=32, n_heads=2, d_ff=64, n_layers=3, seq_len=8)
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    graphdef, stacked = nnx.split(model.blocks)
    looped = x
    for i in range(cfg.n_layers):
        looped, _ = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], stacked))(looped)
    assert jnp.allclose(model.run_blocks(x)[0], looped, rtol=1e-5, atol=1e-6)


def _remat_gradients(n_layers: int, remat: str):
    """(value, gradient w.r.t. every parameter, compiled temp bytes) of a small model's summed output."""
    import jax.numpy as jnp

    cfg = ModelConfig(n_layers=n_layers, d_model=32, n_heads=2, d_ff=64, seq_len=64)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    tokens = jnp.arange(4 * cfg.seq_len).reshape(4, cfg.seq_len) % cfg.vocab_size

    def loss(p):
        return jnp.sum(nnx.merge(graphdef, p)(tokens, remat=remat) ** 2) * 1e-4

    step = jax.jit(jax.value_and_grad(loss))
    return (*step(params), step.lower(params).compile().memory_analysis().temp_size_in_bytes)


def test_sqrt_remat_with_a_prime_layer_count_uses_about_sqrt_l_segments():
    """L=13: segments of round(sqrt 13) = 4 layers and a last one of 1, not one segment of 13.
    Same values and gradients as no remat; far fewer temporaries than keeping every layer's."""
    from jaxpar.model.transformer import sqrt_segment_size

    assert [sqrt_segment_size(n) for n in (1, 4, 7, 11, 13, 16)] == [1, 2, 3, 3, 4, 4]
    value, grads, none_bytes = _remat_gradients(13, "none")
    sqrt_value, sqrt_grads, sqrt_bytes = _remat_gradients(13, "sqrt")
    assert abs(float(sqrt_value) - float(value)) <= 1e-6 * abs(float(value))
    for a, b in zip(jax.tree.leaves(sqrt_grads), jax.tree.leaves(grads)):
        assert float(jax.numpy.linalg.norm(a - b)) <= 1e-5 * float(jax.numpy.linalg.norm(b)) + 1e-12
    # A single 13-layer segment would keep all 13 layers' activations while recomputing it.
    assert sqrt_bytes < 0.5 * none_bytes, (sqrt_bytes, none_bytes)
