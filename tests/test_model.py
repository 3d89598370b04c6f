"""The model names logical axes only; the rules table turns them into mesh layouts."""

import re
from pathlib import Path

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.config import ModelConfig
from jaxpar.model import LOGICAL_AXES, Transformer
from jaxpar.parallel import RULES, Layout, logical_to_spec
from jaxpar.runtime.devices import make_mesh

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
    mesh = make_mesh({"data": 4, "tensor": 2, "expert": 1, "stage": 1, "context": 1}, jax.devices())
    specs = Layout.build(mesh, nnx.state(model)).param_specs(nnx.state(model))
    blocks = specs["blocks"]
    # the stacked layers dimension goes to the pipeline axis `stage` (size 1 here)
    assert blocks["mlp"]["w_up"].get_value() == P("stage", None, "tensor")      # column split
    assert blocks["mlp"]["w_down"].get_value() == P("stage", "tensor", None)    # row split
    assert blocks["attn"]["w_qkv"].get_value() == P("stage", None, None, "tensor", None)  # by heads
    assert blocks["attn"]["wo"].get_value() == P("stage", "tensor", None, None)
    assert specs["embedding"].get_value() == P("tensor", None)               # vocab-parallel
    assert logical_to_spec(("batch", "seq", "embed")) == P(("data", "expert"), None, None)


@pytest.mark.slow
def test_stacked_layers_scan_gives_the_same_output_as_a_python_loop():
    import jax.numpy as jnp

    cfg = ModelConfig(d_model=32, n_heads=2, d_ff=64, n_layers=3, seq_len=8)
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    graphdef, stacked = nnx.split(model.blocks)
    looped = x
    for i in range(cfg.n_layers):
        looped, _ = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], stacked))(looped)
    assert jnp.allclose(model.run_blocks(x)[0], looped, rtol=1e-5, atol=1e-6)
