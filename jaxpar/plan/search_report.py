"""What `jaxpar plan --search` prints: the ranked table, then one JSON line whose `best` holds
overrides that `jaxpar train` takes as they are."""

from __future__ import annotations

from jaxpar.errors import UserError
from jaxpar.features import SEARCHED_KEYS
from jaxpar.plan.search import SearchResult
from jaxpar.runtime import machine

GIB = 2 ** 30


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f}"


def table(result: SearchResult, top: int) -> str:
    """The top `top` fitting layouts by predicted step time, with their terms in milliseconds."""
    ranked = result.ranked
    width = max([len(c.name) for c in ranked[:top]] + [6])
    header = (f"{'rank':>4}  {'layout':<{width}}  {'GiB/device':>10}  {'step ms':>10}  {'compute':>9}  "
              f"{'memory':>9}  {'comm':>9}  {'exposed':>9}  {'bubble':>9}  limiting")
    lines = [header]
    for rank, c in enumerate(ranked[:top], 1):
        p = c.prediction
        lines.append(f"{rank:>4}  {c.name:<{width}}  {c.bytes_per_device / GIB:>10.3f}  {_ms(p.seconds):>10}  "
                     f"{_ms(p.compute):>9}  {_ms(p.memory):>9}  {_ms(p.communication):>9}  "
                     f"{_ms(p.exposed_communication):>9}  {_ms(p.bubble):>9}  {p.limiting}")
    over = sum(not c.fits(result.budget) for c in result.candidates)
    lines.append(f"{len(ranked)} of {result.enumerated} layouts fit in {result.budget / 1e9:g} GB per device "
                 f"({over} over it); {result.compiled} compiled, {result.cached} from the cache, {result.pruned} "
                 f"left out as unable to enter the top {top}, "
                 f"{result.seconds:.0f} s; hardware {result.hardware.name} ({result.hardware.source})"
                 + (f"; machine: {machine.line(result.hardware.machine)}" if result.hardware.machine else ""))
    lines.append("(step = compute + memory + exposed comm + bubble; comm: all collectives; exposed: what compute "
                 "and memory work do not hide)")
    return "\n".join(lines)


def best_overrides(result: SearchResult) -> dict:
    """The best layout's value of every searched key, or a UserError when nothing fits."""
    ranked = result.ranked
    if not ranked:
        smallest = min((c for c in result.candidates if c.bytes_per_device), key=lambda c: c.bytes_per_device)
        raise UserError(f"none of the {result.enumerated} layouts fits in {result.budget / 1e9:g} GB per device; "
                        f"the smallest, {smallest.name}, needs {smallest.bytes_per_device / 1e9:.3g} GB"
                        f"{' for its state alone' if smallest.state_only else ''}.")
    return {k: ranked[0].overrides[k] for k in SEARCHED_KEYS if k in ranked[0].overrides}


def summary(result: SearchResult, best: dict, model_flops_per_step: float, compute_dtype: str, devices: int) -> dict:
    """The JSON line: best, counts, the search's seconds, the best layout's prediction (its MFU against
    the profile's peak in `compute_dtype`, the precision policy's) and a measured profile's machine."""
    first = result.ranked[0]
    peak = result.hardware.peak_flops[compute_dtype] * devices
    return {"best": best, "candidates": result.enumerated, "evaluated": len(result.candidates),
            "compiled": result.compiled, "cached": result.cached, "pruned": result.pruned,
            "fit": len(result.ranked),
            "seconds": round(result.seconds, 1), "hardware": result.hardware.name,
            "memory_budget_bytes": result.budget, "best_layout": first.name,
            "bytes_per_device": first.bytes_per_device, "predicted_step_s": first.prediction.seconds,
            "predicted_mfu": model_flops_per_step / (first.prediction.seconds * peak),
            "terms_s": first.prediction.to_dict(), "machine": result.hardware.machine}
