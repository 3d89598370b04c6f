"""verify replays a layout's routing in the reference: near-ties made on purpose are ties and pass,
decisions far from the reference's are flips and fail, on every router; and a router broken on
one device of a layout fails verify with flips beyond the tolerance."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMALL_MODEL

import jaxpar.model.routers as routers
from jaxpar.config.precision import POLICIES
from jaxpar.config.presets import load_config
from jaxpar.session import on_devices
from jaxpar.train.run_session import prepare
from jaxpar.train.trainer import Trainer
from jaxpar.verify.routing import RoutingCheck
from jaxpar.verify.run import compare, reference_config

TIE = POLICIES["fp32"].tie_tolerance
G, N, E, C = 2, 8, 4, 8


TIED_TOKENS = (2, 5)


def _scores_one_ulp_apart(axis: str) -> jnp.ndarray:
    """Router logits (G, N, E) of near-ties: on the experts axis, every token's two leading experts (0
    and 1) one ulp apart, expert 1 above; on the tokens axis, two tokens (TIED_TOKENS) lead expert 0's
    column one ulp apart, the second above (Expert Choice's experts choose tokens)."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(G, N, E)).astype(np.float32) - 4.0
    logits[..., 0] = 2.0 + rng.random((G, N), dtype=np.float32)
    logits[..., 1] = np.nextafter(logits[..., 0], np.float32(np.inf))
    if axis == "tokens":
        a, b = TIED_TOKENS
        logits[:, a, 0] = 6.0
        logits[:, b, 0] = np.nextafter(np.float32(6.0), np.float32(np.inf))
        logits[:, TIED_TOKENS, 1:] = -4.0
    return jnp.asarray(logits)


def _topk(k, **options):
    def route(logits, replay):
        return routers.noisy_topk(logits, None, None, k, C, replay_GNE=replay, **options)
    return route


def _dropless(logits, replay):
    choices = routers.topk_choices(logits, None, None, 2, replay_GNE=replay)
    return routers.ranked_codes(choices.experts_GNK, E), choices.flips


ROUTERS = {  # name: (route(logits, replay) -> Routed or (codes, flips), the axis a near-tie swaps on)
    "switch": (lambda logits, replay: routers.switch(logits, C, replay), "experts"),
    "topk": (_topk(2), "experts"),
    "topk sigmoid bias": (_topk(1, score="sigmoid", bias_E=jnp.zeros(E)), "experts"),
    "dropless": (_dropless, "experts"),
    "expert_choice": (lambda logits, replay: routers.expert_choice(logits, 1, replay), "tokens"),
}


def _decided(result):
    return (result.codes_GNE, result.flips) if isinstance(result, routers.Routed) else result


def _judged(codes_GNE, replayed, flips) -> RoutingCheck:
    """RoutingCheck over one step of one MoE layer: the layout's decisions `codes_GNE`, the reference's
    replay of them (its codes and flips), as the steps' metrics carry them."""
    check = RoutingCheck(every=1, tolerance=TIE)
    ref_metrics = {"moe_routing_codes": np.asarray(replayed)[None],
                   "moe_routing_flips": np.asarray(flips.flipped_GN)[None],
                   "moe_routing_margins": np.asarray(flips.margin_GN)[None]}
    check.add(0, np.asarray(codes_GNE)[None], ref_metrics)
    return check


def _other_decision(codes_GNE, axis: str, pair: tuple[int, int]) -> jnp.ndarray:
    """The decision with a pair of experts (or of tokens) exchanged."""
    i, j = pair
    order = np.arange(codes_GNE.shape[-1 if axis == "experts" else 1])
    order[[i, j]] = order[[j, i]]
    return codes_GNE[..., order] if axis == "experts" else codes_GNE[:, order]


@pytest.mark.parametrize("name", ROUTERS)
def test_a_flip_between_scores_one_ulp_apart_is_a_tie_and_passes(name):
    route, axis = ROUTERS[name]
    logits = _scores_one_ulp_apart(axis)
    own, _ = _decided(route(logits, None))
    other = _other_decision(own, axis, (0, 1) if axis == "experts" else TIED_TOKENS)
    assert not np.array_equal(other, own)
    replayed, flips = _decided(route(logits, other))
    np.testing.assert_array_equal(replayed, other)  # the reference takes the layout's decision
    assert np.any(flips.flipped_GN)
    assert float(jnp.max(flips.margin_GN)) <= TIE
    check = _judged(other, replayed, flips)
    assert check.ties > 0 and check.flips == 0, check.report()


@pytest.mark.parametrize("name", ROUTERS)
def test_a_decision_far_from_the_reference_is_a_flip_and_fails(name):
    route, axis = ROUTERS[name]
    logits = _scores_one_ulp_apart(axis)
    own, _ = _decided(route(logits, None))
    # experts in reverse order: the leaders' decisions go to the experts scored far below them
    other = own[..., ::-1] if axis == "experts" else _other_decision(own, axis, (TIED_TOKENS[1], 6))
    replayed, flips = _decided(route(logits, other))
    check = _judged(other, replayed, flips)
    assert check.flips > 0 and check.worst[0]["margin"] > 0.1, check.report()


def test_a_decision_the_reference_does_not_reproduce_is_a_flip():
    """Capacity drops the same assignments under the same choices: a layout that kept one the reference
    drops (or the reverse) has a bug, whatever the scores, and its margin is None."""
    logits = _scores_one_ulp_apart("experts")
    routed = routers.noisy_topk(logits, None, None, 2, 2)  # capacity 2: most second choices dropped
    assert np.any(routed.codes_GNE < 0)
    layout = jnp.abs(routed.codes_GNE)  # the layout kept everything
    replayed = routers.noisy_topk(logits, None, None, 2, 2, replay_GNE=layout)
    check = _judged(layout, replayed.codes_GNE, replayed.flips)
    assert check.flips > 0 and check.worst[0]["margin"] is None


@pytest.mark.slow
def test_a_router_broken_on_one_device_fails_verify_with_flips_beyond_the_tolerance():
    """The router's weights replicated on every device, but on the last one with the experts' columns in
    reverse order: the tokens of its batch shard go to the wrong experts. Replay cannot hide it."""
    session = prepare(load_config(None, [f"run.dir={os.devnull}", "model.moe.experts=4", "model.moe.every=1",
                                         "model.moe.router=topk", "model.moe.noise=false", "model.n_layers=2",
                                         *SMALL_MODEL, "train.steps=2", "mesh.data=2", "mesh.tensor=2",
                                         "mesh.expert=2"]))
    layout = Trainer(session, trace_routing=True, trace_gradients=True)
    reference = Trainer(on_devices(reference_config(session.cfg), jax.local_devices()[:1]), trace_routing=True,
                        trace_gradients=True)

    def broken(path, leaf):
        if "w_router" not in jax.tree_util.keystr(path):
            return leaf
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        shards[-1] = shards[-1][..., ::-1].copy()
        return jax.make_array_from_single_device_arrays(
            leaf.shape, leaf.sharding, [jax.device_put(a, s.device) for a, s in zip(shards, leaf.addressable_shards)])

    result = compare(session, layout, reference, jax.tree_util.tree_map_with_path(broken, layout.init()),
                     log=lambda line: None)
    assert not result["ok"]
    assert result["routing_changes"]["flips"] > 0
    assert all(flip["margin"] > 100 * result["tie_tolerance"] for flip in result["worst_margins"]), result


def test_the_tie_tolerance_widens_with_what_the_policy_rounds():
    """A few fp32 ulps when nothing rounds; wider when the gradients are reduced in bf16; wider still when
    the activations are bf16 or fp16 (each measured on verify's layouts: docs/moe.md)."""
    from jaxpar.config.precision import policy

    exact, reduced, half = policy("fp32").tie_tolerance, policy("fp32", "bf16").tie_tolerance, \
        policy("bf16").tie_tolerance
    assert exact < 2.0 ** -16 < reduced < half == policy("fp16").tie_tolerance == policy("bf16", "bf16").tie_tolerance


def test_ties_beyond_their_measured_share_fail():
    """Ties are capped: more of them than clean layouts make in the precision is a bug of small margins."""
    route, axis = ROUTERS["switch"]
    logits = _scores_one_ulp_apart(axis)
    own, _ = _decided(route(logits, None))
    other = _other_decision(own, axis, (0, 1))
    check = _judged(other, *_decided(route(logits, other)))
    assert check.ties > 0 and check.flips == 0 and 0 < check.tie_share <= 1
    assert not check.ok  # the default cap: no ties at all
    check.max_tie_share = check.tie_share
    assert check.ok
