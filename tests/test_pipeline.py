"""Pipeline parallelism: schedule tables, the chart command, and every schedule against the
single-device reference."""

import json

import pytest
from helpers import SMALL_MODEL

from jaxpar.parallel.schedules import Action, build, stash_size, theoretical_idle_fraction
from jaxpar.verify import run as verify_module
from jaxpar.verify.run import verify

TABLES = [(s, S, M, 1) for s in ("gpipe", "1f1b") for S in (2, 3, 4) for M in (S, 2 * S, 8)] + [
    ("interleaved", S, M, v) for S in (2, 4) for M in (S, 2 * S, 4 * S) for v in (2, 3)] + [
    ("naive", S, 1, 1) for S in (2, 3, 4)]


@pytest.mark.parametrize("schedule, S, M, v", TABLES)
def test_table_respects_dependencies_and_the_bubble_formula(schedule, S, M, v):
    table = build(schedule, S, M, v)
    when = {}
    for t, row in enumerate(table.ticks):
        for s, action in enumerate(row):
            if action is not None:
                assert action not in when, "each unit of work runs once"
                assert action.chunk % S == s, "a chunk runs on its own stage"
                when[action] = t
    chunks = S * v
    assert len(when) == 2 * M * chunks
    for (kind, i, k), t in when.items():
        if kind == "F" and k > 0:
            assert when[Action("F", i, k - 1)] < t
        if kind == "B":
            assert when[Action("F", i, k)] < t
            if k < chunks - 1:
                assert when[Action("B", i, k + 1)] < t
    assert table.idle_fraction == pytest.approx(theoretical_idle_fraction(S, M, v))
    if schedule == "1f1b":
        assert max(table.in_flight(s) for s in range(S)) <= S
        assert stash_size(table) <= S
    if schedule == "gpipe":
        assert table.in_flight(0) == M


@pytest.mark.parametrize("S", [2, 4, 8])
def test_naive_runs_one_batch_forward_through_the_stages_then_back(S):
    table = build("naive", S, 1)
    assert [[(a.kind, a.chunk) for a in row if a is not None] for row in table.ticks] == (
        [[("F", s)] for s in range(S)] + [[("B", s)] for s in reversed(range(S))])
    assert table.idle_fraction == (S - 1) / S  # each stage busy 2 ticks of 2S


def test_naive_schedule_cli_draws_it(tmp_path, capsys):
    from jaxpar.cli import main

    out = tmp_path / "naive.png"
    assert main(["schedule", "--schedule", "naive", "--stages", "4", "--microbatches", "1", "--out", str(out)]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["schedule"] == "naive" and last["idle_fraction"] == last["theoretical_idle_fraction"] == 0.75
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_schedule_cli_reports_idle_fraction_and_draws(tmp_path, capsys):
    from jaxpar.cli import main

    out = tmp_path / "gpipe.png"
    assert main(["schedule", "--schedule", "gpipe", "--stages", "4", "--microbatches", "8", "--out", str(out)]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["schedule"] == "gpipe" and last["idle_fraction"] == pytest.approx(3 / 11)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["schedule", "--schedule", "interleaved", "--stages", "4", "--microbatches", "8",
                 "--virtual", "2"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["idle_fraction"] == pytest.approx(3 / (2 * 8 + 3))
    assert main(["schedule", "--schedule", "zigzag", "--stages", "4", "--microbatches", "8"]) == 2


# Plain 1F1B over stage is verified by tests/test_factorisations.py (with experts, by
# tests/test_moe_pipeline.py); here each
# schedule at the stage and microbatch counts that change its table, and the pipeline composed with the
# rest (every ZeRO stage, tensor, sequence parallelism, remat, recompute, bf16), switches that do not
# interact sharing a run. 1F1B with recompute on tensor=2 x stage=4 and interleaved on tensor=4 x stage=2
# are also the plain verifies of those factorisations (tests/test_factorisations.py leaves them here).
# The quick tier keeps the interleaved layout (the 1F1B executor, layers stored out of order) and 2BW
# (steps that overlap, over 6 steps and the drain); GPipe's executor is compiled there by the test below.
QUICK_LAYOUTS = [  # 4 layers: a chunk of one layer for each of the 2 x 2 virtual stages
    ["parallel.pipeline.schedule=interleaved", "mesh.stage=2", "mesh.data=4", "parallel.pipeline.microbatches=4",
     "parallel.pipeline.virtual=2"],
    ["mesh.data=2", "mesh.stage=4", "parallel.pipeline.schedule=2bw", "train.steps=6"],
]
SLOW_LAYOUTS = [
    ["parallel.pipeline.schedule=naive", "mesh.stage=4", "mesh.data=2", "parallel.pipeline.microbatches=1"],
    ["parallel.pipeline.schedule=gpipe", "mesh.stage=4", "mesh.data=2", "parallel.pipeline.microbatches=8",
     "train.remat=full", "parallel.zero=1", "train.loss_chunks=4"],
    ["parallel.pipeline.schedule=interleaved", "mesh.stage=4", "mesh.data=2", "parallel.pipeline.microbatches=8",
     "parallel.pipeline.virtual=2", "model.n_layers=8"],
    ["mesh.data=2", "mesh.tensor=2", "mesh.stage=2", "parallel.zero=2", "train.precision=bf16", "train.loss_chunks=4"],
    ["mesh.data=2", "mesh.tensor=2", "mesh.stage=2", "parallel.pipeline.schedule=interleaved",
     "parallel.pipeline.virtual=2", "parallel.zero=3", "parallel.sequence=true"],
    ["mesh.data=2", "mesh.tensor=2", "mesh.stage=2", "parallel.pipeline.schedule=2bw", "train.steps=6",
     "parallel.zero=3"],
    ["mesh.tensor=2", "mesh.stage=4", "parallel.pipeline.microbatches=8", "parallel.pipeline.recompute=true"],
    ["mesh.tensor=4", "mesh.stage=2", "parallel.pipeline.schedule=interleaved", "parallel.pipeline.virtual=2",
     "model.n_layers=8", "parallel.pipeline.recompute=true", "train.precision=bf16"],
]
LAYOUTS = ([pytest.param(layout, id=" ".join(layout)) for layout in QUICK_LAYOUTS]
           + [pytest.param(layout, id=" ".join(layout), marks=pytest.mark.slow) for layout in SLOW_LAYOUTS])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipelined_layout_matches_single_device(layout, session_for):
    result = verify(session_for("train.steps=3", *SMALL_MODEL, *layout), log=lambda line: None)
    assert result["ok"], result
    # the layout really runs what it names (the reference never runs sequence parallelism)
    assert ("sequence" in result["layout"]) == ("parallel.sequence=true" in layout), result["layout"]


def test_gpipe_sends_activations_forward_and_their_cotangents_back():
    """GPipe's step, compiled (not run), S=2, M=4: one microbatch's activations go forward between
    stages by collective-permute at each of the M + S - 1 forward ticks, and autodiff's transpose
    sends their cotangents back as often; the last chunk's outputs (all M microbatches) reach every
    stage in one all-reduce over `stage`, for the head spread over the stages."""
    from jaxpar.config.presets import load_config
    from jaxpar.plan import measure_step
    from jaxpar.train.run_session import prepare
    from jaxpar.train.trainer import Trainer

    session = prepare(load_config(None, [*SMALL_MODEL, "mesh.data=4", "mesh.stage=2", "train.batch_size=32",
                                         "parallel.pipeline.schedule=gpipe", "parallel.pipeline.microbatches=4"]))
    ops = measure_step(Trainer(session))["collective_ops"]
    microbatch_bytes = 32 // 4 // 4 * 32 * 64 * 4  # rows per device and microbatch x seq x d_model x fp32
    permutes = [op for op in ops if op["op"] == "collective-permute"]
    assert [(op["mesh_axes"], op["count"], op["bytes"]) for op in permutes] == [(["stage"], 4 + 2 - 1,
                                                                                 microbatch_bytes)] * 2
    assert any(op["op"] == "all-reduce" and op["mesh_axes"] == ["stage"] and op["bytes"] == 4 * microbatch_bytes
               for op in ops)


@pytest.mark.slow
def test_2bw_really_uses_one_step_stale_weights(session_for, monkeypatch):
    """Against a reference without the stale rule, 2BW must differ: the rule is in effect."""
    original = verify_module.reference_config
    monkeypatch.setattr(verify_module, "reference_config",
                        lambda cfg: original(cfg).replace(**{"parallel.pipeline.schedule": "1f1b"}))
    result = verify(session_for("train.steps=3", *SMALL_MODEL, "mesh.data=2", "mesh.stage=4",
                                "parallel.pipeline.schedule=2bw"), log=lambda line: None)
    assert not result["ok"] and result["loss_max_rel_err"] > 1e-4


@pytest.mark.slow
def test_pipeline_idle_fraction_is_in_the_metrics(session_for):
    from jaxpar.train.loop import train

    # the recompute layout verified above, trained
    session = session_for(*SMALL_MODEL, "mesh.tensor=2", "mesh.stage=4", "parallel.pipeline.microbatches=8",
                          "parallel.pipeline.recompute=true", "train.steps=2", "train.log_every=1",
                          "train.eval_batches=1", "train.sample_tokens=8")
    train(session, progress=False)
    lines = (session.cfg.run.dir + "/metrics.jsonl")
    records = [json.loads(line) for line in open(lines).read().splitlines()]
    assert records[-1]["pipeline_idle_fraction"] == pytest.approx(3 / 11)


@pytest.mark.slow
def test_plan_of_naive_shows_gpipe_beside_it(capsys):
    """`jaxpar plan` of a naive layout compiles GPipe with M = mesh.stage on its mesh too: naive keeps the
    whole batch's residuals, and its logits, at once, and holds more than GPipe at M = S."""
    from jaxpar.cli import main

    assert main(["plan", *SMALL_MODEL, "mesh.data=2", "mesh.stage=4", "parallel.pipeline.schedule=naive",
                 "parallel.pipeline.microbatches=1"]) == 0
    out = capsys.readouterr().out
    plan = json.loads(out.strip().splitlines()[-1])
    beside = plan["gpipe_beside"]
    assert beside["microbatches"] == 4 and 0 < beside["temp_bytes"] < plan["temp_bytes"]
    assert any(line.startswith("  gpipe M=4: temporaries") and f"{beside['temp_bytes']:,d}" in line
               for line in out.splitlines())


@pytest.mark.slow
def test_1f1b_bounds_activation_memory_by_stages_not_microbatches():
    """At S=4, M=16, with activations dominating, 1F1B needs at most half of GPipe's temporaries."""
    import os

    from jaxpar.config.presets import load_config
    from jaxpar.plan import measure_step
    from jaxpar.train.run_session import prepare
    from jaxpar.train.trainer import Trainer

    base = ["mesh.data=2", "mesh.stage=4", "model.n_layers=8", "model.seq_len=256", "train.batch_size=64",
            "parallel.pipeline.microbatches=16", f"run.dir={os.devnull}"]
    temps = {}
    for schedule in ("gpipe", "1f1b"):
        session = prepare(load_config(None, base + [f"parallel.pipeline.schedule={schedule}"]))
        plan = measure_step(Trainer(session))
        temps[schedule] = plan["temp_bytes"]
        assert plan["collectives"]["collective-permute"] > 0
    assert temps["1f1b"] <= 0.5 * temps["gpipe"]


@pytest.mark.slow
def test_1f1b_executes_the_matmuls_of_data_parallelism_and_recompute_adds_a_forward():
    """S=4, M=16, remat none, 8 layers, batch 64: 1F1B keeps each forward's residuals, so the
    matmul FLOPs its devices execute (each tick branch costed from its compiled computation and
    counted as often as the table takes it) are those of data=8 on the same model and batch.
    With recompute=true every backward redoes its forward: F + (F + 2F) = 4/3 of 3F."""
    import os

    from jaxpar.config.presets import load_config
    from jaxpar.plan import measure_step
    from jaxpar.train.run_session import prepare
    from jaxpar.train.trainer import Trainer

    # the 1F1B layout of the test above (compiled once per run)
    base = ["model.n_layers=8", "model.seq_len=256", "train.batch_size=64", "train.remat=none", f"run.dir={os.devnull}"]
    pipeline = ["mesh.data=2", "mesh.stage=4", "parallel.pipeline.microbatches=16"]

    def plan(*overrides):
        session = prepare(load_config(None, base + list(overrides)))
        return measure_step(Trainer(session))

    flat = plan("mesh.data=8")
    assert flat["executed_flops"] == flat["flops"] and flat["executed_flops_per_stage"] == [flat["flops"]]
    kept = plan(*pipeline)
    assert kept["executed_flops"] <= 1.05 * flat["executed_flops"], (kept["executed_flops"], flat["flops"])
    assert kept["executed_flops"] < kept["flops"]  # the upper bound counts every branch every tick
    # the head runs on the last stage only
    per_stage = kept["executed_flops_per_stage"]
    assert per_stage[0] == per_stage[1] == per_stage[2] < per_stage[3]
    redone = plan(*pipeline, "parallel.pipeline.recompute=true")
    assert redone["executed_flops"] / kept["executed_flops"] == pytest.approx(4 / 3, rel=0.02)
