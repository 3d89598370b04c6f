"""Host offload, bf16 gradient reductions and local SGD: each verified against the single device
(local SGD against R single-device replicas), with their bytes read from the program."""

import json

import pytest
from helpers import resumed_run_matches

from jaxpar.config.precision import POLICIES
from jaxpar.verify import local_sgd as verify_local_module
from jaxpar.verify.run import verify

TINY = ["configs/tiny_test.yaml", "train.steps=3", "mesh.tensor=1"]


@pytest.fixture
def tiny(tmp_path):
    from jaxpar.config.presets import load_config
    from jaxpar.train.run_session import prepare

    def build(*overrides):
        return prepare(load_config(TINY[0], [*TINY[1:], f"run.dir={tmp_path / 'run'}", *overrides]))

    return build


SLOW = pytest.mark.slow


@pytest.mark.parametrize("layout", [
    # optimizer and activations each alone are the two halves of `both`, run on ZeRO-3 below
    # the state comes over whole
    pytest.param(["mesh.data=8", "train.optimizer=adafactor", "train.offload=optimizer"], marks=SLOW),
    pytest.param(["mesh.data=4", "mesh.tensor=2", "parallel.zero=3", "train.offload=both"], marks=SLOW),
    pytest.param(["mesh.data=2", "mesh.tensor=2", "mesh.stage=2", "parallel.zero=2", "train.offload=optimizer"],
                 marks=SLOW),
])
def test_offload_matches_single_device_at_fp32(tiny, layout):
    result = verify(tiny(*layout), log=lambda line: None)
    assert result["ok"] and result["loss_max_rel_err"] <= 1e-5 and result["param_max_rel_err"] <= 1e-4, result


def test_plan_puts_offloaded_bytes_on_the_host_and_counts_the_transfers(tiny):  # the quick tier's offload
    from jaxpar.plan import measure_step
    from jaxpar.train.trainer import Trainer

    plain = measure_step(Trainer(tiny("mesh.data=8", "parallel.zero=1", "train.remat=full")))
    both = measure_step(Trainer(tiny("mesh.data=8", "parallel.zero=1", "train.offload=both")))
    assert plain["host_bytes"] == {"params": 0, "opt_state": 0, "activations": 0}
    assert not any(v for moved in plain["host_transfer_bytes"].values() for v in moved.values())
    opt = both["opt_state_bytes"]
    assert both["host_bytes"]["opt_state"] == opt and both["device_bytes"]["opt_state"] == 0
    assert both["host_transfer_bytes"]["optimizer"] == {"to_device": opt, "to_host": opt}
    # AdamW's update goes layer by layer: the embedding's state and one of the two layers' at a time
    layer_state = (opt - both["device_bytes"]["opt_state_update_peak"])
    assert 0 < layer_state < opt / 2
    # the 2 layers' inputs (batch 16 x 64 positions x 64 wide, fp32) split over 8 devices, each way once
    layer_inputs = 2 * 16 * 64 * 64 * 4 // 8
    assert both["host_transfer_bytes"]["activations"] == {"to_device": layer_inputs, "to_host": layer_inputs}
    assert both["host_bytes"]["activations"] == layer_inputs


@SLOW
def test_bf16_gradient_reduction_verifies_and_halves_the_bytes(tiny):
    from jaxpar.plan import measure_step
    from jaxpar.train.trainer import Trainer

    result = verify(tiny("mesh.data=8", "parallel.zero=2", "parallel.grad_reduce_dtype=bf16"), log=lambda line: None)
    _, param_tol = POLICIES["bf16"].tolerances
    assert result["ok"] and result["param_max_rel_err"] <= param_tol, result
    # the reduction really was rounded: fp32 layouts of this model agree with one device to about 1e-7
    assert result["param_max_rel_err"] > 1e-5
    # the same layout reduced by hand in fp32 (mesh.expert=2 makes the batch axes manual) sends twice the bytes
    sent = {}
    for dtype in ("fp32", "bf16"):
        plan = measure_step(Trainer(tiny("mesh.data=4", "mesh.expert=2", "parallel.zero=2",
                                         f"parallel.grad_reduce_dtype={dtype}")))
        ops = [op for op in plan["collective_ops"] if op["op"] in ("reduce-scatter", "all-to-all")]
        sent[dtype] = sum(op["wire_bytes"] * op["count"] for op in ops)
        assert {op["op"] for op in ops} == {"reduce-scatter" if dtype == "fp32" else "all-to-all"}
    assert sent["bf16"] * 2 == sent["fp32"]


@pytest.mark.parametrize("layout", [
    ["mesh.data=8", "parallel.sync_every=2", "parallel.outer=avg"],  # the quick tier's local SGD
    pytest.param(["mesh.data=4", "mesh.tensor=2", "parallel.sync_every=2", "parallel.outer=nesterov"], marks=SLOW),
])
def test_local_sgd_matches_single_device_replicas(tiny, layout):
    result = verify(tiny("train.steps=4", *layout), log=lambda line: None)
    assert result["ok"] and result["loss_max_rel_err"] <= 1e-5 and result["param_max_rel_err"] <= 1e-4, result


@SLOW
def test_local_sgd_verify_can_fail(tiny, monkeypatch):
    """A reference that never synchronizes its replicas is reported."""
    monkeypatch.setattr(verify_local_module, "_outer_numpy", lambda replicas, outer, p: replicas)
    result = verify(tiny("train.steps=4", "mesh.data=8", "parallel.sync_every=2"), log=lambda line: None)
    assert not result["ok"] and result["param_max_rel_err"] > 1e-4


@SLOW
def test_local_sgd_has_no_gradient_all_reduce_over_data(tiny):
    from jaxpar.plan import measure_step
    from jaxpar.train.trainer import Trainer

    for extra in (["parallel.sync_every=1"], ["parallel.sync_every=4"]):
        plan = measure_step(Trainer(tiny("mesh.data=4", "mesh.tensor=2", *extra)))
        over_data = [op for op in plan["collective_ops"] if "data" in op["mesh_axes"]]
        if extra == ["parallel.sync_every=1"]:
            assert any(op["count"] > 1 for op in over_data)  # the synchronous step reduces every layer's gradient
        else:
            # only the synchronization (one average of the weights, outside the layer loop) and scalar metrics
            assert all(op["count"] == 1 for op in over_data)
            weights = plan["params_bytes"]
            assert max(op["bytes"] for op in over_data) == weights


@SLOW
def test_local_sgd_checkpoint_resumes_exactly(tmp_path, capsys):
    common = ["mesh.data=4", "mesh.tensor=2", "parallel.sync_every=3", "parallel.outer=nesterov"]
    assert resumed_run_matches(capsys, tmp_path, common, steps=8, cut=4)
    whole = tmp_path / "whole"
    rows = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "replica_spread" in r] == [3, 6]
    assert all(r["replica_spread"] > 0 for r in rows if "replica_spread" in r)


@SLOW
def test_offloaded_optimizer_checkpoint_resumes_exactly(tmp_path, capsys):
    """The state saved from pinned host memory restores into it and training goes on bit-identically."""
    common = ["mesh.data=4", "mesh.tensor=2", "parallel.zero=1", "train.offload=both"]
    assert resumed_run_matches(capsys, tmp_path, common, steps=6, cut=3)
