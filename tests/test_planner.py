"""The layout planner: the roofline's arithmetic, the enumeration of layouts, the memory ladder,
pruning to the top rows, the compiled-plan cache, and `jaxpar plan --search` end to end."""

import json
import math

import jax
import pytest

from jaxpar.cli import main
from jaxpar.config.presets import load_config
from jaxpar.features.validation import validate
from jaxpar.plan.roofline import predict
from jaxpar.plan.search import enumerate_layouts, floor_seconds, search
from jaxpar.runtime.hardware import Hardware
from jaxpar.train.model_flops import matmul_flops_floor

# A made-up profile with round numbers, so the expected figures below can be worked out by hand.
ROUND = Hardware("round", {"float32": 1e9, "bfloat16": 2e9, "float16": 2e9}, 1e12, 8, 1e8, 1e7, 1e-3, 1e-2, True,
                 "test", 1e9)
TINY = ["configs/tiny_test.yaml"]


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """An empty cache of calibrations and compiled plans, for a test that counts what it measures or compiles
    (the others share the run's: tests/conftest.py)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def op(axes, wire_bytes, count):
    return {"op": "all-reduce", "mesh_axes": axes, "wire_bytes": wire_bytes, "bytes": wire_bytes, "count": count}


def test_roofline_terms_and_overlap():
    plan = {"executed_flops_per_stage": [3e9, 4e9], "written_bytes_per_stage": [1e9, 5e8],
            "collective_ops": [op(["data"], 1e8, 2), op(["tensor"], 1e7, 10), op(["data", "tensor"], 1e6, 1)]}
    sizes = {"data": 2, "tensor": 3, "expert": 1, "stage": 1}  # groups of 2, 3 and 6: 1, 2 and 5 ring steps
    p = predict(plan, ROUND, "float32", idle_fraction=0.2, across_hosts=set(), sizes=sizes)
    assert p.compute == pytest.approx(4.0) and p.memory == pytest.approx(1.0)  # the busiest stage of each
    assert p.bubble == pytest.approx(5.0 * 0.2 / 0.8)
    data_only = 2 * (1e-3 + 1e8 / 1e8)  # overlaps compute and memory work: 2.002 s < 5 s, so hidden
    critical = 10 * (2 * 1e-3 + 1e7 / 1e8) + (5 * 1e-3 + 1e6 / 1e8)  # tensor groups: on the critical path
    assert p.communication == pytest.approx(data_only + critical)
    assert p.exposed_communication == pytest.approx(critical)
    assert p.seconds == pytest.approx(5.0 + critical + 1.25)
    assert p.limiting == "compute"
    # across hosts, the data collectives take the slower link and no longer hide under compute
    q = predict(plan, ROUND, "float32", 0.2, across_hosts={"data"}, sizes=sizes)
    data_slow = 2 * (1e-2 + 1e8 / 1e7)  # 20.02 s: 5 of them hidden under compute and memory work
    critical_slow = 10 * (2 * 1e-3 + 1e7 / 1e8) + (5 * 1e-2 + 1e6 / 1e7)  # the data x tensor op crosses hosts too
    assert q.communication == pytest.approx(data_slow + critical_slow)
    assert q.seconds == pytest.approx(5.0 + critical_slow + (data_slow - 5.0) + 1.25)
    assert q.limiting == "communication"
    cpu_like = Hardware(**{**ROUND.to_dict(), "overlaps_collectives": False})
    assert predict(plan, cpu_like, "float32", 0.0, set(), sizes).seconds == pytest.approx(5.0 + data_only + critical)


def test_enumeration_is_valid_deduplicated_and_laddered():
    cfg = load_config(None)
    ladders = enumerate_layouts(cfg, 8, {})
    rungs = [r for ladder in ladders for r in ladder]
    for r in rungs:
        validate(cfg.replace(**r), 8)
        assert r["mesh.expert"] == 1  # a dense model: the expert axis would be a second data axis
        assert r["parallel.zero"] == 0 or r["mesh.data"] > 1
        assert r["train.remat"] != "sqrt" or cfg.model.n_layers // r["mesh.stage"] >= 4
    meshes = {(r["mesh.data"], r["mesh.tensor"], r["mesh.stage"]) for r in rungs}
    # tensor divides the 4 heads, stage the 4 layers
    assert meshes == {(8, 1, 1), (4, 2, 1), (2, 4, 1), (4, 1, 2), (2, 2, 2), (1, 4, 2), (2, 1, 4), (1, 2, 4)}
    plain = next(ladder for ladder in ladders if ladder[0]["mesh.stage"] == 1 and ladder[0]["mesh.data"] == 2)
    order = [(r["train.remat"], r["train.grad_accum"]) for r in plain]
    assert order[:4] == [("none", 1), ("none", 2), ("none", 4), ("none", 8)] and order[4] == ("dots", 1)
    schedules = {r["parallel.pipeline.schedule"] for r in rungs if r["mesh.stage"] > 1}
    assert schedules == {"gpipe", "1f1b", "2bw", "interleaved", "zb-h1", "zbv"}  # zbv at S=2 only (2S | 4 layers)
    held = enumerate_layouts(cfg, 8, {"mesh.tensor": 2, "parallel.zero": 1})
    assert held and all(r["mesh.tensor"] == 2 and r["parallel.zero"] == 1 for ladder in held for r in ladder)


def tiny_search(budget=1e12, top=None, **fixed):
    cfg = load_config(TINY[0])
    return search(cfg, jax.devices()[:2], ROUND, budget, {"mesh.stage": 1, **fixed}, progress=False, top=top)


@pytest.mark.slow
def test_search_ranks_prunes_and_caches(own_cache):
    full = tiny_search()
    ranked = full.ranked
    assert len(ranked) == len(full.candidates) == 5  # data 2 (zero 0-3), tensor 2
    assert full.compiled == 5 and full.cached == 0 and full.pruned == 0
    times = [c.prediction.seconds for c in ranked]
    assert times == sorted(times) and len(set(times)) > 3
    # with top=2, 1F1B pipelines at M=S=2 (a third of the ticks idle) have floors no better than the
    # second best: they are pruned without compiling, and the top rows stay as they were (zb-h1 idles
    # a seventh of its ticks there, and its floor is lower: the schedule is held at 1f1b)
    cfg, devices = load_config(TINY[0]), jax.devices()[:2]
    held = {"parallel.pipeline.microbatches": 2, "parallel.pipeline.schedule": "1f1b"}
    with_pipelines = enumerate_layouts(cfg, 2, held)
    pipelines = [ladder for ladder in with_pipelines if ladder[0]["mesh.stage"] == 2]
    floor = matmul_flops_floor(cfg)
    assert pipelines and all(floor_seconds(floor, ladder, 2, 1e9) >= ranked[1].prediction.seconds
                             for ladder in pipelines)
    again = search(cfg, devices, ROUND, 1e12, held, progress=False, top=2)
    assert again.compiled == 0 and again.cached == 5 and again.pruned == len(pipelines)
    assert [c.name for c in again.ranked[:2]] == [c.name for c in ranked[:2]]
    # a budget just under the best layout's bytes: the best drops out, everything ranked fits (the ladders
    # held at their first rung, compiled above: a rung that fits lower down is the memory ladder's test below)
    tight = tiny_search(budget=ranked[0].bytes_per_device - 1, **{"train.remat": "none", "train.grad_accum": 1})
    assert tight.compiled == 0
    assert tight.ranked and ranked[0].name not in [c.name for c in tight.ranked]
    assert all(c.bytes_per_device < ranked[0].bytes_per_device for c in tight.ranked)


@pytest.mark.slow
def test_memory_ladder_takes_the_first_rung_that_fits():
    layout = {"mesh.data": 2, "mesh.tensor": 1, "mesh.expert": 1, "parallel.zero": 0}
    roomy = tiny_search(**layout)
    assert [c.overrides["train.grad_accum"] for c in roomy.candidates] == [1]
    first = roomy.candidates[0]
    tight = tiny_search(budget=first.bytes_per_device - 1, **layout)
    rungs = [(c.overrides["train.remat"], c.overrides["train.grad_accum"]) for c in tight.candidates]
    assert rungs[0] == ("none", 1) and len(rungs) >= 2
    best = tight.ranked[0]
    assert best.bytes_per_device < first.bytes_per_device
    assert (best.overrides["train.remat"], best.overrides["train.grad_accum"]) == rungs[-1]


def test_no_layout_fits_is_one_sentence(capsys):
    code = main(["plan", "--search", *TINY, "run.devices=4", "mesh.stage=1", "--memory-gb", "1e-6",
                 "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert all(line.startswith("jaxpar: measuring the cpu profile") for line in err[:-1])  # on its first use
    assert err[-1].startswith("jaxpar: error: none of the 96 layouts fits in 1e-06 GB per device; "
                                               "the smallest, data=4 zero=3 fp32, needs ")
    assert err[-1].endswith(" GB for its state alone.")


@pytest.mark.slow
def test_plan_search_best_trains(capsys, tmp_path):
    # compiled in this process: the search's worker processes (one per core by default) are started by
    # test_no_layout_fits_is_one_sentence; here they added 12 s of CPU to 48 (2 cores, 2026-12-03)
    code = main(["plan", "--search", *TINY, "run.devices=4", "mesh.stage=1", "parallel.zero=0", "--no-progress",
                 "--top", "3", "--processes", "1"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    result = json.loads(out[-1])
    assert result["candidates"] >= 3 and result["fit"] >= 1 and result["hardware"] == "cpu"
    assert 0 < result["predicted_step_s"] < math.inf and 0 < result["predicted_mfu"]
    assert out[0].split()[:3] == ["rank", "layout", "GiB/device"] and out[1].split()[0] == "1"
    assert out[-2].startswith("train it: jaxpar train configs/tiny_test.yaml run.devices=4 ")
    best = [f"{k}={v}" for k, v in result["best"].items()]
    assert main(["train", *TINY, "run.devices=4", *best, "train.steps=2", f"run.dir={tmp_path / 'run'}",
                 "--no-progress"]) == 0


def test_cpu_profile_is_measured_once(own_cache, tmp_path):
    from jaxpar.plan import calibrate

    first = calibrate.cpu_profile(jax.devices())
    assert set(first.peak_flops) == {"float32", "bfloat16", "float16"}  # by compute dtype (jaxpar.config.precision)
    assert all(0 < v < math.inf for v in first.peak_flops.values())
    machine = first.machine  # the machine it was measured on
    assert machine["processor"] and machine["native_bf16"] in (True, False) and machine["devices"] == 8
    assert set(machine["matmul_flops"]) == {"float32", "bfloat16"} and min(machine["matmul_flops"].values()) > 0
    assert 0 < first.intra_host_bandwidth and 0 <= first.intra_host_latency_s < 1 and not first.overlaps_collectives
    assert len(list((tmp_path / "cache" / "jaxpar").glob("cpu-profile-*.json"))) == 1
    assert calibrate.cpu_profile(jax.devices()) == first  # read back, not measured again (timings would differ)

