"""`verify`: train a layout and the single-device reference side by side and compare them.

Both start from the same weights (the layout's sharded init, copied to one device) and see
the same batches. The reference is always one device, fp32 (fp8's: fp8), no gradient accumulation,
dot attention; for a mixture-of-experts model it takes the layout's routing decisions and judges each one that
its own router would have made otherwise (jaxpar.verify.routing).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compilation_cache.compilation_cache import reset_cache

from jaxpar.config import Config, RunConfig
from jaxpar.config.objectives import Objective, objective_of
from jaxpar.config.precision import of as policy_of
from jaxpar.features import reference_overrides
from jaxpar.interop.checkpoint_files import flat_by_path
from jaxpar.rl.rollout import Scoring
from jaxpar.session import Session, on_devices
from jaxpar.train.feeds import RolloutFeed
from jaxpar.train.run_session import prepare
from jaxpar.train.trainer import Trainer
from jaxpar.verify.checks import Verdict, gradient_errors, norm_errors, rounding_share, update_errors, worst_first
from jaxpar.verify.local_sgd import verify_local
from jaxpar.verify.routing import RoutingCheck
from jaxpar.verify.ties import UpdateTies

# Five steps: four updates each followed by a compared loss, and a fifth whose update the weights show. The
# first already learns (jaxpar.train.optim.lr_schedule), so every step is one verify can judge.
DEFAULT_STEPS = 5
# The objectives whose gradients are differences of similar terms (GRPO's, which samples: its advantages sum to
# zero in each group): an element's gradient can be rounding on both sides, and Adam still moves it a whole step, so its
# direction is a near-tie (jaxpar.verify.ties). LoRA's adapters have them too: after one Adam step every
# element of B is +-lr, so A's gradient is a signed sum of equal terms (measured: A of the keys' adapter at
# step 2 differed by 1.8e-4 of itself in fp32, its update by 2.2e-3). Other runs have none: every element counts.
# LoRA's A matrices in reduced precisions: while B is Adam's sign pattern, A's gradient is a signed sum of equal
# terms, rounded as bf16 rounds each of them. Measured on the sweep's draws (tests/test_verify_sweep.py): bf16
# gradients up to 0.18 and updates 0.28 (draw 16), fp32 with bf16 reductions 0.13 and 0.15 (draw 13), fp8 updates
# 0.68 (draw 9), where every other tensor stays within the policy's tolerance. They are judged at 5 times it: in
# bf16 a gradient that is lost or scaled by 2 still fails, in fp8 only one that is lost.
CANCELLING_FACTOR = 5
# The single-device trainers (references and fp8's gauges) of the last configs verified in this process, kept for
# the next verify of the same model: verifying several layouts of one model (the fault catalog, the sweep, a search
# by hand) compiles the reference once. Its programs were about a third of a verify's time: the catalog's expert
# layout took 7.3 s a fault with its own reference, 4.3-5.7 s with the one before (2 cores, fp32).
_SINGLE_DEVICE: OrderedDict[tuple, Trainer] = OrderedDict()
KEPT_SINGLE_DEVICE = 4


def has_near_ties(cfg) -> bool:
    """Whether verify judges Adam's near-ties apart for this run: GRPO's, or LoRA adapters'."""
    return objective_of(cfg).samples or cfg.model.lora.enabled


def reference_config(cfg):
    """The single-device version of a config: every layout switch as the reference takes it
    (jaxpar.features: one device, fp32 (fp8: the fp8 policy, whose GEMMs it quantizes too), ZeRO-0, no
    remat, offload or accumulation, plain L x L attention, so flash and cuDNN attention are checked against it)."""
    return cfg.replace(**reference_overrides(cfg))


def gauge_config(cfg):
    """The reference's config in its policy's rounding_gauge precision (fp8's: bf16), whose gradients at the
    reference's weights measure the policy's own rounding (jaxpar.config.precision.FP8_ROUNDING_SHARE)."""
    return reference_config(cfg).replace(**{"train.precision": policy_of(cfg).rounding_gauge})


@contextlib.contextmanager
def _compiled_afresh():
    """XLA's persistent compilation cache off while verify compiles its programs (the layout's init and the steps
    that return their gradients). XLA:CPU (jax 0.12.0.1) aborts the process reading the gradients of such a step
    when its program came from that cache (data=8, ZeRO-2, full remat, verified twice in one process), and
    deadlocks the step's collectives when the init that made its state came from the cache and the step did not
    (the same layout verified again in a fresh process, against a reference at another learning rate: two devices
    waited at an all-reduce, six at an all-gather). Compiled afresh, both run. jax decides whether it uses the
    cache at a process's first compile and keeps to it, whatever the setting says after: the cache is reset on
    the way in and out, so that the setting holds here (it did not once anything had compiled before verify),
    and the cache serves the process's other programs again after."""
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        reset_cache()


def verify(session: Session, log=print, model=None, rules=None) -> dict:
    """Run both sides for train.steps steps; return the result dict printed by the CLI. `model`
    and `rules`: a module of your own and its rules, as for Trainer. A policy with a logic_precision (fp8's: fp32)
    has the same layout verified in it as well, under `logic` (jaxpar.config.precision.PrecisionPolicy)."""
    logic = session.precision.logic_precision
    if logic is None:
        return _verified(session, log, model, rules)
    # validated before anything compiles, like the layout's own config
    logic_session = prepare(session.cfg.replace(**{"train.precision": logic}), session.devices)  # with its data
    checked = _verified(logic_session, lambda line: log(f"{logic}: {line}"), model, rules)
    result = _verified(session, log, model, rules)
    failures = [{**failure, "check": f"{logic} {failure['check']}"} for failure in checked["failures"]]
    failures = worst_first(failures + result["failures"])
    return {**result, "ok": result["ok"] and checked["ok"], "failures": failures,
            "logic": {"precision": logic, **checked}}


def _verified(session: Session, log, model, rules) -> dict:
    """verify in the session's own precision."""
    cfg = session.cfg
    traced = bool(cfg.model.moe.experts) and model is None  # jaxpar's MoE records and replays its routing
    local = cfg.parallel.sync_every > 1
    layout = Trainer(session, model, rules, trace_routing=traced, trace_gradients=not local)
    if layout.strategy.replicas:  # local SGD: against R single-device replicas synchronized by NumPy

        loss_errors, errors = verify_local(session, layout, reference_config(cfg), cfg.train.steps, log)
        loss_tol, param_tol = session.precision.tolerances
        verdict = Verdict()
        verdict.add_steps("loss_max_rel_err", loss_errors, loss_tol)
        verdict.add("param_max_rel_err", errors, param_tol)
        return {"ok": verdict.ok, "layout": session.layout_name(), "steps": cfg.train.steps, **verdict.report()}
    reference = _single_device(reference_config(cfg), model, rules, traced)
    gauge = None
    if session.precision.rounding_gauge is not None:  # fp8: the reference with its GEMMs in bf16
        gauge = _single_device(gauge_config(cfg), model, rules, traced)
    with _compiled_afresh():  # the init too: a cached init beside a fresh step deadlocked (_compiled_afresh)
        return _compare(session, layout, reference, layout.init(), log, gauge)


def _single_device(cfg: Config, model, rules, traced: bool) -> Trainer:
    """A trainer of `cfg` on this process's first device (in a multi-process run every process keeps its own
    reference), traced for verify; for jaxpar's own model, the one kept from an earlier verify of the same config
    (run.* aside: it names no program) if there is one (_SINGLE_DEVICE). A module of your own is built afresh:
    verify cannot tell whether it changed since."""
    device = jax.local_devices()[0]
    build = lambda: Trainer(on_devices(cfg, [device]), model, rules, trace_routing=traced,  # noqa: E731
                            trace_gradients=True)
    if model is not None or rules is not None:
        return build()
    key = (dataclasses.replace(cfg, run=RunConfig()), traced, device.id)
    if key not in _SINGLE_DEVICE:
        _SINGLE_DEVICE[key] = build()
        while len(_SINGLE_DEVICE) > KEPT_SINGLE_DEVICE:
            _SINGLE_DEVICE.popitem(last=False)
    _SINGLE_DEVICE.move_to_end(key)
    return _SINGLE_DEVICE[key]


def _batches(session: Session, layout: Trainer, reference: Trainer, gather):
    """batches(index, state, ref_state) -> step index's batch for each side: the same windows, or for GRPO
    the same completions (sampled by the layout, replayed to the reference), each side scoring them with
    its own weights (and the same frozen reference policy)."""
    if not objective_of(session.cfg).samples:
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


def _reference_step(reference: Trainer, ref_state, ref_batch, routing: RoutingCheck | None, metrics, index: int,
                    gauge: Trainer | None):
    """The reference's step on `ref_batch`, replaying the routing decisions in the layout's `metrics` (those of
    step `index`) when `routing` judges them; and the gauge's gradients at the same weights (None: no gauge)."""
    codes = None if routing is None else routing.codes(jax.device_get(metrics))
    replay = () if codes is None else (reference.put_batch(routing.replay_input(codes)),)
    gauged = None
    if gauge is not None:  # on copies: a step donates its state
        _, gauge_metrics = gauge.step(*jax.tree.map(jnp.copy, (ref_state, ref_batch, *replay)))
        gauged = _flat(gauge_metrics["gradients"])
    ref_state, ref_metrics = reference.step(ref_state, ref_batch, *replay)
    if codes is not None:
        routing.add(index, codes, jax.device_get(ref_metrics))
    return ref_state, ref_metrics, gauged


def compare(session: Session, layout: Trainer, reference: Trainer, state, log=print,
            gauge: Trainer | None = None) -> dict:
    """verify's comparison (_compare), its steps compiled afresh (_compiled_afresh)."""
    with _compiled_afresh():
        return _compare(session, layout, reference, state, log, gauge)


def _compare(session: Session, layout: Trainer, reference: Trainer, state, log=print, gauge: Trainer | None = None
             ) -> dict:
    """verify's comparison from the layout's state `state` (the reference starts from a copy of it), both
    trainers built with trace_gradients (and trace_routing for jaxpar's mixture of experts): both
    sides train on the same batches, the reference replaying the layout's routing of an MoE model
    (jaxpar.verify.routing), and they are judged tensor by tensor (jaxpar.verify.checks): the
    loss, the gradient norm and each tensor's gradient at every step, each tensor's update after the last; with a
    `gauge` (the reference in the policy's rounding_gauge precision), the layout's share of the policy's rounding."""
    cfg, policy = session.cfg, session.precision
    # The layout's arrays may span processes: copy them whole onto every device before reading them.
    gather = jax.jit(lambda tree: tree, out_shardings=layout.replicated)
    ref_state = reference.put_state(layout.to_model_order(jax.device_get(gather(state))))
    initial = {key: np.asarray(value, np.float64) for key, value in _flat(ref_state.params).items()}
    ties = UpdateTies(initial, policy.reference, not policy.gradients_rounded) if has_near_ties(cfg) else None
    moe = cfg.model.moe
    max_ties = policy.max_routing_tie_share[moe.router == "expert_choice"]
    routing = RoutingCheck(moe.every, policy.tie_tolerance, moe.first_dense, max_ties) if layout.trace_routing else None
    loss_errors, norms, batches = [], ([], []), _batches(session, layout, reference, gather)
    grad_errors = {}  # (tensor, step) -> the gradient's relative error
    shares = []  # each step's rounding_share (with a gauge)
    # GRPO's loss is a mean of terms of order 1 (the advantages have unit spread in each group) that cancel
    # to about 0 where the ratio is 1: its error is measured against that order, not against the near-0 sum
    loss_floor = 1.0 if objective_of(cfg).samples else 1e-30
    # 2BW's step completes the previous one (its metrics and update) and a drain the last: the reference trails
    waiting, lag = [], layout.pacing.behind
    replays = (None,) if routing is not None and not lag else ()  # a traced step's decisions to replay: none
    for index in range(cfg.train.steps + lag):
        if index < cfg.train.steps:
            batch, ref_batch = batches(index, state, ref_state)
            state, metrics = layout.step(state, batch, *replays)
            waiting.append(ref_batch)
        else:
            state, metrics = layout.pacing.finish(state)
        if index < lag:
            continue
        # replicated on every device by the step already: read as they are (each process holds them whole)
        gradients = _flat(layout.to_model_order(metrics.pop("gradients")))
        ref_state, ref_metrics, gauged = _reference_step(reference, ref_state, waiting.pop(0), routing, metrics,
                                                         index - lag, gauge)
        step_errors, share = _judged_gradients(gradients, _flat(ref_metrics.pop("gradients")), gauged, policy)
        shares += [] if share is None else [share]
        grad_errors.update({f"{key} (step {index + 1 - lag})": error for key, error in step_errors.items()})
        if ties is not None:
            ties.add(ref_state.opt_state)
        loss, ref_loss = float(metrics["loss"]), float(ref_metrics["loss"])
        loss_errors.append(abs(loss - ref_loss) / max(abs(ref_loss), loss_floor))
        norms[0].append(float(metrics["grad_norm"]))
        norms[1].append(float(ref_metrics["grad_norm"]))
        log(f"step {index + 1 - lag}: loss {loss:.7f}  reference {ref_loss:.7f}  rel err {loss_errors[-1]:.2e}"
            f"  grad norm {norms[0][-1]:.6g}  reference {norms[1][-1]:.6g}")

    params, ref_params = jax.device_get((gather(layout.to_model_order(state.params)), ref_state.params))
    verdict = _judge(policy, policy.loss_tolerance(objective_of(cfg)), loss_errors, norms, grad_errors, _flat(params),
                     _flat(ref_params), initial, ties, _judged_shares(objective_of(cfg), shares))
    for check, (values, bound) in (routing.judged() if routing else {}).items():
        verdict.add(check, values, bound)
    result = {"layout": session.layout_name(), "steps": cfg.train.steps, **verdict.report()}
    if ties is not None:
        result["update_ties"] = ties.count()
    return {"ok": verdict.ok, **result, **(routing.report() if routing else {})}


def _judged_shares(objective: Objective, shares: list[float]) -> list[float]:
    """The rounding shares verify judges: every step's, but GRPO's first only. After it the gauge takes its gradient
    at the reference's weights, from which GRPO's layout has parted by its near-ties' whole Adam steps (taken either
    way by rounding: jaxpar.verify.ties), not by fp8's rounding: tests/fault_catalog.py's clean GRPO layout
    measured 1.6-2.4 there, and 0.77 at the first step."""
    return shares[:1] if objective.samples else shares


def _judged_gradients(gradients: dict, ref_gradients: dict, gauged: dict | None, policy):
    """One step's gradient error of each tensor, and the layout's share of the policy's rounding where a gauge ran
    (else None)."""
    share = None if gauged is None else rounding_share(gradients, ref_gradients, gauged)
    return gradient_errors(gradients, ref_gradients, policy.error_floor), share


def _flat(tree) -> dict[str, np.ndarray]:
    """{path: array} of a tree's array leaves on the host (a frozen weight's None or float0 left out)."""
    return {key: np.asarray(value) for key, value in flat_by_path(jax.device_get(tree)).items()
            if value is not None and np.asarray(value).dtype.kind == "f"}


def _judge(policy, loss_tol: float, loss_errors: list[float], norms, grad_errors: dict, params: dict,
           ref_params: dict, initial: dict, ties: UpdateTies | None, shares: list[float]) -> Verdict:
    """The checks of jaxpar.verify.checks at the policy's tolerances; a near-tie objective's Adam ties
    (jaxpar.verify.ties) are left out of the update check and judged by their count and direction; the
    rounding shares (a gauged policy's), the first step's apart (the weights still the same: no drift in it)."""
    param_tol = policy.tolerances[1]
    verdict = Verdict()
    verdict.add_steps("loss_max_rel_err", loss_errors, loss_tol)
    verdict.add_steps("grad_norm_max_rel_err", norm_errors(*norms), policy.norm_tolerance)
    # at the first step both sides differentiate the same weights; after it, weights the update's rounding parted
    first_step = {key: error for key, error in grad_errors.items() if key.endswith(" (step 1)")}
    _add_split("grad_max_rel_err", verdict, first_step, policy.grad_tolerance, policy)
    later = {key: error for key, error in grad_errors.items() if key not in first_step}
    _add_split("later_grad_max_rel_err", verdict, later, policy.later_grad_tolerance, policy)
    if shares:
        first, after = policy.rounding_share
        verdict.add_steps("first_rounding_share", shares[:1], first)
        verdict.add_steps("rounding_share", shares[1:], after, first=2)
    if ties is not None:
        params, ref_params, initial = ties.without_ties(params, ref_params, initial)
        for check, (values, bound) in ties.judged().items():
            verdict.add(check, values, bound)
    floor = policy.error_floor
    _add_split("update_max_rel_err", verdict, update_errors(params, ref_params, initial, floor),
               policy.update_tolerance, policy)
    from_start = {key: error for key, error in update_errors(params, ref_params, {k: 0.0 for k in initial},
                                                             floor).items()
                  if np.any(initial[key])}  # relative to the weights: the tensors that start nonzero
    # Relative to the tensor, a reduced precision's error is its update error diluted by the weights, and the
    # trajectories part further with every step (fp8 after 5 steps: up to 2.3e-2 where the updates agree to
    # 0.14): the update check judges it, and the weights' error is reported. fp32 judges both.
    verdict.add("param_max_rel_err", from_start, np.inf if policy.reduced else param_tol)
    return verdict


def _is_adapter_a(key: str) -> bool:
    """Whether a tensor (or a 'tensor (step N)') is a LoRA adapter's A matrix (its path: .../lora_*/a/value)."""
    parts = key.split(" ")[0].split("/")
    return len(parts) >= 3 and parts[-3].startswith("lora") and parts[-2] == "a"


def _add_split(check: str, verdict: Verdict, errors: dict, tolerance: float, policy) -> None:
    """Add `check` over `errors`; where the gradients are rounded below fp32, LoRA's A matrices apart, at
    CANCELLING_FACTOR times the tolerance (as lora_a_<check>)."""
    apart = {key: error for key, error in errors.items() if policy.gradients_rounded and _is_adapter_a(key)}
    verdict.add(check, {key: error for key, error in errors.items() if key not in apart}, tolerance)
    if apart:
        verdict.add(f"lora_a_{check}", apart, CANCELLING_FACTOR * tolerance)
