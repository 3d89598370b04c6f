"""Step timing shared by the benchmarks (import it only after the devices are set up)."""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np


def time_steps(step, state, put, batches: list[np.ndarray], warmup: int):
    """Run `state, out = step(state, batch)` over the batches; return (median seconds of the steps
    after `warmup`, the last step's output, the final state).

    Each batch is transferred (and waited for) before its timer starts, so host-to-device
    copies are excluded for every layout alike; each step is waited for before its timer stops.
    """
    times, out = [], None
    for i, host in enumerate(batches):
        batch = jax.block_until_ready(put(host))
        start = time.perf_counter()
        state, out = step(state, batch)
        jax.block_until_ready((state, out))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), out, state
