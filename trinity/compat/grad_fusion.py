"""apex's weight-gradient GEMM contract on torch's cuBLAS GEMM: with fused AdamW, a 1.5B step 0.2167 -> 0.1919 s (H200).

megatron-core's linear layers can compute a weight gradient and add it into `weight.main_grad` in the
GEMM itself (`gradient_accumulation_fusion`), through apex's `fused_weight_gradient_mlp_cuda`. Without
apex (the lent GPUs, most pip installs) megatron computes a bf16 weight gradient, and DDP's hook then
adds it into the fp32 buffer: one more write and read of every gradient, an add kernel per parameter
and a bf16 rounding of each micro batch's gradient before it is summed.

`install()` gives megatron's layers the same two entry points as apex's extension, on torch's cuBLAS
GEMM with an fp32 output (`torch.addmm(..., out_dtype=torch.float32)`, CUDA only); apex's extension
wins where it imports. Which layers turn the fusion on is the trainer's choice
(`trinity.trainer.engine.grad_fusion`). The gain above is the trainer's optimizer as a whole
(`trinity.compat.fused_optimizer` too) against megatron-core's stock fallbacks, docs/performance.md.
"""

from __future__ import annotations

import torch

from trinity.compat.checks import require, require_global


class TorchWgradGemm:
    """apex's `fused_weight_gradient_mlp_cuda` contract: main_grad += grad_output^T @ total_input."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        torch.addmm(main_grad, grad_output.t(), total_input, torch.float32, out=main_grad)

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        main_grad.addmm_(grad_output.t(), total_input)


def install() -> None:
    """`TorchWgradGemm` as megatron's `fused_weight_gradient_mlp_cuda` where apex's does not import (idempotent)."""
    from megatron.core.tensor_parallel import layers

    require("grad_fusion", layers, "_grad_accum_fusion_available", "LinearWithGradAccumulationAndAsyncCommunication")
    require_global("grad_fusion", layers.LinearWithGradAccumulationAndAsyncCommunication.backward,
                   "fused_weight_gradient_mlp_cuda", "wgrad_gemm_accum_fp32", "wgrad_gemm_accum_fp16")
    if not layers._grad_accum_fusion_available:  # apex's extension wins where it imports
        layers.fused_weight_gradient_mlp_cuda = TorchWgradGemm
        layers._grad_accum_fusion_available = True


__all__ = ["TorchWgradGemm", "install"]
