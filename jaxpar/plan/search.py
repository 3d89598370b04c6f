"""`jaxpar plan --search`: every valid layout of a model on N devices, compiled abstractly,
ranked by the roofline's predicted step time within a memory budget.

The layouts are every combination of the mesh axes (data x tensor x expert x stage x context = N),
parallel.zero, train.remat, with stages the pipeline schedule (interleaved with two virtual
stages per device; not naive, which GPipe beats in time and memory) and 1, 2 or 4 microbatches
per stage, and with context the ring or all-gather attention. Context sizes are tried while each
balanced chunk of the sequence holds at least one key block of the attention. Combinations that
compute the same program another does are left out: ZeRO stages without a data axis to shard over, an
expert axis in a dense model (it is a second data axis there), sqrt remat on fewer than four
layers per stage. train.grad_accum only lowers memory (the same FLOPs and reductions per
step), so 2, 4, 8 are tried only for a layout that does not fit without. Settings given on the
command line (say mesh.tensor=2) are held fixed. `validation.validate` decides what is valid.

Each layout is compiled (nothing is allocated) and measured by `measure_step`; the results are
cached (`jaxpar.plan.compiled_cache`). With `plan --search --target`, the devices are a GPU target's
and every layout is compiled by XLA:GPU (jaxpar.plan.gpu_plan), here, without a GPU. A layout whose
parameters and optimizer state alone exceed the budget is dropped before compiling.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import time
import typing

from jaxpar.config import Config, ConfigError, ParallelConfig, TrainConfig, precision
from jaxpar.errors import UserError
from jaxpar.features import MESH_KEYS
from jaxpar.features.validation import validate
from jaxpar.parallel.schedules import SCHEDULES, chunks_per_stage
from jaxpar.plan import compiled_cache
from jaxpar.plan.roofline import Prediction, hosts_of, predict_layout
from jaxpar.runtime.hardware import Hardware

# the keys the search enumerates (jaxpar.features), and their valid values where the config declares them
ZERO_STAGES = typing.get_args(typing.get_type_hints(ParallelConfig)["zero"])
REMATS = typing.get_args(typing.get_type_hints(TrainConfig)["remat"])  # in order of their cost: none first
CONTEXT_MODES = typing.get_args(typing.get_type_hints(ParallelConfig)["context_attention"])
GRAD_ACCUMS = (1, 2, 4, 8)
MICROBATCHES_PER_STAGE = (1, 2, 4)
INTERLEAVED_VIRTUAL = 2


@dataclasses.dataclass
class Candidate:
    """One layout: its overrides, name, and once compiled its bytes per device and prediction."""

    overrides: dict
    name: str
    bytes_per_device: int | None = None
    prediction: Prediction | None = None
    state_only: bool = False  # bytes_per_device is the state's alone: over budget before compiling
    cached: bool = False

    def fits(self, budget: float) -> bool:
        return self.bytes_per_device is not None and not self.state_only and self.bytes_per_device <= budget


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _contexts(cfg: Config, n: int) -> list[int]:
    """The context sizes worth trying: those that leave each balanced chunk (L / 2C) at least one key
    block of the attention (model.flash_block_kv); below that, a device attends in smaller blocks."""
    m = cfg.model
    return [c for c in _divisors(n) if c == 1 or m.seq_len // (2 * c) >= m.flash_blocks()[1]]


def _meshes(cfg: Config, n: int, fixed: dict) -> list[dict]:
    moe = cfg.model.moe.experts > 0
    out = []
    for tensor, expert, stage, context in itertools.product(_divisors(n), _divisors(n) if moe else [1], _divisors(n),
                                                            _contexts(cfg, n)):
        if n % (context * tensor * expert * stage):
            continue
        mesh = {"mesh.data": n // (context * tensor * expert * stage), "mesh.tensor": tensor, "mesh.expert": expert,
                "mesh.stage": stage, **({"mesh.context": context} if context > 1 else {})}
        if all(mesh.get(k, 1) == v for k, v in fixed.items() if k in MESH_KEYS):  # no key: size 1
            out.append(mesh)
    return out


def _context_modes(mesh: dict) -> list[dict]:
    if mesh.get("mesh.context", 1) == 1:
        return [{}]
    return [{"parallel.context_attention": mode} for mode in CONTEXT_MODES]


def _pipelines(mesh: dict) -> list[dict]:
    stages = mesh["mesh.stage"]
    if stages == 1:
        return [{}]
    out = []
    # not naive (one batch, no microbatches): it idles (S-1)/S of the time and holds more than GPipe does
    for schedule, per_stage in itertools.product([s for s in SCHEDULES if s != "naive"], MICROBATCHES_PER_STAGE):
        virtual = INTERLEAVED_VIRTUAL if schedule == "interleaved" else 1
        out.append({"parallel.pipeline.schedule": schedule, "parallel.pipeline.microbatches": stages * per_stage,
                    "parallel.pipeline.virtual": virtual, "train.grad_accum": 1})
    return out


def _layers_per_chunk(cfg: Config, overrides: dict) -> int:
    per_stage = chunks_per_stage(overrides.get("parallel.pipeline.schedule", ""),
                                 overrides.get("parallel.pipeline.virtual", 1))
    return cfg.model.n_layers // (overrides["mesh.stage"] * per_stage)


def _valid(cfg: Config, overrides: dict, n: int, processes: int) -> bool:
    try:
        validate(cfg.replace(**overrides), n, processes)
    except ConfigError:
        return False
    return True


def enumerate_layouts(cfg: Config, n: int, fixed: dict, processes: int = 1) -> list[list[dict]]:
    """Every valid layout on n devices in `processes` hosts as override dicts, in ladders: each
    ladder is one layout with its memory savers in the order of their predicted cost, first
    train.grad_accum 1, 2, 4, 8 (the same FLOPs and reductions, smaller activations; one step
    with stages, whose microbatches are enumerated instead), then the same with train.remat
    dots, full and sqrt (each recomputing more). A rung is compiled only when the one before it
    does not fit: every later rung is predicted no faster."""
    ladders = []
    for mesh in _meshes(cfg, n, fixed):
        shards_state = mesh["mesh.data"] * mesh["mesh.expert"] * mesh.get("mesh.context", 1) > 1  # ZeRO's axes
        # without a data axis every ZeRO stage computes stage 0's program: one is enough (a held one, as held)
        zeros = ZERO_STAGES if shards_state else [fixed.get("parallel.zero", ZERO_STAGES[0])]
        for pipeline, mode, zero in itertools.product(_pipelines(mesh), _context_modes(mesh), zeros):
            base = {**mesh, **pipeline, **mode, "parallel.zero": zero}
            accums = [1] if mesh["mesh.stage"] > 1 else GRAD_ACCUMS
            rungs = [{**base, "train.remat": remat, "train.grad_accum": accum}
                     for remat, accum in itertools.product(REMATS, accums)]
            ladder = [r for r in rungs if all(r.get(k, v) == v for k, v in fixed.items())
                      and not (r["train.remat"] == "sqrt" and _layers_per_chunk(cfg, r) < 4)
                      and _valid(cfg, r, n, processes)]
            if ladder:
                ladders.append(ladder)
    return ladders


_WORKER_DEVICES: list = []


def _start_worker(cfg: Config, target: tuple[str, int, int] | None) -> None:
    """A worker's devices: the CPU devices of `cfg` (emulated), or a GPU target's (name, count, hosts) to
    compile for (jaxpar.plan.gpu_target), jax kept on the CPU."""
    if target is None:
        from jaxpar.runtime.devices import setup_devices

        _WORKER_DEVICES.extend(setup_devices(cfg))
    else:
        from jaxpar.plan import gpu_target

        gpu_target.use_cpu_only()
        _WORKER_DEVICES.extend(gpu_target.gpu_devices(*target))


def _measure_in_worker(layout: Config, budget: float) -> tuple[dict, bool]:
    return compiled_cache.measure(layout, _WORKER_DEVICES, budget)


class _Pool:
    """Runs `measure` in this process, or in spawned worker processes that set up the same devices (a GPU
    target's, see `_start_worker`)."""

    def __init__(self, cfg: Config, devices: list, processes: int, target: tuple[str, int, int] | None = None):
        self.devices, self.executor, self.queue = devices, None, []
        self.width = max(processes, 1)
        if processes > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self.executor = ProcessPoolExecutor(processes, multiprocessing.get_context("spawn"),
                                                initializer=_start_worker, initargs=(cfg, target))

    @property
    def busy(self) -> int:
        return len(self.queue)

    def submit(self, layout: Config, budget: float, key) -> None:
        if self.executor is not None:
            self.queue.append((self.executor.submit(_measure_in_worker, layout, budget), key))
        else:
            self.queue.append(((layout, budget), key))

    def next_result(self):
        """(key, measure's result) of a submitted layout, as soon as one is done."""
        if self.executor is None:
            (layout, budget), key = self.queue.pop(0)
            return key, compiled_cache.measure(layout, self.devices, budget)
        from concurrent.futures import FIRST_COMPLETED, wait

        finished, _ = wait([future for future, _ in self.queue], return_when=FIRST_COMPLETED)
        item = next(item for item in self.queue if item[0] in finished)
        self.queue.remove(item)
        return item[1], item[0].result()

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(cancel_futures=True)


def _name(layout: Config, devices: list) -> str:
    from jaxpar.session import on_devices

    return on_devices(layout, devices).layout_name()


@dataclasses.dataclass
class SearchResult:
    """The ranked search: candidates (every layout considered), the fitting ones first by
    predicted time, and what the search cost."""

    candidates: list[Candidate]  # the layouts evaluated
    enumerated: int  # every valid layout, larger grad_accum steps that were not needed included
    compiled: int
    cached: int
    pruned: int  # ladders left unevaluated (or unfinished): they cannot enter the top rows
    seconds: float
    hardware: Hardware
    budget: float

    @property
    def ranked(self) -> list[Candidate]:
        fit = [c for c in self.candidates if c.fits(self.budget)]
        return sorted(fit, key=lambda c: (c.prediction.seconds, c.bytes_per_device))


def floor_seconds(floor_flops: float, ladder: list[dict], n: int, peak: float) -> float:
    """A step time no rung of `ladder` can beat: the matmul FLOPs every layout runs
    (model_flops.matmul_flops_floor), shared by n devices at `peak`, through the schedule's bubble."""
    from jaxpar.parallel.schedules import build

    first = ladder[0]
    idle = 0.0
    if first["mesh.stage"] > 1:
        idle = build(first["parallel.pipeline.schedule"], first["mesh.stage"], first["parallel.pipeline.microbatches"],
                     first["parallel.pipeline.virtual"]).idle_fraction
    return floor_flops / n / peak / (1 - idle)


def search(cfg: Config, devices: list, hardware: Hardware, budget: float, fixed: dict, progress: bool = True,
           processes: int = 1, top: int | None = None, target: tuple[str, int, int] | None = None) -> SearchResult:
    """Enumerate, compile (in `processes` processes) and predict every layout of `cfg` on
    `devices`; see the module docstring. With `top`, a ladder is dropped unevaluated once it
    cannot enter the `top` fastest fitting layouts (its floor, or its first rung's predicted
    time, is no less than the top-th best found): the top rows are exact, the rest is partial.
    `target`: the devices are a GPU target's (name, count, hosts; jaxpar.plan.gpu_target), which
    the workers make again."""
    from tqdm import tqdm

    start = time.perf_counter()
    n = len(devices)
    hosts = hosts_of(hardware, n)
    ladders = enumerate_layouts(cfg, n, fixed, hosts)
    if not ladders:
        validate(cfg, n, hosts)  # the base config's own mistake, when it has one, says more
        raise UserError(f"no layout of this model passes validation on {n} devices with "
                        f"{' '.join(f'{k}={v}' for k, v in fixed.items()) or 'these settings'}.")
    from jaxpar.train.model_flops import matmul_flops_floor

    floor_flops, peak = matmul_flops_floor(cfg), hardware.peak_flops[precision.of(cfg).compute]
    floors = [floor_seconds(floor_flops, ladder, n, peak) for ladder in ladders]
    pool = _Pool(cfg, devices, processes, target)
    bar = tqdm(total=sum(len(ladder) for ladder in ladders), desc="plan --search", unit="layout",
               disable=not progress, file=sys.stderr)
    run = _Ladders(cfg, ladders, floors, pool, bar, budget, top)
    try:
        run.fill()
        while pool.busy:
            run.settle(*pool.next_result(), devices, hardware)
            run.fill()
    finally:
        bar.close()
        pool.close()
    candidates = [run.done[key] for key in sorted(run.done)]
    compiled = sum(not c.cached for c in candidates)
    return SearchResult(candidates, bar.total, compiled, len(candidates) - compiled, run.pruned,
                        time.perf_counter() - start, hardware, budget)


class _Ladders:
    """The search's progress through its ladders: which to compile next (likely-fast layouts first, so
    the bound tightens early), which rung follows a result, and what is pruned."""

    def __init__(self, cfg: Config, ladders: list, floors: list, pool, bar, budget: float, top: int | None):
        self.cfg, self.ladders, self.floors, self.pool, self.bar = cfg, ladders, floors, pool, bar
        self.budget, self.top = budget, top
        self.order = sorted(range(len(ladders)), key=floors.__getitem__)
        self.done: dict[tuple[int, int], Candidate] = {}
        self.fit_times: list[float] = []
        self.pruned = 0

    def bound(self) -> float:
        """The top-th best predicted time of a fitting layout so far (inf until there are `top`)."""
        top = self.top
        return sorted(self.fit_times)[top - 1] if top is not None and len(self.fit_times) >= top else math.inf

    def fill(self) -> None:
        """Start ladders while the pool has room, pruning those whose floor cannot enter the top."""
        while self.order and self.pool.busy < self.pool.width:
            i = self.order.pop(0)
            if self.floors[i] >= self.bound():
                self.pruned += 1
                self.bar.update(len(self.ladders[i]))
            else:
                self.pool.submit(self.cfg.replace(**self.ladders[i][0]), self.budget, (i, 0))

    def settle(self, key: tuple[int, int], result: tuple[dict, bool], devices: list, hardware: Hardware) -> None:
        """Record one compiled rung; submit the ladder's next rung unless this one fits, cannot, or is
        out of the top (every later rung is predicted no faster)."""
        (i, rung), (entry, cached) = key, result
        candidate = _candidate(self.cfg, self.ladders[i][rung], devices, hardware, entry, cached)
        self.done[i, rung] = candidate
        self.bar.set_postfix_str(candidate.name[:48])
        left = len(self.ladders[i]) - rung - 1
        fits = candidate.fits(self.budget)
        if fits:
            self.fit_times.append(candidate.prediction.seconds)
        slower = candidate.prediction is not None and candidate.prediction.seconds >= self.bound()
        if fits or candidate.state_only or not left or slower:
            self.pruned += bool(left) and slower and not fits
            self.bar.update(left + 1)
        else:
            self.bar.update(1)
            self.pool.submit(self.cfg.replace(**self.ladders[i][rung + 1]), self.budget, (i, rung + 1))


def _candidate(cfg: Config, overrides: dict, devices: list, hardware: Hardware, entry: dict,
               cached: bool) -> Candidate:
    layout = cfg.replace(**overrides)
    candidate = Candidate(overrides, _name(layout, devices), entry["bytes_per_device"], None, entry["state_only"],
                          cached)
    if not candidate.state_only:
        candidate.prediction = predict_layout(entry["plan"], hardware, layout, _sizes(overrides),
                                              entry["idle_fraction"])
    return candidate


def _sizes(overrides: dict) -> dict[str, int]:
    return {k.removeprefix("mesh."): overrides.get(k, 1) for k in MESH_KEYS}
