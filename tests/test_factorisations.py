"""Every layout that validates must compile; every other one is refused in one sentence.

Tensor parallelism alone once aborted inside XLA's SPMD partitioner while data x tensor and
tensor x stage worked: a bug of one factorisation that the typical layouts never hit. So this
takes every split of the 8 devices over (data, tensor, expert, stage, context), a mixture-of-experts
model whenever expert > 1, and checks that each either compiles its train step (the `plan`
path, nothing is run) or is refused by validation before anything is compiled. Then one
representative of each combination of axes > 1 is trained with `verify`; the rest compile only.
A factorisation that another module already verifies (with switches on top) is neither compiled
nor verified again here: `test_every_factorisation_is_verified_here_or_elsewhere` keeps the
two lists together.
"""

import itertools
import math

import pytest

from jaxpar.config import MESH_AXES, ConfigError
from jaxpar.config.mesh import resolve_mesh
from jaxpar.config.presets import load_config
from jaxpar.train.run_session import prepare
from jaxpar.train.trainer import Trainer
from jaxpar.verify.run import verify

DEVICES = 8
# Heads, FFN and vocabulary divide by 8; 16 sequences divide by data x expert x microbatches
# (microbatches = stages). The layers are as few as the stages allow (one per stage, two under MoE
# where every other layer is a mixture): a pipeline compiles each stage's layers, so fewer is quicker.
MODEL = ("model.d_model=32", "model.n_heads=8", "model.d_ff=64", "model.seq_len=16", "train.batch_size=16")


def _factorisations() -> list[dict[str, int]]:
    splits = []
    for sizes in itertools.product(*[[d for d in range(1, DEVICES + 1) if DEVICES % d == 0]] * len(MESH_AXES)):
        if math.prod(sizes) == DEVICES:
            splits.append(dict(zip(MESH_AXES, sizes)))
    return splits


def _overrides(sizes: dict[str, int], run_dir) -> list[str]:
    layers = max(2, sizes["stage"]) * (2 if sizes["expert"] > 1 else 1)
    out = [f"run.dir={run_dir}", *MODEL, f"model.n_layers={layers}",
           *(f"mesh.{axis}={size}" for axis, size in sizes.items()),
           f"parallel.pipeline.microbatches={max(2, sizes['stage'])}"]
    if sizes["expert"] > 1:
        out += ["model.moe.experts=8", "model.moe.every=2"]
    return out


def _name(sizes: dict[str, int]) -> str:
    return " x ".join(f"{axis}={size}" for axis, size in sizes.items() if size > 1)


FACTORISATIONS = _factorisations()


def test_there_are_thirty_five_factorisations():
    assert len(FACTORISATIONS) == 35  # three factors of 2 over five axes: C(7, 3)


def _representatives() -> list[dict[str, int]]:
    """The first factorisation of each set of axes > 1 (an axis of size 2 where one can be)."""
    seen, chosen = set(), []
    for sizes in sorted(FACTORISATIONS, key=lambda s: max(s.values())):
        axes = frozenset(a for a, size in sizes.items() if size > 1)
        if axes not in seen:
            seen.add(axes)
            chosen.append(sizes)
    return chosen


REPRESENTATIVES = _representatives()


def _verified_elsewhere() -> set[str]:
    """Names of the factorisations that other modules verify (with other switches on top): each of
    their layouts' mesh, as the config resolves it on 8 devices."""
    import test_context
    import test_long_context
    import test_moe
    import test_moe_pipeline
    import test_pipeline
    import test_verify

    layouts = [*test_verify.LAYOUTS.values(), *test_pipeline.QUICK_LAYOUTS, *test_pipeline.SLOW_LAYOUTS,
               *(layout for _, layout in test_moe.LAYOUTS), *test_moe_pipeline.MESHES.values(),
               *test_long_context.LAYOUTS.values(), *test_context.LAYOUTS.values()]
    return {_name(resolve_mesh(load_config(None, list(overrides)).mesh, DEVICES)) for overrides in layouts
            if "run.devices=" not in " ".join(overrides)}  # those on fewer devices are other factorisations


# Compiled and verified by the modules _verified_elsewhere() reads; checked by the test below.
ELSEWHERE = ("data=8", "data=4 x tensor=2", "data=2 x tensor=4", "data=2 x expert=4", "data=4 x stage=2",
             "data=2 x stage=4", "tensor=2 x stage=4", "tensor=4 x stage=2", "data=2 x tensor=2 x expert=2",
             "data=2 x tensor=2 x stage=2", "data=2 x expert=2 x stage=2", "tensor=2 x expert=2 x stage=2",
             "expert=2 x stage=4", "context=8", "data=2 x context=4", "data=4 x context=2", "tensor=2 x context=4",
             "data=2 x tensor=2 x context=2")
HERE = [sizes for sizes in FACTORISATIONS if _name(sizes) not in ELSEWHERE]


def test_every_factorisation_is_verified_here_or_elsewhere():
    """Each factorisation skipped here is verified by another module, so every set of axes is verified
    somewhere: by its representative here, or there."""
    missing = set(ELSEWHERE) - _verified_elsewhere()
    assert not missing, missing


@pytest.mark.slow
@pytest.mark.parametrize("sizes", HERE, ids=_name)
def test_layout_is_refused_in_one_sentence_or_compiles_and_representatives_verify(sizes, tmp_path):
    """A representative trains 2 steps beside the single-device reference (which compiles it
    too); the other factorisations of the same axes are compiled only."""
    representative = sizes in REPRESENTATIVES
    steps = ["train.steps=2"] if representative else []
    try:
        session = prepare(load_config(None, [*_overrides(sizes, tmp_path), *steps]))
    except ConfigError as refusal:  # refused before anything is compiled
        message = str(refusal)
        assert "\n" not in message and message.endswith("."), message
        return
    if representative:
        result = verify(session, log=lambda line: None)
        assert result["ok"], result
    else:
        Trainer(session).compile_step()


def test_every_combination_of_axes_has_a_representative():
    combinations = {frozenset(a for a, size in s.items() if size > 1) for s in FACTORISATIONS}
    assert len(REPRESENTATIVES) == len(combinations) == 25  # 5 axes alone, 10 pairs, 10 triples
