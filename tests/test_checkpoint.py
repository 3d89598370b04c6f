"""Checkpoints: exact resume, restore onto another layout (mesh, ZeRO stage, pipeline schedule),
checkpoints that do not fit the config, a non-finite loss, and synchronous saves. SIGKILL and
SIGTERM, damaged checkpoints and errors that are not damage: test_checkpoint_resilience.py.

Every run is the tiny preset with one metrics line per step. The learning-rate schedule
spans 40 steps whatever train.steps is, so a run of any length follows the same trajectory
as the uninterrupted 40-step reference run, and its metrics must equal the reference's. The
runs, the reference and the helpers are in conftest.py, shared with test_checkpoint_resilience.py.
"""

import numpy as np
import pytest
from helpers import BASE, checkpoint_steps, copy_of, metrics, partial_saves, steps_saved, train_here

from jaxpar.train.checkpoint import Checkpoints

# The session's checkpoint runs (conftest.py) are made once, on one pytest-xdist worker
pytestmark = pytest.mark.xdist_group("checkpoint_runs")


@pytest.mark.slow
def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path, capsys, reference):
    run_dir = tmp_path / "run"
    code, _ = train_here(capsys, run_dir, "train.steps=12", "checkpoint.every=3")
    assert code == 0 and checkpoint_steps(run_dir) == [6, 9, 12]  # checkpoint.keep=3
    code, err = train_here(capsys, run_dir, "train.steps=20", "checkpoint.every=3")
    assert code == 0
    assert f"jaxpar: resuming from the checkpoint at step 12 in {run_dir / 'checkpoints'}" in err
    resumed = metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(1, 21))
    assert resumed[12:] == reference[12:20]  # steps 13-20, bit for bit
    assert resumed == reference[:20]


@pytest.mark.slow
def test_a_completed_run_keeps_its_final_state_unless_told_not_to(tmp_path, capsys):
    """checkpoint.every=0 (the default) still leaves the last step for export-hf, generate and a resume."""
    from jaxpar.sampling.command import generate

    code, _ = train_here(capsys, tmp_path / "kept", "train.steps=2")
    assert code == 0 and checkpoint_steps(tmp_path / "kept") == [2]
    assert generate(str(tmp_path / "kept"), "the", 2)["step"] == 2
    code, err = train_here(capsys, tmp_path / "kept", "train.steps=2")  # the finished run again: nothing to do
    assert code == 0 and "resuming from the checkpoint at step 2" in err and checkpoint_steps(tmp_path / "kept") == [2]
    code, _ = train_here(capsys, tmp_path / "left", "train.steps=2", "checkpoint.final=false")
    assert code == 0 and not (tmp_path / "left" / "checkpoints").exists()


@pytest.mark.parametrize("overrides, saved", [({}, [6]), ({"checkpoint.every": 4}, [4, 6]),
                                               ({"checkpoint.every": 3}, [3, 6]), ({"checkpoint.final": False}, [])])
def test_the_final_save_is_made_once(overrides, saved):
    """A periodic save at the last step is the final one too: the step is not saved twice."""
    from jaxpar.config import Config

    # (2BW's last periodic save waits for the drain: test_two_bw.py)
    assert steps_saved(Config().replace(**overrides), 6) == saved


@pytest.mark.slow
def test_restore_onto_another_mesh_and_zero_stage(tmp_path, capsys):
    from jaxpar.config.presets import load_config
    from jaxpar.interop.checkpoint_files import flat_by_path
    from jaxpar.train.checkpoint import Checkpoints
    from jaxpar.train.run_session import prepare
    from jaxpar.train.trainer import Trainer

    original = ["mesh.data=8", "mesh.tensor=1"]
    resharded = ["mesh.data=2", "mesh.tensor=4", "parallel.zero=3"]
    saved = tmp_path / "saved"
    assert train_here(capsys, saved, "train.steps=3", "checkpoint.every=3", *original)[0] == 0

    # The restored arrays land directly in the new layout's shardings, with the saved values.
    def restore(layout):
        session = prepare(load_config(BASE[0], [*BASE[1:], f"run.dir={saved}", *layout]))
        trainer = Trainer(session)
        checkpoints = Checkpoints(saved / "checkpoints", keep=3)
        restored = checkpoints.restore_latest(trainer, warn=pytest.fail)
        checkpoints.close()
        return restored, flat_by_path(trainer.state_shardings)

    before, _ = restore(original)
    after, shardings = restore(resharded)
    assert after.step == before.step == 3
    before_arrays, after_arrays = flat_by_path(before.state), flat_by_path(after.state)
    assert after_arrays.keys() == shardings.keys()
    for key, array in after_arrays.items():
        assert array.sharding == shardings[key], key
        np.testing.assert_array_equal(np.asarray(array), np.asarray(before_arrays[key]), err_msg=key)
    assert not shardings["params/blocks/mlp/w_up/value"].is_fully_replicated

    # Training continues with the same loss as on the original layout.
    other = copy_of(saved, tmp_path / "other")
    assert train_here(capsys, saved, "train.steps=5", "checkpoint.every=3", *original)[0] == 0
    code, err = train_here(capsys, other, "train.steps=5", "checkpoint.every=3", *resharded)
    assert code == 0 and "resuming from the checkpoint at step 3" in err
    on_original, on_resharded = metrics(saved)[3:], metrics(other)[3:]
    assert [r["step"] for r in on_resharded] == [4, 5]
    for a, b in zip(on_original, on_resharded):
        assert abs(b["loss"] - a["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)


PIPELINES = {
    "plain": ["mesh.data=8", "mesh.tensor=1"],
    "interleaved": ["mesh.data=4", "mesh.tensor=1", "mesh.stage=2", "parallel.pipeline.schedule=interleaved",
                    "parallel.pipeline.virtual=2", "parallel.pipeline.microbatches=2"],
    "2bw": ["mesh.data=4", "mesh.tensor=1", "mesh.stage=2", "parallel.pipeline.schedule=2bw",
            "parallel.pipeline.microbatches=2"],
}


@pytest.mark.slow
def test_restore_across_pipeline_layouts(tmp_path):
    """Interleaved stages store their layers permuted and 2BW keeps a second copy of the weights;
    checkpoints hold layers in model order, so they move between these and plain layouts."""
    import jax

    from jaxpar.config.presets import load_config
    from jaxpar.interop.checkpoint_files import flat_by_path
    from jaxpar.train.checkpoint import CheckpointMismatch, Checkpoints
    from jaxpar.train.run_session import prepare
    from jaxpar.train.trainer import Trainer

    def trainer(name):
        cfg = load_config(BASE[0], [*BASE[1:], "model.n_layers=4", f"run.dir={tmp_path}", *PIPELINES[name]])
        session = prepare(cfg)
        return Trainer(session)

    def round_trip(source, state, target, folder):
        checkpoints = Checkpoints(tmp_path / folder, keep=1)
        checkpoints.save(1, state, source)
        restored = checkpoints.restore_latest(target, warn=pytest.fail)
        checkpoints.close()
        return restored.state, {k: np.asarray(v) for k, v in flat_by_path(restored.state).items()}

    def same(a, b):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)

    plain, interleaved, two_bw = trainer("plain"), trainer("interleaved"), trainer("2bw")
    plain_state, interleaved_state = plain.init(), interleaved.init()
    in_model_order = {k: np.asarray(v) for k, v in flat_by_path(plain_state).items()}
    permuted = {k: np.asarray(v) for k, v in flat_by_path(interleaved_state).items()}
    key = "params/blocks/mlp/w_up/value"
    assert not np.array_equal(permuted[key], in_model_order[key])  # the layers really are stored permuted

    same(round_trip(interleaved, interleaved_state, plain, "a")[1], in_model_order)
    same(round_trip(interleaved, interleaved_state, interleaved, "b")[1], permuted)
    two_bw_state, from_plain = round_trip(plain, plain_state, two_bw, "c")  # 2BW's stale weights start as the weights
    same({k: v for k, v in from_plain.items() if not k.startswith(("stale_params/", "in_flight/"))}, in_model_order)
    same({k[len("stale_"):]: v for k, v in from_plain.items() if k.startswith("stale_params/")},
         {k: v for k, v in in_model_order.items() if k.startswith("params/")})
    assert not any(np.any(v) for k, v in from_plain.items() if k.startswith("in_flight/"))  # nothing in flight
    same(round_trip(two_bw, two_bw_state, plain, "d")[1], in_model_order)  # and are dropped again

    # A step in flight only the layout that saved it can finish: elsewhere it is one sentence.
    batch = two_bw.put_windows(two_bw.session.train_data, two_bw.session.train_data.starts(0))
    flying, _ = two_bw.step(two_bw.put_state(jax.device_get(two_bw_state)), batch)
    checkpoints = Checkpoints(tmp_path / "e", keep=1)
    checkpoints.save(1, flying, two_bw)
    with pytest.raises(CheckpointMismatch, match="holds a 2bw step in flight, which only the layout that saved it"):
        checkpoints.restore_latest(plain, warn=pytest.fail)
    checkpoints.close()


def test_checkpoint_of_another_model_shape_is_refused_with_exit_2(tmp_path, capsys, ten_steps):
    run_dir = copy_of(ten_steps, tmp_path)
    before = (run_dir / "metrics.jsonl").read_bytes()
    code, err = train_here(capsys, run_dir, "train.steps=20", "model.d_model=128", "model.d_ff=512")
    assert code == 2
    assert err.strip().splitlines() == [
        f"jaxpar: error: the checkpoint at step 10 in {run_dir / 'checkpoints'} was written with model.d_model=64, "
        "model.d_ff=256 but this config has model.d_model=128, model.d_ff=512; resume with the same values or use "
        "another run.dir."]
    assert (run_dir / "metrics.jsonl").read_bytes() == before and checkpoint_steps(run_dir) == [5, 10]


@pytest.mark.slow
def test_nonfinite_loss_stops_with_exit_1_naming_the_last_good_checkpoint(tmp_path, capsys):
    run_dir = tmp_path / "run"
    # A huge learning rate overflows the parameters after the first update.
    code, err = train_here(capsys, run_dir, "train.steps=10", "train.lr=1e30", "train.warmup=0", "checkpoint.every=1")
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert last == (f"jaxpar: training stopped at step 2 because the gradient norm is nan; the last good checkpoint "
                    f"is step 1 in {run_dir / 'checkpoints'} (train.on_nonfinite=skip would skip such steps instead).")
    assert checkpoint_steps(run_dir) == [1]


@pytest.mark.slow
def test_synchronous_checkpoints_save_and_resume(tmp_path, capsys, ten_steps, trainer, reference):
    run_dir = copy_of(ten_steps, tmp_path)
    code, err = train_here(capsys, run_dir, "train.steps=12", "checkpoint.every=5", "checkpoint.async=false")
    assert code == 0 and f"resuming from the checkpoint at step 10 in {run_dir / 'checkpoints'}" in err
    assert checkpoint_steps(run_dir) == [5, 10, 12] and partial_saves(run_dir) == []
    assert metrics(run_dir) == reference[:12]
    # The step saved without a background thread reads back.
    checkpoints = Checkpoints(run_dir / "checkpoints", keep=3, async_save=False)
    assert checkpoints.restore_latest(trainer, warn=pytest.fail).step == 12
    checkpoints.close()
