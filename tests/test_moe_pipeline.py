"""Mixture of experts through the pipeline: every router, with expert parallelism inside the
stages, against the single-device reference, under heavy auxiliary-loss weights so that
the auxiliary losses must reach the gradients."""

import pytest

from jaxpar.verify.run import verify

# Every layer a mixture (every=1), one or two per stage, four microbatches; each router on another
# mesh of expert x stage (with data, with tensor, and over four stages), so that these runs are also
# the plain verifies of those factorisations (tests/test_factorisations.py leaves them here).
MOE_PIPELINE = ("model.d_model=64", "model.n_heads=4", "model.d_ff=128", "model.seq_len=32", "train.batch_size=16",
                "model.moe.experts=4", "model.moe.every=1", "parallel.pipeline.microbatches=4", "train.steps=2")
MESHES = {
    "topk": ("mesh.data=2", "mesh.expert=2", "mesh.stage=2", "model.n_layers=2"),
    "switch": ("mesh.tensor=2", "mesh.expert=2", "mesh.stage=2", "model.n_layers=2"),
    "expert_choice": ("mesh.expert=2", "mesh.stage=4", "model.n_layers=4"),
}
# With these weights the router's gradients are mostly the auxiliary and z losses' (the reference
# includes them): a pipeline that dropped them anywhere would leave the router weights far from
# the reference's after two steps (checked: zeroing the aux term in the stage functions fails).
HEAVY_AUX = ("model.moe.aux_loss_weight=10", "model.moe.z_loss_weight=10")


@pytest.mark.slow
@pytest.mark.parametrize("router, schedule", [
    ("topk", ("parallel.pipeline.schedule=1f1b",)),  # with routing noise
    ("topk", ("parallel.pipeline.schedule=2bw",)),  # each step's noise keys carried with its microbatches in flight
    ("switch", ("parallel.pipeline.schedule=gpipe",)),
    ("expert_choice", ("parallel.pipeline.schedule=1f1b", "parallel.pipeline.recompute=true")),
])
def test_experts_inside_pipeline_stages_match_one_device_aux_losses_included(session_for, router, schedule):
    result = verify(session_for(*MOE_PIPELINE, *MESHES[router], *HEAVY_AUX, f"model.moe.router={router}", *schedule),
                    log=lambda line: None)
    assert result["ok"] and result["routing_changes"]["flips"] == 0, result
