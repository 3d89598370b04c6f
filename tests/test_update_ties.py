"""verify's Adam near-ties (jaxpar.train.update_ties): an element whose gradient is rounding is left out of
its tensor's error and judged by the reach of the reference's updates; every other element still counts."""

import jax.numpy as jnp
import numpy as np
import optax

from jaxpar.train.update_ties import TIE_TOLERANCE, UpdateTies

LR = 1e-3


def _one_adam_step(gradient: np.ndarray):
    """The reference's weights before and after one AdamW step on `gradient`, and its optimizer state."""
    params = {"w": jnp.asarray(np.random.default_rng(1).normal(0, 0.02, gradient.shape), jnp.float32)}
    optimizer = optax.adamw(LR, b1=0.9, b2=0.95, eps=1e-8)
    updates, state = optimizer.update({"w": jnp.asarray(gradient)}, optimizer.init(params), params)
    return np.asarray(params["w"]), np.asarray(optax.apply_updates(params, updates)["w"]), state


def _gradient() -> np.ndarray:
    """1000 gradients of about 1e-3, element 0 a rounding's 1e-9 and element 1 exactly zero (no update)."""
    gradient = np.random.default_rng(0).normal(0, 1e-3, 1000).astype(np.float32)
    gradient[:2] = 1e-9, 0.0
    return gradient


def test_an_element_whose_gradient_is_rounding_is_a_tie_and_the_others_are_judged():
    before, after, state = _one_adam_step(_gradient())
    ties = UpdateTies({"w": before})
    ties.add(state)
    tied = ties.ties["w"]
    assert tied[0] and not tied[1] and ties.count() == np.count_nonzero(tied) <= 3
    assert np.all(np.abs(_gradient()[tied]) < TIE_TOLERANCE * np.sqrt(np.mean(_gradient() ** 2)))

    layout = after.copy()
    layout[0] -= 2 * (after[0] - before[0])  # the tie moved the other way, as another summation order can
    judged, ref_judged, within = ties.split("w", layout, after)
    assert within and np.array_equal(judged, ref_judged) and judged.size == 1000 - ties.count()

    layout[5] += 1e-3  # an element that is not a tie still counts
    judged, ref_judged, within = ties.split("w", layout, after)
    assert within and not np.array_equal(judged, ref_judged)


def test_a_tie_that_went_further_than_any_update_fails():
    before, after, state = _one_adam_step(_gradient())
    ties = UpdateTies({"w": before})
    ties.add(state)
    layout = after.copy()
    layout[0] += 3 * np.max(np.abs(after - before))
    assert not ties.split("w", layout, after)[2]


def test_no_adam_no_ties():
    """Adafactor keeps factored statistics: nothing is judged as a tie."""
    params = {"w": jnp.zeros((64, 64))}
    optimizer = optax.adafactor(LR, min_dim_size_to_factor=32)
    _, state = optimizer.update({"w": jnp.ones((64, 64))}, optimizer.init(params), params)
    ties = UpdateTies({"w": np.zeros((64, 64))})
    ties.add(state)
    assert ties.count() == 0 and ties.split("w", np.ones(3), np.ones(3))[2]
