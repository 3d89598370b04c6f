"""Parallel layouts applied around a finished model: the logical-axis rules table."""

from jaxpar.parallel.rules import RULES, activation_resolver, batch_sharding, logical_to_spec, tree_shardings

__all__ = ["RULES", "activation_resolver", "batch_sharding", "logical_to_spec", "tree_shardings"]
