"""The precision policy: every dtype decision of a run, resolved once from `train.precision`,
`parallel.grad_reduce_dtype` and `train.loss_scaling`. Nothing else in jaxpar asks which precision a run is in; it asks
the policy what to do.

A policy names the dtype of each role, after Levanter's jmp-style policies:
- compute: the forward and backward matmuls (the weights are cast to it at the step's start);
- param and optimizer: the master weights and the optimizer's moments, always fp32;
- output: the logits and the loss, always fp32 (the softmax needs the range; attention scores too);
- output_grad: the gradient of those fp32 matmul results (logits, attention scores) as it re-enters
  their matmuls' backward: the compute dtype (jaxpar.model.matmul), so that those matmuls run like
  every other one of the step instead of in fp32; the softmax and loss around them stay fp32;
- grad_reduce: the payload of the data-parallel gradient reductions (summed into fp32 either way);
- gemm: how the blocks' weight matmuls run (jaxpar.model.fp8): `compute` (in the compute dtype), or `fp8`
  (e4m3 weights and activations, e5m2 gradients, each tensor with its own power-of-two scale).
With it come the loss scaling fp16 needs (its smallest normal value is 6e-5, so small gradients
would underflow: the loss is scaled up before differentiation and the gradients down after, and
a non-finite gradient halves the scale and skips the step; train.loss_scaling=dynamic asks for it in
bf16 too), verify's tolerances, and the precision verify's one-device reference runs in.

Pure Python, like jaxpar.config: validation reads a policy before jax starts. The dtypes
themselves come from jax.numpy when first asked for. A new precision is one entry in POLICIES
(fp8 is: bf16 with the blocks' GEMMs in fp8).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    from jaxpar.config.objectives import Objective

FP32, BF16, FP16 = "float32", "bfloat16", "float16"
FP32_TOLERANCES, HALF_TOLERANCES = (1e-5, 1e-4), (5e-3, 1e-2)  # verify's (loss, parameters) relative errors
# verify's tolerances for each tensor's first-step gradient and for the gradient norm at every step (relative
# to the reference's), and for each tensor's update over the run (relative to the reference's update, not to
# the tensor: jaxpar.verify.checks). Measured on clean 5-step runs of the small model (d_model 64, XLA
# level 0, an Intel Xeon with avx512_bf16, 2026-12-07) over 22 layouts: data, tensor, ZeRO 1-3, accumulation,
# remat, Adafactor, Muon, LoRA, bf16 reductions, top-k, Switch, Expert Choice and dropless experts under expert
# parallelism, GPipe, 1F1B, ZB-H1, interleaved, 2BW, context ring and all-gather, sequence, packed rows:
# - fp32: gradients up to 5.0e-7 of their tensor at the first step and 7.0e-6 at the fifth, the norm 5.5e-7
#   (7e-5 after 300 steps, where the two trajectories have parted by rounding), updates 3.1e-5 (elements with
#   tiny gradients, which Adam moves a whole step, carry most of it). A gradient that is a sum of cancelling
#   terms is rounded further from itself: the keys' LoRA A at step 2, while every element of B is +-lr, 1.8e-4
#   (tests/test_verify_sweep.py, draw 3), and its update by 2.2e-3 (Adam divides each element's error by its
#   small gradient). 1e-3 and 5e-3: a frozen tensor errs by 1, a scale s by |s - 1|, and Adam's near-ties of
#   the small model moved the wrong way (tests/fault_catalog.py) by 3.7e-3 and 1.7e-2.
# - bf16 and fp16 against fp32: gradients up to 1.1e-2, the norm 3.1e-3, updates 2.6e-2 (fp32 with bf16
#   reductions: 2.1e-3, 2.6e-4, 4.2e-3); 5e-2 for the first step's gradients (updates and later steps: below).
# - fp8 against its fp8 reference: gradients up to 5.3e-2, the norm 4.7e-3, updates 0.14 (Adam's first steps
#   are about lr sign(g), and fp8's rounding turns the sign of a few percent of the small gradients); LoRA's
#   adapters 0.10 and 0.21 (B starts at zero: its update is all of it); SimPO on data=8 0.125 and 0.175, whose
#   gradient is the difference of the chosen and the rejected responses' (the same rounding, three times the
#   share of a smaller difference). 0.3 and 0.4 still fail a tensor that does not move (1.0), one whose
#   gradient is halved (0.5), or one that moves half as far (0.5).
# A tensor whose gradient (update) is a smaller share of the whole step's than the floor is judged against the
# floor instead of its own size (jaxpar.verify.checks): fp32 rounds every sum to about 1e-7 of it; bf16,
# fp16 and fp8 (and fp32 gradients reduced in bf16) to 2^-8 and more, so a LoRA A whose B is one step from zero,
# its gradient 1e-4 of the step's, differed by 0.1 of itself in bf16 (4e-3 of bf16's step of the whole).
FP32_FLOOR, REDUCED_FLOOR = 1e-6, 1e-3
# The switch-space sweep (benchmarks/verify_sweep.py --results, draws 0-52 at 691b8ae: d_model 64, 4 layers, 3 steps,
# LoRA, every objective, Muon, MoE, MLA, MTP, windows, sinks) reached further than those 22 layouts, and the later
# steps' gradients, at weights the updates' rounding has parted, further than the first's:
# - bf16 (and fp32 with bf16 reductions): first-step gradients 0.034, later ones 0.053 (LoRA's B, draw 19; GRPO on
#   tests/fault_catalog.py's layout over 5 steps 0.061, whose gradients cancel), the norm 4.7e-3 (GRPO 6.3e-3),
#   updates 0.078 under AdamW and 0.10 under Muon (draw 25; 0.127 on draw 84 at 8328d71: Newton-Schulz brings
#   every singular value of the update to about one, those of a gradient's rounding too). Later gradients 0.1,
#   the norm 0.01, updates 0.2: a tensor that does not move (1.0), or moves half as far (0.5), still fails. (At a
#   norm of 0.02 the catalog's "DPO pairs weighed per shard" passed in bf16: norm 0.0138, later gradients 0.096.)
# - fp8: first-step gradients 0.197, later 0.324 (a router, draw 36; GRPO 0.317), the norm 0.022 (GRPO 0.038),
#   updates 0.32 (GRPO 0.34). Later gradients 0.45, the norm 0.06; with bf16 reductions 0.25 and 0.021 (below).
FP32_GRAD, FP32_UPDATE = 1e-3, 5e-3
HALF_GRAD, HALF_UPDATE = 5e-2, 0.2
HALF_LATER_GRAD, HALF_NORM = 0.1, 0.01
FP8_GRAD, FP8_UPDATE = 0.3, 0.4
FP8_LATER_GRAD, FP8_NORM = 0.45, 0.06
HALF = {"tolerances": HALF_TOLERANCES, "grad_tolerance": HALF_GRAD, "later_grad_tolerance": HALF_LATER_GRAD,
        "norm_tolerance": HALF_NORM, "update_tolerance": HALF_UPDATE,
        "error_floor": REDUCED_FLOOR}  # verify's judgement of a run whose gradients are rounded as bf16's
# verify's widest routing flip that is a tie: the relative gap between two router scores that the
# policy's rounding can close (jaxpar.verify.routing). fp32: a few ulps (2^-23 each) of a score whose
# inputs two layouts sum in different orders (measured: up to 6e-7). Gradients reduced in bf16 move the
# weights by about 1e-3, and the scores with them (measured: up to 6e-5 on top-k; with LoRA, whose adapters move
# the scores too, 1.8e-3 on the sweep's draw 14 and 7.8e-3 on draw 13, a hair under 2^-7: 2^-6). bf16 or fp16
# activations round every layer's input,
# and the router's logits move by about 1e-2: sixteen of bf16's steps (measured: up to 2.1e-2, Expert Choice
# through 1F1B).
# The sweep's wider model (draws 0-52 at 691b8ae, 3 steps) reached further: fp32 with bf16 reductions 0.027 (GRPO with
# LoRA, draw 46, whose near-ties Adam moves either way: 2^-4), bf16 0.089 (draw 19; 0.100 on draw 57 at 8328d71: 2^-3).
FP32_TIE_TOLERANCE, REDUCED_GRAD_TIE_TOLERANCE, HALF_TIE_TOLERANCE = 2.0 ** -19, 2.0 ** -4, 2.0 ** -3
# fp8 against its one-device fp8 reference, which quantizes the same GEMMs. A value whose bf16 input differs
# from the reference's by an ulp (sums in another order) can round to the other e4m3 neighbour (2^-3 apart, 32
# bf16 ulps): about 1 in 32 such values moves by a whole e4m3 step, so a GEMM's output differs by some sqrt(1/32)
# e4m3 steps, about 5x bf16's own difference, and Adam turns small gradients' differences into whole updates.
# Measured on 3 steps of the small model over 21 layouts (data, tensor, sequence, context, ZeRO 1-3,
# accumulation, remat, 1F1B, ZB-H1, 2BW, local SGD, LoRA, MLA; top-k, Switch, Expert Choice and dropless experts
# under expert parallelism): loss up to 2.4e-4, weights up to 9.2e-3 (dropless over data=2 x tensor=2 x
# expert=2). The same layout against bf16 GEMMs on one device: 1.5e-2 after 3 steps, 3.3e-2 after 10, where
# against its fp8 reference it stays at 1.2e-2. Since the first step learns, 5 steps reach 2.3e-2 on the weights
# where the updates agree to 0.14: fp8's weights are reported, and its updates judged (above).
# The loss stays at 5e-4 but for DPO and SimPO (a margin's objectives: FP8_MARGIN_LOSS, below).
FP8_TOLERANCES = (5e-4, 1.5e-2)
# fp8 against its fp8 reference differs by about half of what fp8 itself does to the gradients (the rounding flips
# above), so a layout whose GEMMs lost fp8, or quantize by other scales, differs from the reference by no more than a
# tensor's tolerance allows. verify therefore gauges fp8's own rounding at every step: the reference's gradient with
# its GEMMs in bf16 (`rounding_gauge`), at the reference's weights on the same batch, and judges the layout's distance
# from the fp8 reference as a share of the gauge's (the whole gradient, jaxpar.verify.checks.rounding_share).
# Measured on 3 steps of the small model (d_model 32, 2 layers; tests/fault_catalog.py) over 17 layouts (data x
# tensor, ZeRO 2-3, sequence, context, accumulation, bf16 reductions, GPipe, 1F1B, interleaved, ZB-H1, 2BW, top-k,
# capacity 1 and dropless experts): clean layouts 0.57-0.68 at the first step, where the weights are the same, and
# up to 0.97 later (0.98 over 10 steps: the share does not grow with the steps, the gauge's distance parts with the
# layout's). The fp8 GEMM lost on the layout side: 1.00 at the first step; scales max / amax unrounded: 1.23-1.33,
# then 1.32-1.68. Judged at 0.85 for the first step and 1.25 after. 2BW's microbatches on the new weights reach 1.53
# at the third of 3 steps, but only 1.18 over verify's 5 (1.26 at the tenth, where the loss fails too): a blind spot of
# the fp8 comparison (below).
FP8_ROUNDING_SHARE = (0.85, 1.25)
# DPO's and SimPO's loss is a function of the margin between a pair's summed (SimPO: averaged) log-probabilities,
# which starts at about 0 (the loss at log 2): fp8's rounding of those sums moves the loss by β times their
# rounding, not by a share of the loss. Measured clean in fp8: DPO on data=4 x tensor=2 ZeRO-3 (the catalog's
# layout) 6.6e-4 over 3 and 5 steps; the sweep's draw 12 (DPO with LoRA and dropless experts through GPipe) 9.4e-4
# at the first step, where the weights are the same, and 1.2e-3; SimPO on data=8 5.6e-4 (issue 63). 2.5e-3. The
# catalog's "DPO pairs weighed per shard" measured 8.9e-4 (3 steps) and 1.05e-3 (5): within what clean runs reach,
# a blind spot of the fp8 comparison (at 5e-4, where it used to fail, the clean layout failed as well).
FP8_MARGIN_LOSS = 2.5e-3
# Both blind spots above are bugs of the layout's own code (2BW's weight version, DPO's row weights), which runs the
# same in every precision, whose signal fp8's rounding is as large as. verify therefore also verifies an fp8 layout
# with train.precision=fp32 (`logic_precision`), at fp32's tolerances, where both fail (measured at 5 steps: 2BW's
# later gradients 0.155 against 1e-3; at 3, DPO's loss 2.3e-4 against 1e-5, its gradients 0.025); the fp8 comparison
# judges what runs in fp8 only: the GEMMs' hooks.
# router scores move with activations that went through fp8 GEMMs: several of e4m3's steps (2^-3 each; measured:
# up to 0.172, Switch through 1F1B; 0.07 on the first step, before any weight differs; 0.279 with dropless experts
# and the all-gather dispatch on data=2 x tensor=2 x expert=2, at the third step, the catalog's clean layout).
# With bf16 reductions too: 0.387 at the third step of the sweep's draw 69 (Switch with a shared expert, LoRA on an
# nf4 base, tensor=2 x context=4; 0.21 at the first step), whose fp32 pass verifies (routing margins 0): 2^-1.
FP8_TIE_TOLERANCE, FP8_BF16_REDUCED_TIE_TOLERANCE = 2.0 ** -1.5, 2.0 ** -1
# fp8 whose gradients are also reduced in bf16 rounds them twice; on the sweep's draws with LoRA and GRPO or
# ORPO (tests/test_verify_sweep.py, draws 0 and 1) the loss differed by up to 1.3e-3 (GRPO's, against its
# order 1), the gradients by 0.39 (a LoRA A at step 3) and the updates by 0.54: verify is weakest there, and
# judges it at 2.5e-3, 0.6 and 0.8, which catch a tensor that does not move but not one that moves half as far.
FP8_BF16_REDUCED = {"tolerances": (2.5e-3, FP8_TOLERANCES[1]), "grad_tolerance": 0.6, "later_grad_tolerance": 0.6,
                    "norm_tolerance": FP8_NORM, "update_tolerance": 0.8,
                    "tie_tolerance": FP8_BF16_REDUCED_TIE_TOLERANCE}
# the largest share of a run's routing decisions (a token in an MoE layer at a step) that may be ties: (routers
# that pick experts for a token, Expert Choice, whose experts rank a whole group's tokens and so meet far more
# near-ties). More is a bug whose margins are small (a balancing bias's sign, a capacity order), not rounding.
# Measured on the 5-step runs above (10240 decisions each): fp32 none but Expert Choice's 0.74%; bf16 up to 1.7%
# (top-k, dropless), Expert Choice 5.0%; fp8 up to 8.0% (dropless), Expert Choice 15.3%. Caps: twice those; fp32's
# Expert Choice twice the 2.7% of 8 experts on data=2 x expert=4 (tests/test_moe.py).
FP32_MAX_TIE_SHARE, REDUCED_GRAD_MAX_TIE_SHARE = (0.01, 0.06), (0.02, 0.06)
HALF_MAX_TIE_SHARE, FP8_MAX_TIE_SHARE = (0.05, 0.12), (0.16, 0.3)
INITIAL_FP16_SCALE = 2.0 ** 15
DTYPE_OF = {"fp32": FP32, "bf16": BF16, "fp16": FP16}  # the config's spellings


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """What one run computes, keeps and sends in, by role (dtype names, as jax.numpy spells them)."""

    name: str  # train.precision, as the config and layout names spell it
    compute: str
    grad_reduce: str = FP32
    param: str = FP32
    optimizer: str = FP32
    output: str = FP32
    output_grad: str = FP32
    loss_scaling: bool = False  # dynamic loss scaling; such a policy skips every non-finite step
    initial_loss_scale: float = 1.0
    loss_scale_window: int = 2000  # good steps in a row before the scale doubles
    tolerances: tuple[float, float] = FP32_TOLERANCES
    grad_tolerance: float = FP32_GRAD  # each tensor's gradient at the first step, where the weights are the same
    later_grad_tolerance: float = FP32_GRAD  # each tensor's gradient after it, where the weights have parted
    norm_tolerance: float = FP32_GRAD  # the gradient norm at every step
    update_tolerance: float = FP32_UPDATE
    error_floor: float = FP32_FLOOR
    tie_tolerance: float = FP32_TIE_TOLERANCE
    max_routing_tie_share: tuple[float, float] = FP32_MAX_TIE_SHARE
    gemm: str = "compute"  # jaxpar.model.fp8.GEMMS: `compute`, or `fp8`
    reference: str = "fp32"  # the train.precision of verify's one-device reference
    # the train.precision whose one-device gradient, at the reference's weights, gauges this policy's own rounding
    # (fp8: bf16's GEMMs), and the largest share of it the layout's distance from the reference may reach at the
    # first step and after (FP8_ROUNDING_SHARE); None: not gauged
    rounding_gauge: str | None = None
    rounding_share: tuple[float, float] = (float("inf"), float("inf"))
    margin_loss_tolerance: float | None = None  # a margin's objective's loss tolerance (Objective.margin), if other
    # the train.precision in which verify also verifies the layout (fp8: fp32, where a bug of the layout's code cannot
    # hide under the policy's rounding); None: the policy's own comparison only
    logic_precision: str | None = None

    def loss_tolerance(self, objective: Objective) -> float:
        """verify's loss tolerance for a run of `objective` (jaxpar.config.objectives)."""
        if objective.margin and self.margin_loss_tolerance is not None:
            return self.margin_loss_tolerance
        return self.tolerances[0]

    @property
    def scales_gradients_per_tensor(self) -> bool:
        """Whether the GEMMs quantize every gradient into their own format by its own scale (fp8's e5m2):
        a loss scale has no underflow left to rescue."""
        return self.gemm != "compute"

    @property
    def gradients_rounded(self) -> bool:
        """Whether the gradients are rounded below fp32: by reduced matmuls, or by a bf16 reduction."""
        return self.reduced or self.grad_reduce != FP32

    @property
    def reduced(self) -> bool:
        """Whether the matmuls run below fp32 (bf16, fp16, and fp8's bf16 around its fp8 GEMMs)."""
        return self.compute != FP32

    def dtype(self, role: str):
        """The jax.numpy dtype of a role: 'compute', 'param', 'optimizer', 'output', 'output_grad' or
        'grad_reduce'."""
        import jax.numpy as jnp

        return jnp.dtype(getattr(self, role))

    @property
    def compute_dtype(self):
        return self.dtype("compute")

    @property
    def grad_reduce_dtype(self):
        return self.dtype("grad_reduce")

    def cast_to_compute(self, tree):
        """Floating leaves in the compute dtype (gradients flow back to fp32 through the cast); in fp32,
        the tree itself."""
        return _cast(tree, self.compute) if self.reduced else tree

    def cast_to_param(self, tree):
        """Floating leaves in the master weights' dtype."""
        return _cast(tree, self.param)

    def cast_to_output(self, x):
        """An array in the output dtype (logits, the loss)."""
        return _cast(x, self.output)

    def carries_loss_scale_from(self, saved_name: str) -> bool:
        """Whether a checkpoint's loss-scale state, saved under train.precision=`saved_name`, still
        applies: only under the same policy (a new one starts its scale afresh)."""
        return saved_name == self.name


def _cast(tree, dtype: str):
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


POLICIES = {
    "fp32": PrecisionPolicy("fp32", FP32),
    "bf16": PrecisionPolicy("bf16", BF16, output_grad=BF16, **HALF, tie_tolerance=HALF_TIE_TOLERANCE,
                            max_routing_tie_share=HALF_MAX_TIE_SHARE),
    "fp16": PrecisionPolicy("fp16", FP16, output_grad=FP16, loss_scaling=True, initial_loss_scale=INITIAL_FP16_SCALE,
                            **HALF, tie_tolerance=HALF_TIE_TOLERANCE, max_routing_tie_share=HALF_MAX_TIE_SHARE),
    # bf16 with the blocks' GEMMs in fp8; verify's reference quantizes the same GEMMs on one device
    "fp8": PrecisionPolicy("fp8", BF16, output_grad=BF16, gemm="fp8", reference="fp8", tolerances=FP8_TOLERANCES,
                           grad_tolerance=FP8_GRAD, later_grad_tolerance=FP8_LATER_GRAD, norm_tolerance=FP8_NORM,
                           update_tolerance=FP8_UPDATE, error_floor=REDUCED_FLOOR,
                           tie_tolerance=FP8_TIE_TOLERANCE, max_routing_tie_share=FP8_MAX_TIE_SHARE,
                           rounding_gauge="bf16", rounding_share=FP8_ROUNDING_SHARE,
                           margin_loss_tolerance=FP8_MARGIN_LOSS, logic_precision="fp32"),
}


def policy(precision: str, grad_reduce: str = "fp32", loss_scale_window: int = 2000,
           loss_scaling: str = "auto") -> PrecisionPolicy:
    """The policy of train.precision=`precision` with parallel.grad_reduce_dtype=`grad_reduce`: a bf16
    reduction makes an fp32 run's gradients bf16-rounded, so verify judges it at bf16's tolerances.
    loss_scaling (train.loss_scaling): `auto`, the policy's own (dynamic for fp16 only); `dynamic`, dynamic
    loss scaling whatever the policy (jaxpar.features.precision allows it for bf16 and fp16)."""
    base = POLICIES[precision]
    if loss_scaling == "dynamic" and not base.loss_scaling:
        base = dataclasses.replace(base, loss_scaling=True, initial_loss_scale=INITIAL_FP16_SCALE)
    reduce = DTYPE_OF[grad_reduce]
    if reduce == FP32 or (base.reduced and base.gemm == "compute"):
        return dataclasses.replace(base, grad_reduce=reduce, loss_scale_window=loss_scale_window)
    if base.reduced:  # fp8
        return dataclasses.replace(base, grad_reduce=reduce, **FP8_BF16_REDUCED, loss_scale_window=loss_scale_window)
    return dataclasses.replace(base, grad_reduce=reduce, **HALF, tie_tolerance=REDUCED_GRAD_TIE_TOLERANCE,
                               max_routing_tie_share=REDUCED_GRAD_MAX_TIE_SHARE, loss_scale_window=loss_scale_window)


def of(cfg) -> PrecisionPolicy:
    """The policy of a Config."""
    return policy(cfg.train.precision, cfg.parallel.grad_reduce_dtype, cfg.train.loss_scale_window,
                  cfg.train.loss_scaling)
