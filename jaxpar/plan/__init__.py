"""Planning: what the compiled program allocates and communicates."""

from jaxpar.plan.collectives import COLLECTIVE_OPS, Collective, bytes_by_op, collectives

__all__ = ["COLLECTIVE_OPS", "Collective", "bytes_by_op", "collectives"]
