"""Mixture of experts through the pipeline: every router with expert parallelism inside the
stages of a 1F1B pipeline against the single-device reference, and the auxiliary losses
reaching the gradients there."""

import pytest

from jaxpar.train.verify import verify

# Two MoE layers (every=1) on data=2 x expert=2 x stage=2, four microbatches of 1F1B.
MOE_PIPELINE = ("model.d_model=64", "model.n_heads=4", "model.d_ff=128", "model.n_layers=2", "model.seq_len=32",
                "train.batch_size=16", "model.moe.experts=4", "model.moe.every=1", "mesh.data=2", "mesh.expert=2",
                "mesh.stage=2", "parallel.pipeline.schedule=1f1b", "parallel.pipeline.microbatches=4", "train.steps=2")


@pytest.mark.parametrize("router", ["topk", "switch", "expert_choice"])
def test_experts_inside_pipeline_stages_match_one_device(session_for, router):
    result = verify(session_for(*MOE_PIPELINE, f"model.moe.router={router}"), log=lambda line: None)
    assert result["ok"], result
    assert result["routing_changes"] == 0


@pytest.mark.parametrize("schedule", [("parallel.pipeline.schedule=gpipe",), ("parallel.pipeline.recompute=true",)])
def test_the_auxiliary_losses_reach_the_gradients_under_the_pipeline(session_for, schedule):
    """With heavy auxiliary and z-loss weights the router's gradients are mostly those losses'
    (the reference includes them): dropping them anywhere in the pipeline would move the
    router weights far from the reference's after two steps."""
    heavy = ("model.moe.aux_loss_weight=10", "model.moe.z_loss_weight=10", "model.moe.router=topk")
    result = verify(session_for(*MOE_PIPELINE, *heavy, *schedule), log=lambda line: None)
    assert result["ok"], result
