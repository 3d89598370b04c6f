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

FP32, BF16, FP16 = "float32", "bfloat16", "float16"
FP32_TOLERANCES, HALF_TOLERANCES = (1e-5, 1e-4), (5e-3, 1e-2)  # verify's (loss, parameters) relative errors
# verify's relative error for a weight that starts at zero (routing noise weights, ...): all of it is its
# updates, where a weight that starts from its init is mostly init, so a bf16 update's error of a percent
# or two is its whole error (measured: up to 2.2e-2, top-k and dropless noise weights after 3 steps).
HALF_FROM_ZERO_TOLERANCE = 5e-2
# verify's widest routing flip that is a tie: the relative gap between two router scores that the
# policy's rounding can close (jaxpar.train.routing_check). fp32: a few ulps (2^-23 each) of a score whose
# inputs two layouts sum in different orders (measured: up to 6e-7). Gradients reduced in bf16 move the
# weights by about 1e-3, and the scores with them: a couple of bf16's steps (2^-8 each; measured: up to
# 6e-5). bf16 or fp16 activations round every layer's input, and the router's logits move by about 1e-2:
# sixteen of bf16's steps (measured: up to 2.1e-2, Expert Choice through 1F1B).
FP32_TIE_TOLERANCE, REDUCED_GRAD_TIE_TOLERANCE, HALF_TIE_TOLERANCE = 2.0 ** -19, 2.0 ** -7, 2.0 ** -4
# fp8 against its one-device fp8 reference, which quantizes the same GEMMs. A value whose bf16 input differs
# from the reference's by an ulp (sums in another order) can round to the other e4m3 neighbour (2^-3 apart, 32
# bf16 ulps): about 1 in 32 such values moves by a whole e4m3 step, so a GEMM's output differs by some sqrt(1/32)
# e4m3 steps, about 5x bf16's own difference, and Adam turns small gradients' differences into whole updates.
# Measured on 3 steps of the small model over 21 layouts (data, tensor, sequence, context, ZeRO 1-3,
# accumulation, remat, 1F1B, ZB-H1, 2BW, local SGD, LoRA, MLA; top-k, Switch, Expert Choice and dropless experts
# under expert parallelism): loss up to 2.4e-4, weights up to 9.2e-3 (dropless over data=2 x tensor=2 x
# expert=2). The same layout against bf16 GEMMs on one device: 1.5e-2 after 3 steps, 3.3e-2 after 10, where
# against its fp8 reference it stays at 1.2e-2.
FP8_TOLERANCES = (5e-4, 1.5e-2)
# weights that start at zero: Adam's first updates are about lr sign(g), so an element whose gradient the
# layout's rounding moves across zero steps the other way, and a tensor's error is that share of its elements.
# Measured: 0.12 (LoRA's B, data=4 x tensor=2; top-k's noise weights: 0.10), and 0.25 where the gradients are
# also reduced in bf16 (LoRA's B, tensor=4 x expert=2, ZeRO-2, grad_accum=2: tests/test_verify_sweep.py, draw 1).
FP8_FROM_ZERO_TOLERANCE = 0.5
# router scores move with activations that went through fp8 GEMMs: two of e4m3's steps (2^-3 each; measured:
# up to 0.172, Switch through 1F1B; 0.07 on the first step, before any weight differs)
FP8_TIE_TOLERANCE = 2.0 ** -2
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
    from_zero_tolerance: float = FP32_TOLERANCES[1]
    tie_tolerance: float = FP32_TIE_TOLERANCE
    gemm: str = "compute"  # jaxpar.model.fp8.GEMMS: `compute`, or `fp8`
    reference: str = "fp32"  # the train.precision of verify's one-device reference

    @property
    def scales_gradients_per_tensor(self) -> bool:
        """Whether the GEMMs quantize every gradient into their own format by its own scale (fp8's e5m2):
        a loss scale has no underflow left to rescue."""
        return self.gemm != "compute"

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
    "bf16": PrecisionPolicy("bf16", BF16, output_grad=BF16, tolerances=HALF_TOLERANCES,
                            from_zero_tolerance=HALF_FROM_ZERO_TOLERANCE, tie_tolerance=HALF_TIE_TOLERANCE),
    "fp16": PrecisionPolicy("fp16", FP16, output_grad=FP16, loss_scaling=True, initial_loss_scale=INITIAL_FP16_SCALE,
                            tolerances=HALF_TOLERANCES, from_zero_tolerance=HALF_FROM_ZERO_TOLERANCE,
                            tie_tolerance=HALF_TIE_TOLERANCE),
    # bf16 with the blocks' GEMMs in fp8; verify's reference quantizes the same GEMMs on one device
    "fp8": PrecisionPolicy("fp8", BF16, output_grad=BF16, gemm="fp8", reference="fp8", tolerances=FP8_TOLERANCES,
                           from_zero_tolerance=FP8_FROM_ZERO_TOLERANCE, tie_tolerance=FP8_TIE_TOLERANCE),
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
    if reduce == FP32 or base.reduced:
        return dataclasses.replace(base, grad_reduce=reduce, loss_scale_window=loss_scale_window)
    return dataclasses.replace(base, grad_reduce=reduce, tolerances=HALF_TOLERANCES,
                               from_zero_tolerance=HALF_FROM_ZERO_TOLERANCE, tie_tolerance=REDUCED_GRAD_TIE_TOLERANCE,
                               loss_scale_window=loss_scale_window)


def of(cfg) -> PrecisionPolicy:
    """The policy of a Config."""
    return policy(cfg.train.precision, cfg.parallel.grad_reduce_dtype, cfg.train.loss_scale_window,
                  cfg.train.loss_scaling)
