"""Planning: what the compiled program allocates and communicates."""

from jaxpar.plan.collectives import COLLECTIVE_OPS, Collective, bytes_by_op, collectives
from jaxpar.plan.memory import format_report, measure_step

__all__ = ["COLLECTIVE_OPS", "Collective", "bytes_by_op", "collectives", "format_report", "measure_step"]
