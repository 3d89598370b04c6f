"""`verify` for local SGD (parallel.sync_every > 1): the layout against R single-device replicas.

The reference trains each of the R replicas on its own rows of every batch, one after the
other, on one device in fp32 (each a synchronous single-device run), and synchronizes them
every H steps with the outer rule written here in NumPy: a second implementation of
jaxpar.train.local_sgd.synchronize that shares none of its code. Every replica's weights are
compared at the end, and the replicas' mean loss at every step.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxpar.interop.checkpoint_files import flat_by_path
from jaxpar.session import Session, on_devices
from jaxpar.train.trainer import Trainer


def _outer_numpy(replicas: list[dict], outer: dict, p) -> list[dict]:
    """The replicas' weights after synchronizing (flat {path: array}); updates `outer` in place."""
    mean = {k: np.mean([r[k] for r in replicas], axis=0) for k in replicas[0]}
    if p.outer == "avg":
        return [dict(mean) for _ in replicas]
    for k, m in mean.items():
        outer_grad = outer["anchor"][k] - m
        outer["momentum"][k] = p.outer_momentum * outer["momentum"][k] + outer_grad
        outer["anchor"][k] = outer["anchor"][k] - p.outer_lr * (outer_grad + p.outer_momentum * outer["momentum"][k])
    return [dict(outer["anchor"]) for _ in replicas]


def _with_params(state, flat: dict, put):
    """`state` with the weights `flat` ({path: array}), placed by `put`."""
    leaves = [flat[k] for k in flat_by_path(state.params)]
    params = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(state.params), leaves)
    return put(dataclasses.replace(state, params=params))


def verify_local(session: Session, layout, reference_cfg, steps: int, log) -> tuple[list[float], dict]:
    """(loss relative errors per step, {replica/path: parameter relative error}) of the layout's
    trainer `layout` against R single-device replicas."""

    cfg, p = session.cfg, session.cfg.parallel
    R = layout.strategy.replicas
    rows = cfg.train.batch_size // R
    reference = Trainer(on_devices(reference_cfg.replace(**{"train.batch_size": rows, "parallel.sync_every": 1}),
                                   jax.local_devices()[:1]), layout.model, layout.rules)
    gather = jax.jit(lambda tree: tree, out_shardings=layout.replicated)
    state = layout.init()
    start = jax.device_get(gather(state))
    one = lambda tree, r: jax.tree.map(lambda x: x[r], tree)  # noqa: E731
    replicas = [reference.put_state(dataclasses.replace(one(dataclasses.replace(start, outer=None), r), outer=None))
                for r in range(R)]
    first = {k: np.asarray(v) for k, v in flat_by_path(jax.device_get(replicas[0].params)).items()}
    outer = {"anchor": dict(first), "momentum": {k: np.zeros_like(v) for k, v in first.items()}}
    sampler, errors = session.train_data, []
    for index in range(steps):
        starts = sampler.starts(index)
        state, metrics = layout.step(state, layout.put_windows(sampler, starts))
        windows = sampler.windows(starts)
        losses = []
        for r in range(R):
            mine = jax.tree.map(lambda x, r=r: x[r * rows:(r + 1) * rows], windows)  # packed rows too
            replicas[r], m = reference.step(replicas[r], reference.put_batch(mine))
            losses.append(float(m["loss"]))
        if (index + 1) % p.sync_every == 0:
            flat = [{k: np.asarray(v) for k, v in flat_by_path(jax.device_get(s.params)).items()} for s in replicas]
            replicas = [_with_params(s, f, reference.put_state) for s, f in zip(replicas, _outer_numpy(flat, outer, p))]
        loss, ref_loss = float(metrics["loss"]), float(np.mean(losses))
        errors.append(abs(loss - ref_loss) / abs(ref_loss))
        log(f"step {index + 1}: loss {loss:.7f}  reference {ref_loss:.7f}  rel err {errors[-1]:.2e}")
    params = {k: np.asarray(v) for k, v in flat_by_path(jax.device_get(gather(state.params))).items()}
    param_errors = {}
    for r, s in enumerate(replicas):
        for k, ref in flat_by_path(jax.device_get(s.params)).items():
            ref = np.asarray(ref)
            param_errors[f"replica{r}/{k}"] = float(np.linalg.norm(params[k][r] - ref)
                                                    / max(np.linalg.norm(ref), 1e-30))
    return errors, param_errors
