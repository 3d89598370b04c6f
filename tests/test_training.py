"""Training is deterministic (tests/test_token_data.py runs the default model end to end)."""

import pytest
from helpers import SMALL_MODEL
from test_verify import LAYOUTS

# A layout tests/test_verify.py verifies in the same shape.
VERIFIED = LAYOUTS["data=8, zero 2, remat full"]


@pytest.mark.slow
def test_same_seed_same_run(session_for):
    """Two runs of the same config produce identical losses (deterministic data and init)."""
    import jax

    from jaxpar.train.trainer import Trainer

    runs = []
    for _ in range(2):
        session = session_for("train.steps=3", *SMALL_MODEL, *VERIFIED)
        trainer = Trainer(session)
        state, losses = trainer.init(), []
        for index in range(3):
            state, metrics = trainer.step(state, trainer.put_batch(session.train_data.batch(index)))
            losses.append(metrics["loss"])
        runs.append(jax.device_get(losses))
    assert runs[0] == runs[1]
