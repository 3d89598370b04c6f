"""What `jaxpar plan` measures of one layout, on the session's devices (XLA:CPU's emulated ones, or a GPU
target's: jaxpar.plan.gpu_plan): the compiled step's plan, and its step time predicted on a hardware
profile."""

from __future__ import annotations

from jaxpar.plan.calibrate import profile
from jaxpar.plan.decode_cache import decode_cache
from jaxpar.plan.memory import gpipe_beside_naive, measure_step
from jaxpar.plan.roofline import predict_layout
from jaxpar.session import on_devices
from jaxpar.train.trainer import Trainer


def plan_of(session) -> tuple[dict, Trainer]:
    """The compiled step's memory, FLOPs and collectives (with GPipe's temporaries beside a naive pipeline's,
    and the decoding cache), and the trainer that compiled it."""
    trainer = Trainer(session)
    plan = {**measure_step(trainer), **gpipe_beside_naive(trainer, lambda c: Trainer(on_devices(c, session.devices))),
            **decode_cache(trainer)}
    return plan, trainer


def predicted(plan: dict, trainer: Trainer, hardware: str, devices: list) -> dict:
    """The plan's step time predicted on the `hardware` profile (over that hardware's hosts, not this run's)."""
    table = trainer.pipeline.table
    session = trainer.session
    return predict_layout(plan, profile(hardware, devices), session.cfg, session.mesh_sizes,
                          table.idle_fraction if table is not None else 0.0).to_dict()
