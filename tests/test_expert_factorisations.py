"""Every split of the 8 devices over data, context, tensor and expert, with each router: none aborts, and
each verifies or is refused in one sentence.

Issue 70: dropless experts on data=1 x context=2 x tensor=2 x expert=2 aborted the process inside XLA's
SPMD partitioner (a failed check in ExpandDeviceGroups). Not the experts' doing: with mesh.expert > 1
the step's shard_map is manual over the batch axes, and with `tensor` and `context` both automatic
there the partitioner could not split two gathers on the tensor-split vocabulary, the loss's target
logits (jaxpar.model.cross_entropy) and the embedding lookup (jaxpar.parallel.vocab), whatever the
router, and a dense model too. The lookup failed only once the shapes made the partitioner pick its
masked strategy, hence 64 positions here where tests/test_factorisations.py takes 16.

Dropless routing verifies one representative of each set of axes > 1 and compiles the rest; the
capacity routers verify the layout of the issue and compile the rest (each is verified beside the
mesh axes by tests/test_factorisations.py, tests/test_moe.py and tests/test_moe_pipeline.py).
"""

import itertools
import math

import pytest

from jaxpar.config import ConfigError
from jaxpar.config.presets import load_config
from jaxpar.train.run_session import prepare
from jaxpar.train.trainer import Trainer
from jaxpar.verify.run import verify

DEVICES = 8
AXES = ("data", "context", "tensor", "expert")
# One dense layer and one MoE layer; MoE routing groups need the sequence unbalanced under mesh.context.
MODEL = ("model.d_model=32", "model.n_heads=8", "model.d_ff=64", "model.seq_len=64", "train.batch_size=16",
         "model.n_layers=2", "model.moe.experts=8", "model.moe.every=2", "parallel.context_balance=false")
ISSUE = {"data": 1, "context": 2, "tensor": 2, "expert": 2}


def _factorisations() -> list[dict[str, int]]:
    sizes = [d for d in range(1, DEVICES + 1) if DEVICES % d == 0]
    return [dict(zip(AXES, split)) for split in itertools.product(sizes, repeat=len(AXES))
            if math.prod(split) == DEVICES]


def _name(sizes: dict[str, int]) -> str:
    return " x ".join(f"{axis}={size}" for axis, size in sizes.items() if size > 1)


FACTORISATIONS = _factorisations()


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
CASES = [(router, sizes) for router in ("dropless", "topk", "switch", "expert_choice") for sizes in FACTORISATIONS]


def test_there_are_twenty_factorisations_and_fourteen_sets_of_axes():
    assert len(FACTORISATIONS) == 20  # three factors of 2 over four axes: C(6, 3)
    assert len(REPRESENTATIVES) == 14 and ISSUE in REPRESENTATIVES  # 4 axes alone, 6 pairs, 4 triples


def _verified(router: str, sizes: dict[str, int]) -> bool:
    return sizes == ISSUE or (router == "dropless" and sizes in REPRESENTATIVES)


def _check(router: str, sizes: dict[str, int], run_dir, verified: bool) -> None:
    """Refused in one sentence before compiling; else verified over 2 steps, or its train step compiled."""
    overrides = [f"run.dir={run_dir}", *MODEL, f"model.moe.router={router}",
                 *(f"mesh.{axis}={size}" for axis, size in sizes.items()), "train.steps=2"]
    try:
        session = prepare(load_config(None, overrides))
    except ConfigError as refusal:
        message = str(refusal)
        assert "\n" not in message and message.endswith("."), message
        return
    if verified:
        result = verify(session, log=lambda line: None)
        assert result["ok"], result
    else:
        Trainer(session).compile_step()


def test_dropless_on_the_issues_layout_compiles(tmp_path):
    """The quick tier's guard: the step of issue 70's layout compiles (it aborted the process)."""
    _check("dropless", ISSUE, tmp_path, verified=False)


@pytest.mark.slow
@pytest.mark.parametrize("router, sizes", CASES, ids=[f"{r} {_name(s)}" for r, s in CASES])
def test_layout_is_refused_in_one_sentence_or_compiles_and_chosen_ones_verify(router, sizes, tmp_path):
    _check(router, sizes, tmp_path, _verified(router, sizes))
