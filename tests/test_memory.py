"""ZeRO, Adafactor and remat memory claims, read from the compiled program (deterministic)."""

import pytest

from jaxpar.plan import measure_step
from jaxpar.train.trainer import Trainer

# This module's fixtures are built once, on one pytest-xdist worker
pytestmark = pytest.mark.xdist_group("test_memory")

# An 8.7M-parameter model (P = 34.9 MB fp32) on data=8.
MODEL_8M = ("model.d_model=256", "model.n_layers=11", "model.n_heads=8", "model.d_ff=1024", "mesh.data=8")
# Activations dominate: 32 layers, 8 sequences of 256 tokens per device.
DEEP = ("model.n_layers=32", "model.seq_len=256", "train.batch_size=64", "mesh.data=8")


@pytest.fixture(scope="module")
def plans():
    """Measure each named layout once per test module."""
    import os

    from jaxpar.config.presets import load_config
    from jaxpar.train.run_session import prepare

    cache = {}

    def plan(*overrides):
        if overrides not in cache:
            session = prepare(load_config(None, [f"run.dir={os.devnull}", *overrides]))
            cache[overrides] = measure_step(Trainer(session))
        return cache[overrides]

    return plan


@pytest.mark.slow
def test_zero_stages_cut_state_bytes_as_predicted(plans):
    """The compiled step's arguments (the state, plus a 2 KB batch and a few scalars) are within
    0.1% of the ZeRO formulas for Adam (parameters P, two moments 2P) on data=8."""
    P = plans(*MODEL_8M)["params_bytes"]
    assert P >= 8e6 * 4
    expected = {0: 3 * P, 1: P + 2 * P / 8, 2: P + 2 * P / 8, 3: 3 * P / 8}
    for stage, want in expected.items():
        got = plans(*MODEL_8M, f"parallel.zero={stage}")["argument_bytes"]
        assert abs(got - want) <= 0.001 * want, (stage, got, want)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero2_and_3_sum_each_gradient_once_into_shards(plans, stage):
    """Every gradient is summed over the 8 devices once, layer by layer, and each device keeps 1/8.

    XLA's SPMD partitioner writes a reduce-scatter as an all-reduce of the layer's gradient
    followed by a local slice; the GPU compiler fuses the pair into a reduce-scatter
    (ReduceScatterCreator), XLA:CPU keeps both. So the reduced bytes are counted in either
    form: P in all (the tied embedding's two contributions are summed separately, 0.75% more).
    """
    plan = plans(*MODEL_8M, f"parallel.zero={stage}")
    P = plan["params_bytes"] if stage < 3 else plan["params_bytes"] * 8
    assert P == plans(*MODEL_8M)["params_bytes"]
    reduced = plan["collectives"]["all-reduce"] + 8 * plan["collectives"]["reduce-scatter"]
    assert P <= reduced <= 1.01 * P, (reduced, P)
    # summed inside the layer scan, one layer at a time: no collective carries more than a layer
    layer_bytes = P / 11 * 1.01
    assert all(c["bytes"] <= layer_bytes for c in plan["collective_ops"] if c["op"] == "all-reduce"), \
        plan["collective_ops"]
    assert plan["grads_bytes"] == P / 8


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("train.remat=full",)],
                         ids=["remat none", "remat full"])
def test_sharded_optimizer_keeps_gradient_shards_only(plans, extra):
    """From ZeRO-1 on, temporaries hold gradient shards, not whole gradients: about P - P/8 less
    than ZeRO-0. (ZeRO-2 asks for it; under ZeRO-1 the partitioner finds it by itself, since the
    sharded optimizer reads only each device's slice of the summed gradient.)"""
    zero0 = plans(*MODEL_8M, *extra, "parallel.zero=0")
    P = zero0["params_bytes"]
    for stage in (1, 2, 3):
        temp = plans(*MODEL_8M, *extra, f"parallel.zero={stage}")["temp_bytes"]
        assert temp < zero0["temp_bytes"] - 0.8 * (P - P / 8), (stage, temp, zero0["temp_bytes"])


@pytest.mark.slow
def test_adafactor_state_is_a_small_fraction_of_adamw(plans):
    adamw = plans(*MODEL_8M)["opt_state_bytes"]
    adafactor = plans(*MODEL_8M, "train.optimizer=adafactor")["opt_state_bytes"]
    assert adafactor < 0.1 * adamw


@pytest.mark.slow
def test_remat_policies_trade_memory_for_flops(plans):
    none, full, dots, sqrt = (plans(*DEEP, f"train.remat={r}") for r in ("none", "full", "dots", "sqrt"))
    assert sqrt["temp_bytes"] <= 0.4 * none["temp_bytes"]
    assert full["temp_bytes"] <= sqrt["temp_bytes"]
    assert dots["temp_bytes"] < none["temp_bytes"]
    for policy in (sqrt, full):
        assert none["flops"] < policy["flops"] <= 1.4 * none["flops"]


def test_plan_cli_prints_table_and_json(capsys, tmp_path):
    import json

    from jaxpar.cli import main

    assert main(["plan", "mesh.data=4", "mesh.tensor=2", "parallel.zero=1", f"run.dir={tmp_path}"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    for key in ("argument_bytes", "output_bytes", "temp_bytes", "params_bytes", "opt_state_bytes", "flops"):
        assert result[key] > 0
    assert set(result["collectives"]) == {"all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                                          "collective-permute", "ragged-all-to-all"}
    assert any(line.startswith("optimizer state") for line in out)
    assert not (tmp_path / "metrics.jsonl").exists(), "plan compiles only; it trains nothing"


@pytest.mark.slow
def test_matmul_flops_count_every_layer(plans):
    """The plan's FLOPs multiply loop bodies by their trip counts: they match the analytic
    6 x matmul params x tokens + attention (12 x layers x seq x d_model per token)."""
    D, F, V, L, seq, tokens = 128, 512, 256, 32, 256, 64 * 256 // 8
    expected = tokens * (6 * ((4 * D * D + 2 * D * F) * L + V * D) + 12 * L * seq * D)
    assert plans(*DEEP, "train.remat=none")["flops"] == pytest.approx(expected, rel=0.01)
