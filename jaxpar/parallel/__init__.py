"""Parallel layouts applied around a finished model: the rules table, ZeRO, the frozen Layout
plan with its gradients, and the pipeline plan with its executors."""

from jaxpar.parallel.gradients import gradients
from jaxpar.parallel.hooks import eval_hooks
from jaxpar.parallel.layout import Layout, WeightPlan
from jaxpar.parallel.pipeline import StageFns
from jaxpar.parallel.pipeline_plan import PipelinePlan
from jaxpar.parallel.rules import RULES, data_parallel_axes, logical_to_spec
from jaxpar.parallel.zero import DATA_PARALLEL_AXES, zero_spec

__all__ = ["DATA_PARALLEL_AXES", "Layout", "eval_hooks", "PipelinePlan", "RULES", "StageFns", "WeightPlan",
           "data_parallel_axes", "gradients", "logical_to_spec", "zero_spec"]
