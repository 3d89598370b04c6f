"""verify's Adam near-ties (jaxpar.verify.ties): an element whose gradient is rounding is left out of
its tensor's update error and judged apart: by the reach of the reference's updates, by the ties' share of the
elements, and by the share that moved the other way; every other element still counts."""

import jax.numpy as jnp
import numpy as np
import optax

from jaxpar.verify.ties import FEWEST_JUDGED, MAX_REVERSED_SHARE, TIE_TOLERANCE, UpdateTies

LR = 1e-3


def _one_adam_step(gradient: np.ndarray):
    """The reference's weights before and after one AdamW step on `gradient`, and its optimizer state."""
    params = {"w": jnp.asarray(np.random.default_rng(1).normal(0, 0.02, gradient.shape), jnp.float32)}
    optimizer = optax.adamw(LR, b1=0.9, b2=0.95, eps=1e-8)
    updates, state = optimizer.update({"w": jnp.asarray(gradient)}, optimizer.init(params), params)
    return np.asarray(params["w"]), np.asarray(optax.apply_updates(params, updates)["w"]), state


def _gradient(ties: int = 1) -> np.ndarray:
    """10000 gradients of about 1e-3, the first `ties` a rounding's 1e-9 and the next exactly zero (no update)."""
    gradient = np.random.default_rng(0).normal(0, 1e-3, 10000).astype(np.float32)
    gradient[:ties], gradient[ties] = 1e-9, 0.0
    return gradient


def _judged(before, after, layout, state):
    ties = UpdateTies({"w": before}, "fp32", judge_direction=True)  # an fp32 layout's
    ties.add(state)
    kept = ties.without_ties({"w": layout}, {"w": after}, {"w": before})
    return ties, kept, {check: max(values.values()) <= bound for check, (values, bound) in ties.judged().items()}


def test_an_element_whose_gradient_is_rounding_is_a_tie_and_the_others_are_judged():
    gradient = _gradient()
    before, after, state = _one_adam_step(gradient)
    layout = after.copy()
    layout[0] -= 2 * (after[0] - before[0])  # the tie moved the other way, as another summation order can
    ties, (params, ref_params, initial), within = _judged(before, after, layout, state)
    tied = ties.ties["w"]
    assert tied[0] and not tied[1] and ties.count() == np.count_nonzero(tied) <= 3
    assert np.all(np.abs(gradient[tied]) < TIE_TOLERANCE * np.sqrt(np.mean(gradient ** 2)))
    assert all(within.values()) and np.array_equal(params["w"], ref_params["w"])
    assert params["w"].size == initial["w"].size == 10000 - ties.count()

    layout[5] += 1e-3  # an element that is not a tie still counts
    _, (params, ref_params, _), within = _judged(before, after, layout, state)
    assert all(within.values()) and not np.array_equal(params["w"], ref_params["w"])


def test_a_tie_that_went_further_than_any_update_fails():
    before, after, state = _one_adam_step(_gradient())
    layout = after.copy()
    layout[0] += 3 * np.max(np.abs(after - before))
    assert not _judged(before, after, layout, state)[2]["tie_reach"]


def test_ties_moved_the_other_way_fail_as_a_group_but_not_one_by_one():
    """A layout that moves most near-ties against the reference has a bug that only looks like rounding."""
    count = 4 * FEWEST_JUDGED
    before, after, state = _one_adam_step(_gradient(count))
    reverse = lambda n: np.where(np.arange(after.size) < n, 2 * before - after, after)  # noqa: E731
    assert _judged(before, after, reverse(2), state)[2]["tie_reversed_share"]
    assert not _judged(before, after, reverse(int(count * MAX_REVERSED_SHARE) + 1), state)[2]["tie_reversed_share"]


def test_too_many_ties_fail():
    before, after, state = _one_adam_step(_gradient(100))
    assert not _judged(before, after, after, state)[2]["tie_share"]


def test_no_adam_no_ties():
    """Adafactor keeps factored statistics: nothing is judged as a tie."""
    params = {"w": jnp.zeros((64, 64))}
    optimizer = optax.adafactor(LR, min_dim_size_to_factor=32)
    _, state = optimizer.update({"w": jnp.ones((64, 64))}, optimizer.init(params), params)
    ties = UpdateTies({"w": np.zeros((64, 64))}, "fp32", judge_direction=True)
    ties.add(state)
    kept = ties.without_ties({"w": np.ones((64, 64))}, {"w": np.ones((64, 64))}, {"w": np.zeros((64, 64))})
    assert ties.count() == 0 and kept[0]["w"].shape == (64, 64)
