"""MoE options measured on the training objective itself (one device, a tiny model):
`model.moe.z_loss_weight` adds exactly weight x z-loss, and `model.moe.noise=false` makes
noisy top-k routing independent of the noise key."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar.config.presets import load_config
from jaxpar.data import BatchSampler, load_tokens
from jaxpar.data.packed_rows import PackedRows
from jaxpar.laid_out.forward import RowInputs
from jaxpar.model import Transformer
from jaxpar.model.moe_step import ExpertTerms, row_keys
from jaxpar.train.step import objective

# This module's fixtures are built once, on one pytest-xdist worker
pytestmark = pytest.mark.xdist_group("test_moe_options")

# Two layers, both MoE (every=1), four groups of 32 tokens per batch.
TINY_MOE = ("model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.n_layers=2", "model.seq_len=32",
            "model.moe.experts=4", "model.moe.every=1", "model.moe.group_size=32", "model.moe.router=topk")
MOE_LAYERS = 2


@pytest.fixture(scope="module")
def objective_of():
    """noise (True/False) -> jitted (noise_key, z_loss_weight) -> (objective, stats) on one fixed batch.

    The z-loss weight is a traced argument, so one compiled program serves every weight; it
    enters `objective` through the MoE config exactly as the configured value does.
    """
    tokens = BatchSampler(load_tokens("builtin", 256), 32, 4, 0).batch(0)
    fns = {}
    for noise in (True, False):
        cfg = load_config(None, [*TINY_MOE, f"model.moe.noise={str(noise).lower()}"])
        assert cfg.model.moe.noise is noise
        graphdef, params = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(0)))

        def run(key, z_weight, graphdef=graphdef, params=params, cfg=cfg):
            moe = dataclasses.replace(cfg.model.moe, z_loss_weight=z_weight)
            rows = RowInputs(row_keys(key, tokens.shape[0]))  # the step's per-row noise keys
            experts = ExpertTerms.build(moe, cfg.train.seed, cfg.model.n_layers, 1, trace_routing=False)
            return objective(nnx.merge(graphdef, params), PackedRows.of(tokens), rows, cfg, experts)

        jitted = jax.jit(run)
        fns[noise] = lambda key, z_weight=0.0, jitted=jitted: jax.tree.map(
            np.asarray, jax.device_get(jitted(key, np.float32(z_weight))))
    return fns


@pytest.mark.slow
@pytest.mark.parametrize("weight", [0.5, 1e-3])
def test_z_loss_weight_adds_exactly_weight_times_z(objective_of, weight):
    key = jax.random.PRNGKey(7)
    value_0, stats_0 = objective_of[True](key, 0.0)
    value_w, stats_w = objective_of[True](key, weight)
    # the weight changes the objective only: the same routing, cross-entropy and z-loss
    for name in stats_0:
        np.testing.assert_array_equal(stats_0[name], stats_w[name], err_msg=name)
    z = float(stats_0["moe_z_loss"])  # mean over the MoE layers; the objective sums them
    assert z > 0.1
    # fp32: the two objectives are rounded independently, so allow two ulps of the objective
    ulp = float(np.spacing(np.float32(value_w)))
    assert abs((float(value_w) - float(value_0)) - weight * z * MOE_LAYERS) <= 2 * ulp


@pytest.mark.slow
def test_noise_false_routes_the_same_whatever_the_key(objective_of):
    key_a, key_b = jax.random.PRNGKey(1), jax.random.PRNGKey(2)
    quiet = objective_of[False]
    a, b = quiet(key_a), quiet(key_b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)  # bit-identical objective and routing statistics

    noisy = objective_of[True]
    a, b, again = noisy(key_a), noisy(key_b), noisy(key_a)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(x, y)  # the same key routes the same way
    assert not np.array_equal(a[1]["moe_expert_tokens"], b[1]["moe_expert_tokens"])
    assert float(a[0]) != float(b[0])
