"""`verify`: train a layout and the single-device reference side by side and compare them.

Both start from the same weights (the layout's sharded init, copied to one device) and see
the same batches. The reference is always one device, fp32 (fp8's: fp8), no gradient accumulation,
dot attention; for a mixture-of-experts model it takes the layout's routing decisions and judges each one that
its own router would have made otherwise (jaxpar.train.routing_check).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxpar.features import reference_overrides
from jaxpar.rl.rollout import Scoring
from jaxpar.session import Session, on_devices
from jaxpar.train.checkpoint import flat_by_path
from jaxpar.train.feeds import RolloutFeed
from jaxpar.train.routing_check import RoutingCheck
from jaxpar.train.trainer import Trainer
from jaxpar.train.update_ties import UpdateTies
from jaxpar.train.verify_local import verify_local

DEFAULT_STEPS = 3


def reference_config(cfg):
    """The single-device version of a config: every layout switch as the reference takes it
    (jaxpar.features: one device, fp32 (fp8: the fp8 policy, whose GEMMs it quantizes too), ZeRO-0, no
    remat, offload or accumulation, plain L x L attention, so flash and cuDNN attention are checked against it)."""
    return cfg.replace(**reference_overrides(cfg))


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def verify(session: Session, log=print, model=None, rules=None) -> dict:
    """Run both sides for train.steps steps; return the result dict printed by the CLI. `model`
    and `rules`: a module of your own and its rules, as for Trainer."""
    cfg = session.cfg
    traced = bool(cfg.model.moe.experts) and model is None  # jaxpar's MoE records and replays its routing
    layout = Trainer(session, model, rules, trace_routing=traced)
    if layout.strategy.replicas:  # local SGD: against R single-device replicas synchronized by NumPy

        loss_errors, errors = verify_local(session, layout, reference_config(cfg), cfg.train.steps, log)
        loss_tol, param_tol = session.precision.tolerances
        return {"ok": bool(max(loss_errors) <= loss_tol and max(errors.values()) <= param_tol),
                "layout": session.layout_name(), "steps": cfg.train.steps, "loss_max_rel_err": max(loss_errors),
                "param_max_rel_err": max(errors.values())}
    # In a multi-process run every process keeps its own reference on one of its own devices.
    reference = Trainer(on_devices(reference_config(cfg), jax.local_devices()[:1]), model, rules,
                        trace_routing=traced)
    return compare(session, layout, reference, layout.init(), log)


def _batches(session: Session, layout: Trainer, reference: Trainer, gather):
    """batches(index, state, ref_state) -> step index's batch for each side: the same windows, or for GRPO
    the same completions (sampled by the layout, replayed to the reference), each side scoring them with
    its own weights (and the same frozen reference policy)."""
    if session.cfg.train.objective != "grpo":
        sampler = session.train_data

        def windows(index, state, ref_state):
            starts = sampler.starts(index)
            return layout.put_windows(sampler, starts), reference.put_batch(sampler.windows(starts))

        return windows
    feed = RolloutFeed(session, layout)
    frozen = feed.scoring.reference
    copied = None if frozen is None else jax.device_put(jax.device_get(gather(frozen)), reference.param_shardings)
    ref_scoring = Scoring(reference, copied)

    def rollouts(index, state, ref_state):
        batch, _ = feed.batch(index, state)
        return batch, ref_scoring.batch(ref_state.params, feed.rows)

    return rollouts


def _reference_step(reference: Trainer, ref_state, ref_batch, routing: RoutingCheck | None, metrics, index: int):
    """The reference's step on `ref_batch`, replaying the routing decisions in the layout's `metrics` (those of
    step `index`) when `routing` judges them."""
    if routing is None:
        return reference.step(ref_state, ref_batch)
    codes = routing.codes(jax.device_get(metrics))
    ref_state, ref_metrics = reference.step(ref_state, ref_batch, reference.put_batch(routing.replay_input(codes)))
    routing.add(index, codes, jax.device_get(ref_metrics))
    return ref_state, ref_metrics


def compare(session: Session, layout: Trainer, reference: Trainer, state, log=print) -> dict:
    """verify's comparison from the layout's state `state` (the reference starts from a copy of it):
    both sides train on the same batches, the reference replaying the layout's routing of an MoE
    model (jaxpar.train.routing_check), and the losses and final weights are compared."""
    cfg, policy = session.cfg, session.precision
    # The layout's arrays may span processes: copy them whole onto every device before reading them.
    gather = jax.jit(lambda tree: tree, out_shardings=layout.replicated)
    ref_state = reference.put_state(layout.to_model_order(jax.device_get(gather(state))))
    ties = UpdateTies(flat_by_path(jax.device_get(ref_state.params)))
    moe = cfg.model.moe
    routing = RoutingCheck(moe.every, policy.tie_tolerance, moe.first_dense) if layout.trace_routing else None
    loss_errors, batches = [], _batches(session, layout, reference, gather)
    # GRPO's loss is a mean of terms of order 1 (the advantages have unit spread in each group) that cancel
    # to about 0 where the ratio is 1: its error is measured against that order, not against the near-0 sum
    loss_floor = 1.0 if cfg.train.objective == "grpo" else 1e-30
    # 2BW's step completes the previous one (its metrics and update) and a drain the last: the reference trails
    waiting, lag = [], int(layout.lags)
    replays = (None,) if routing is not None and not lag else ()  # a traced step's decisions to replay: none
    for index in range(cfg.train.steps + lag):
        if index < cfg.train.steps:
            batch, ref_batch = batches(index, state, ref_state)
            state, metrics = layout.step(state, batch, *replays)
            waiting.append(ref_batch)
        else:
            state, metrics = layout.drain(state)
        if index < lag:
            continue
        ref_state, ref_metrics = _reference_step(reference, ref_state, waiting.pop(0), routing, metrics, index - lag)
        ties.add(ref_state.opt_state)
        loss, ref_loss = float(metrics["loss"]), float(ref_metrics["loss"])
        loss_errors.append(abs(loss - ref_loss) / max(abs(ref_loss), loss_floor))
        log(f"step {index + 1 - lag}: loss {loss:.7f}  reference {ref_loss:.7f}  rel err {loss_errors[-1]:.2e}")

    params, ref_params = jax.device_get((gather(layout.to_model_order(state.params)), ref_state.params))
    result = {"layout": session.layout_name(), "steps": cfg.train.steps, "loss_max_rel_err": max(loss_errors),
              **_weight_errors(flat_by_path(params), flat_by_path(ref_params), ties, policy)}
    ok = max(loss_errors) <= policy.tolerances[0] and result.pop("weights_ok")
    ok = ok and not (routing and routing.flips)
    return {"ok": bool(ok), **result, **(routing.report() if routing else {})}


def _weight_errors(params: dict, ref_params: dict, ties: UpdateTies, policy) -> dict:
    """param_max_rel_err over the weights that start nonzero (from_zero_max_rel_err over those that start at
    zero, which are all updates, at the policy's tolerance for them), each tensor's Adam near-ties left out
    and judged apart (jaxpar.train.update_ties), and weights_ok: whether all are within tolerance."""
    errors, within = {}, True
    for key, ref in ref_params.items():
        judged, ref_judged, ties_within = ties.split(key, np.asarray(params[key]), np.asarray(ref))
        errors[key], within = _rel(judged, ref_judged), within and ties_within
    from_zero = {key for key, value in ties.initial.items() if not np.any(value)}
    result = {"param_max_rel_err": max((error for key, error in errors.items() if key not in from_zero),
                                       default=0.0)}
    if from_zero:
        result["from_zero_max_rel_err"] = max(errors[key] for key in from_zero)
    within = within and result["param_max_rel_err"] <= policy.tolerances[1]
    within = within and result.get("from_zero_max_rel_err", 0.0) <= policy.from_zero_tolerance
    return {**result, "update_ties": ties.count(), "weights_ok": within}
