"""Bytes moved between host and device memory per training step (train.offload), read from the
traced step.

Each transfer is a `device_put` that names a memory: the optimizer state fetched into device
memory and stored back in pinned host memory in its own sharding (per device: its shard), and the
layer inputs the remat policy offloads and brings back (per device: their share of the
activation's split). Loop bodies count once per iteration. The traced program is read, not the
compiled one: XLA:CPU has one memory and compiles these transfers away (memory_analysis() reports
no host bytes there either); on a GPU they are copies to and from the host.
"""

from __future__ import annotations

import math

from jax.extend import core as jex_core
from jax.sharding import NamedSharding

KINDS = ("optimizer", "activations")


def _sub_jaxprs(params: dict):
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jex_core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jex_core.Jaxpr):
                yield item


def _is_host(space) -> bool:
    return "host" in str(space).lower()


def _walk(jaxpr, times: int, activation_split: int, totals: dict) -> None:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            for src, dst, where in zip(eqn.invars, eqn.outvars, eqn.params["devices"]):
                aval = dst.aval
                if isinstance(where, NamedSharding):
                    if where.memory_kind is None:
                        continue  # a change of sharding, not of memory
                    kind, to_host = "optimizer", _is_host(where.memory_kind)
                    nbytes = math.prod(where.shard_shape(aval.shape)) * aval.dtype.itemsize
                elif where is not None and _is_host(where) != _is_host(getattr(src.aval, "memory_space", "")):
                    kind, to_host = "activations", _is_host(where)
                    nbytes = aval.size * aval.dtype.itemsize // activation_split
                else:
                    continue
                totals[kind]["to_host" if to_host else "to_device"] += nbytes * times
        inner = times * (eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1)
        for sub in _sub_jaxprs(eqn.params):
            _walk(sub, inner, activation_split, totals)


def host_transfers(trainer, abstract_state, abstract_batch) -> dict:
    """{'optimizer'|'activations': {'to_device': bytes, 'to_host': bytes}} per step per device."""
    layout = trainer.layout
    # a layer input is split over the batch shards the trace sees (and its sequence over tensor
    # under sequence parallelism); inside a shard_map manual over the batch axes it is local already
    split = layout.traced_batch_shards * (layout.sizes.get("tensor", 1) if layout.sequence_parallel else 1)
    totals = {kind: {"to_device": 0, "to_host": 0} for kind in KINDS}
    _walk(trainer.step.trace(abstract_state, abstract_batch).jaxpr.jaxpr, 1, split, totals)
    return totals
