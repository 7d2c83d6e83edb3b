"""megatron-core's `optimizer.step()` in two halves, so that the engine decides between them whether the update
is applied (`trinity.trainer.nonfinite`): `grad_norm` readies the gradients and measures their global norm,
`apply` clips by that norm and steps. megatron-core's own step applies an update whatever the norm (without
an fp16 loss scaler nothing checks it): a nan norm makes nan weights.

Both halves are the calls megatron-core 0.16.1's `MixedPrecisionOptimizer`, `FP32Optimizer` and
`ChainedOptimizer` `step()` make, in their order (prepare_grads; norm and clip; step_with_ready_grads). The
norm is computed even with `clip_grad: 0`, where megatron-core skips it: it is the check, and the step
metrics' `grad_norm` (nan before).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _chain(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


@torch.no_grad()
def grad_norm(optimizer: Any) -> float:
    """Ready the gradients (copied to the main params, unscaled) and return their global norm, the same
    on every rank (megatron-core reduces it over the ranks that hold parts of the model). inf when an fp16
    loss scaler found inf or nan gradients: megatron-core skips that update (and lowers the scale)."""
    if optimizer.prepare_grads():
        return math.inf
    return float(optimizer.get_grad_norm())


@torch.no_grad()
def apply(optimizer: Any, norm: float) -> None:
    """Clip the gradients by `norm` (as `clip_grad` asks) and step, as megatron-core's `step()` goes on."""
    from megatron.core.optimizer import clip_grads  # at call time: trinity's CPU shims patch the module

    for opt in _chain(optimizer):
        params = [] if getattr(opt, "is_stub_optimizer", False) else opt.get_parameters()
        if params and opt.config.clip_grad > 0.0:
            clip_grads.clip_grad_by_total_norm_fp32(
                params, opt.config.clip_grad, norm, opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            )
    optimizer.step_with_ready_grads()
