"""Parallel layouts applied around a finished model: the rules table, ZeRO, the Layout."""

from jaxpar.parallel.layout import Layout
from jaxpar.parallel.rules import RULES, logical_to_spec
from jaxpar.parallel.zero import DATA_PARALLEL_AXES, zero_spec

__all__ = ["DATA_PARALLEL_AXES", "Layout", "RULES", "logical_to_spec", "zero_spec"]
