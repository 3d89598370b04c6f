"""`verify`: train a layout and the single-device reference side by side and compare them.

Both start from the same weights (the layout's sharded init, copied to one device) and see
the same batches. The reference is always one device, fp32, no gradient accumulation, dot attention.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxpar.session import Session, on_devices
from jaxpar.switches import reference_overrides
from jaxpar.train.checkpoint import flat_by_path
from jaxpar.train.trainer import Trainer

DEFAULT_STEPS = 3


def reference_config(cfg):
    """The single-device version of a config: every layout switch as the reference takes it
    (jaxpar.switches: one device, fp32, ZeRO-0, no remat, offload or accumulation, plain L x L
    attention, so flash and cuDNN attention are checked against it)."""
    return cfg.replace(**reference_overrides())


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def verify(session: Session, log=print, model=None, rules=None) -> dict:
    """Run both sides for train.steps steps; return the result dict printed by the CLI. `model`
    and `rules`: a module of your own and its rules, as for Trainer."""
    cfg = session.cfg
    traced = bool(cfg.model.moe.experts) and model is None  # jaxpar's MoE names each token's experts
    layout = Trainer(session, model, rules, trace_routing=traced)
    if layout.strategy.replicas:  # local SGD: against R single-device replicas synchronized by NumPy
        from jaxpar.train.verify_local import verify_local

        loss_errors, errors = verify_local(session, layout, reference_config(cfg), cfg.train.steps, log)
        loss_tol, param_tol = session.precision.tolerances
        return {"ok": bool(max(loss_errors) <= loss_tol and max(errors.values()) <= param_tol),
                "layout": session.layout_name(), "steps": cfg.train.steps, "loss_max_rel_err": max(loss_errors),
                "param_max_rel_err": max(errors.values())}
    # In a multi-process run every process keeps its own reference on one of its own devices.
    reference = Trainer(on_devices(reference_config(cfg), jax.local_devices()[:1]), model, rules,
                        trace_routing=traced)
    # The layout's arrays may span processes: copy them whole onto every device before reading them.
    gather = jax.jit(lambda tree: tree, out_shardings=layout.replicated)

    state = layout.init()
    ref_state = reference.put_state(layout.to_model_order(jax.device_get(gather(state))))
    loss_errors, moved = [], 0
    sampler = session.train_data
    moe_layers = cfg.model.n_layers // cfg.model.moe.every if traced else 0
    for index in range(cfg.train.steps):
        starts = sampler.starts(index)
        state, metrics = layout.step(state, layout.put_windows(sampler, starts))
        ref_state, ref_metrics = reference.step(ref_state, reference.put_batch(sampler.windows(starts)))
        loss, ref_loss = float(metrics["loss"]), float(ref_metrics["loss"])
        loss_errors.append(abs(loss - ref_loss) / abs(ref_loss))
        if moe_layers:
            moved += rerouted_tokens(metrics, ref_metrics, moe_layers)
        log(f"step {index + 1}: loss {loss:.7f}  reference {ref_loss:.7f}  rel err {loss_errors[-1]:.2e}")

    params, ref_params = jax.device_get((gather(layout.to_model_order(state.params)), ref_state.params))
    errors = {key: _rel(np.asarray(a), np.asarray(ref[key])) for ref in [flat_by_path(ref_params)]
              for key, a in flat_by_path(params).items()}
    loss_tol, param_tol = session.precision.tolerances
    result = {"layout": session.layout_name(), "steps": cfg.train.steps, "loss_max_rel_err": max(loss_errors),
              "param_max_rel_err": max(errors.values())}
    judged = errors
    if moe_layers:
        result["routing_changes"] = moved
        if moved and not session.precision.exact:
            # Low-precision activations route some tokens differently from the fp32 reference, and
            # a moved token changes its experts' and the router's gradients outright. Those weights
            # are reported, not judged; every other weight is judged at the usual tolerance.
            moe = _moe_weights(errors)
            result["moe_param_max_rel_err"] = max(errors[k] for k in moe)
            judged = {k: e for k, e in errors.items() if k not in moe}
            result["param_max_rel_err"] = max(judged.values())
    result["ok"] = bool(max(loss_errors) <= loss_tol and max(judged.values()) <= param_tol
                        and not (session.precision.exact and result.get("routing_changes")))
    return {"ok": result.pop("ok"), **result}


def rerouted_tokens(metrics, ref_metrics, moe_layers: int) -> int:
    """How many tokens of this step's batch went to other experts than in the reference, in any MoE
    layer: their summed routing codes differ (jaxpar.model.moe.routing_codes; the step reports them
    averaged over the layers, so they are scaled back and rounded to the integers they are)."""
    codes, ref_codes = (np.rint(np.asarray(m["moe_routing_codes"], np.float64) * moe_layers)
                        for m in (metrics, ref_metrics))
    return int(np.count_nonzero(codes != ref_codes))


def _moe_weights(errors: dict) -> set[str]:
    """Paths of mixture-of-experts weights: everything in a module that holds a router."""
    modules = {key.rsplit("/w_router", 1)[0] + "/" for key in errors if "/w_router" in key}
    return {key for key in errors if any(key.startswith(m) for m in modules)}
