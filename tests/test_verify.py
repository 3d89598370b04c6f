"""Every layout trains to the same numbers as the single-device reference."""

import pytest
from helpers import SMALL_MODEL

from jaxpar.config.precision import POLICIES
from jaxpar.verify.run import DEFAULT_STEPS, verify

# Each mesh split alone is verified by tests/test_factorisations.py (or by the module it names);
# here the switches on top of one. Switches that do not interact share a run: each one's code is
# checked once, and their composition with it.
LAYOUTS = {
    "data=4 x tensor=2, zero 3": ["mesh.data=4", "mesh.tensor=2", "parallel.zero=3"],
    "data=8, zero 1, grad_accum=4": ["mesh.data=8", "parallel.zero=1", "train.grad_accum=4"],
    "data=8, zero 2, remat full": ["mesh.data=8", "parallel.zero=2", "train.remat=full"],
    "data=8, adafactor, zero 3, remat dots": ["mesh.data=8", "train.optimizer=adafactor", "parallel.zero=3",
                                              "train.remat=dots"],
    "data=2 x tensor=2 x expert=2, zero 2, grad_accum=2, learned positions, untied head": [
        "mesh.data=2", "mesh.tensor=2", "mesh.expert=2", "parallel.zero=2", "train.grad_accum=2",
        "model.positions=learned", "model.tie_embeddings=false"],
    "data=4 x tensor=2, remat sqrt, 9 layers": ["mesh.data=4", "mesh.tensor=2", "train.remat=sqrt", "model.n_layers=9"],
}
QUICK = ("data=4 x tensor=2, zero 3",)  # the quick tier's verify: tensor parallelism and ZeRO-3 at once


# verified through the command line by test_verify_cli_prints_json_last_line, at its default steps
BY_THE_CLI = "data=8, zero 1, grad_accum=4"


@pytest.mark.parametrize("layout", [pytest.param(name, marks=() if name in QUICK else pytest.mark.slow)
                                    for name in LAYOUTS if name != BY_THE_CLI])
def test_layout_matches_single_device(layout, session_for):
    result = verify(session_for("train.steps=3", *SMALL_MODEL, *LAYOUTS[layout]), log=lambda line: None)
    assert result["ok"], result
    assert result["loss_max_rel_err"] <= 1e-5 and result["param_max_rel_err"] <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_stays_within_its_tolerance_of_fp32(session_for, precision):
    result = verify(session_for("train.steps=5", *SMALL_MODEL, "mesh.data=4", "mesh.tensor=2",
                                f"train.precision={precision}"), log=lambda line: None)
    assert result["ok"], result
    assert result["loss_max_rel_err"] <= POLICIES[precision].tolerances[0]
    assert result["grad_max_rel_err"] <= POLICIES[precision].grad_tolerance
    assert result["update_max_rel_err"] <= POLICIES[precision].update_tolerance
    # half precision really is in use: fp32 layouts' updates agree to 3.1e-5 (jaxpar.config.precision); fp16's
    # differ by 5.0e-3, bf16's by 2.3e-2
    assert result["update_max_rel_err"] > 1e-3


@pytest.mark.slow
def test_verify_detects_a_different_trajectory(tmp_path):
    """The comparison can fail: a reference with another learning rate must be reported. In a process of its own:
    XLA:CPU (jax 0.12.0.1) deadlocked this step when its init program came from the persistent compilation cache
    (verify compiles all of its programs afresh now: jaxpar.verify.run._compiled_afresh), and an abort would take
    the test process with it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from helpers import SMALL_MODEL
from jaxpar.config.presets import load_config
from jaxpar.train.run_session import prepare
from jaxpar.verify import run as verify_module
original = verify_module.reference_config
verify_module.reference_config = lambda cfg: original(cfg).replace(**{{"train.lr": 1e-3}})
session = prepare(load_config(None, [f"run.dir={tmp_path}", "train.steps=3", *SMALL_MODEL,
                                     *{LAYOUTS["data=8, zero 2, remat full"]!r}]))
print(json.dumps(verify_module.verify(session, log=lambda line: None)))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["ok"]
    assert result["update_max_rel_err"] > POLICIES["fp32"].update_tolerance


@pytest.mark.slow
def test_verify_cli_prints_json_last_line(tmp_path, capsys):
    import json

    from jaxpar.cli import main

    code = main(["verify", *SMALL_MODEL, *LAYOUTS[BY_THE_CLI], f"run.dir={tmp_path}"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last)
    assert code == 0 and result["ok"] is True and result["steps"] == DEFAULT_STEPS
    assert set(result) == {"ok", "layout", "steps", "loss_max_rel_err", "grad_norm_max_rel_err", "grad_max_rel_err",
                           "later_grad_max_rel_err", "update_max_rel_err", "param_max_rel_err", "failures"}
    assert result["failures"] == []
    assert result["loss_max_rel_err"] <= 1e-5 and result["param_max_rel_err"] <= 1e-4


def test_verify_makes_at_least_four_updates_the_first_one_learning():
    from jaxpar.config import TrainConfig
    from jaxpar.train.optim import lr_schedule

    assert DEFAULT_STEPS >= 5  # four updates each followed by a compared loss, and one the weights show
    assert float(lr_schedule(TrainConfig(lr=1e-3, warmup=20, steps=40))(0)) == pytest.approx(1e-3 / 20)
    assert float(lr_schedule(TrainConfig(lr=1e-3, warmup=20, steps=5))(0)) == pytest.approx(1e-3 / 5)  # warmup <= steps


@pytest.mark.slow
def test_two_layouts_of_one_model_verify_against_one_reference(session_for, monkeypatch, tmp_path):
    """The single-device reference is built once for the two layouts of one model (run.* aside), and kept."""
    from collections import OrderedDict

    import jaxpar.verify.run as verify_module

    built, build = [], verify_module.Trainer
    monkeypatch.setattr(verify_module, "Trainer", lambda session, *a, **k: built.append(session.mesh.size) or
                        build(session, *a, **k))
    monkeypatch.setattr(verify_module, "_SINGLE_DEVICE", OrderedDict())
    for layout in (["mesh.data=8"], ["mesh.data=4", "mesh.tensor=2", f"run.dir={tmp_path / 'other'}"]):
        result = verify(session_for("train.steps=2", *SMALL_MODEL, *layout), log=lambda line: None)
        assert result["ok"], result
    assert built == [8, 1, 8], built


def test_verify_compiles_afresh_even_after_the_process_compiled_with_the_cache(tmp_path):
    """jax settles at a process's first compile whether it uses the persistent cache: verify's programs stay out of
    it all the same (XLA:CPU aborted and deadlocked on such programs read back), and the process's others go on
    using it after."""
    import jax
    from jax.experimental.compilation_cache.compilation_cache import reset_cache

    from jaxpar.verify.run import _compiled_afresh

    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    reset_cache()
    try:
        jax.jit(lambda x: x + 1.5)(1.0)  # the process's first compile with this cache: it is used
        assert len(list(tmp_path.iterdir())) == 1
        with _compiled_afresh():
            jax.jit(lambda x: x * 2.5)(1.0)
        assert len(list(tmp_path.iterdir())) == 1
        jax.jit(lambda x: x * 3.5)(1.0)
        assert len(list(tmp_path.iterdir())) == 2
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        reset_cache()
