"""Pipeline parallelism over mesh.stage: the stacked layers split into stages, run by a schedule
(parallel.pipeline: naive, gpipe, 1f1b, 2bw, interleaved, zb-h1, zbv) over microbatches."""

from __future__ import annotations

from jaxpar.config import Config, precision
from jaxpar.config.objectives import objective_of
from jaxpar.config.parallel import ZeroStage
from jaxpar.features.feature import Checks, Switch, axis, never


def _label(value, cfg: Config, sizes: dict) -> str | None:
    pipe = cfg.parallel.pipeline
    if sizes["stage"] == 1:
        return None
    return f"{pipe.schedule} M={pipe.microbatches}" + (f" v={pipe.virtual}" if pipe.virtual > 1 else "")


SWITCHES = (
    Switch("mesh.stage", axis("stage"), reference=1, searched=True, with_local_sgd=False),
    Switch("parallel.pipeline.schedule", _label, searched=True),  # 2bw's stale-weight rule holds on one device
    Switch("parallel.pipeline.microbatches", never, searched=True),  # named with the schedule
    Switch("parallel.pipeline.virtual", never, searched=True),
)


def virtual_stages(cfg: Config) -> int:
    """The chunks of layers each stage runs: parallel.pipeline.virtual for interleaved, 2 for zbv."""
    p = cfg.parallel.pipeline
    return p.virtual if p.schedule == "interleaved" else 2 if p.schedule == "zbv" else 1


def checks(cfg: Config, sizes: dict[str, int]) -> Checks:
    p, S, L = cfg.parallel.pipeline, sizes["stage"], cfg.model.n_layers
    if p.microbatches <= 0 or p.virtual <= 0:
        yield "parallel.pipeline.microbatches and parallel.pipeline.virtual must be positive."
    if p.virtual > 1 and p.schedule != "interleaved":
        yield f"parallel.pipeline.virtual={p.virtual} needs parallel.pipeline.schedule=interleaved."
    if S == 1:
        return
    v = virtual_stages(cfg)
    if p.schedule == "zbv" and L % (2 * S):
        yield (f"the zbv schedule runs two chunks of layers on each stage: model.n_layers={L} is not "
               f"divisible by 2 x mesh.stage = {2 * S}.")
    if L % (S * v):
        yield f"model.n_layers={L} is not divisible by mesh.stage x virtual stages = {S} x {v}."
    m = cfg.model
    if m.moe.experts and m.moe.first_dense:
        yield ("model.moe.first_dense does not run in a pipeline yet (its dense first layers are a stack of their "
               "own, outside the stages' units); train it with mesh.stage=1.")
    if m.unit_blocks > 1 and m.units % (S * v):
        yield (f"the {m.units} units of {m.unit_blocks} layers (the period of model.moe.every and "
               f"model.attention_pattern) are not divisible by mesh.stage x virtual stages = {S} x {v}.")
    yield from _schedule_checks(cfg, sizes, v)


def _schedule_checks(cfg: Config, sizes: dict[str, int], v: int) -> Checks:
    p, S = cfg.parallel.pipeline, sizes["stage"]
    if p.schedule == "naive" and p.microbatches > 1:
        yield ("the naive schedule runs one batch through the stages, no microbatches: set "
               f"parallel.pipeline.microbatches=1 (got {p.microbatches}).")
    if p.schedule in ("zb-h1", "zbv") and p.recompute:
        yield (f"parallel.pipeline.recompute=true is for 1F1B-type schedules; {p.schedule} keeps the "
               "forward's residuals for its split backward (train.remat keeps fewer).")
    if p.schedule in ("1f1b", "2bw", "interleaved", "zb-h1", "zbv") and p.microbatches < S:
        yield (f"the {p.schedule} schedule needs at least as many microbatches as stages, "
               f"got parallel.pipeline.microbatches={p.microbatches} < mesh.stage={S}.")
    if p.schedule == "interleaved" and p.microbatches % S:
        yield (f"interleaved 1F1B needs parallel.pipeline.microbatches={p.microbatches} to be a "
               f"multiple of mesh.stage={S}.")
    if cfg.train.grad_accum > 1:
        yield "with mesh.stage > 1, use parallel.pipeline.microbatches instead of train.grad_accum."
    if p.schedule == "2bw":
        yield from _two_bw_checks(cfg)
    ways = sizes["data"] * sizes["expert"] * p.microbatches
    if cfg.train.batch_size % ways:
        yield (f"train.batch_size={cfg.train.batch_size} is not divisible by mesh.data x mesh.expert x "
               f"parallel.pipeline.microbatches = {sizes['data']} x {sizes['expert']} x {p.microbatches}.")
    if ZeroStage(cfg.parallel.zero).slices_replicated_weights and v > 1:
        yield (f"parallel.zero=2 with {'interleaved stages' if p.schedule == 'interleaved' else 'zbv'} "
               f"is not supported; use zero 1 or 3.")


def _two_bw_checks(cfg: Config) -> Checks:
    """What 2BW cannot carry from one step to the next: a step's microbatches start before the previous
    step's gradient is judged (loss scaling), a step runs two versions of the weights (ZeRO-2's layers
    look one up whole), and the weights trail the batches by a step (GRPO samples each batch from them)."""
    if precision.of(cfg).loss_scaling:
        yield (f"2bw starts each step's microbatches before the previous step's gradient is checked, so the dynamic "
               f"loss scale of train.precision={cfg.train.precision} (train.loss_scaling={cfg.train.loss_scaling}) "
               f"cannot follow it; use bf16 with train.loss_scaling=auto, or another schedule.")
    if ZeroStage(cfg.parallel.zero).slices_replicated_weights:
        yield ("parallel.zero=2 has each layer read the whole of one version of the weights, but a 2bw step runs "
               "two; use parallel.zero=1 or 3.")
    if objective_of(cfg).samples:
        yield ("train.objective=grpo samples each batch from the current weights, which under 2bw trail the "
               "batches by a step; use another schedule, such as 1f1b.")
