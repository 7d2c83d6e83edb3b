"""Weight gradients accumulated straight into DDP's fp32 grad buffer, without apex.

megatron-core's linear layers can compute a weight gradient and add it into `weight.main_grad` in the
GEMM itself (`gradient_accumulation_fusion`), through apex's `fused_weight_gradient_mlp_cuda`. Without
apex (the lent GPUs, most pip installs) megatron computes a bf16 weight gradient, and DDP's hook then
adds it into the fp32 buffer: one more write and read of every gradient, an add kernel per parameter
and a bf16 rounding of each micro batch's gradient before it is summed.

`enable(chunks)` gives megatron's layers the same two entry points as apex's extension
(`trinity.compat.grad_fusion`, on torch's cuBLAS GEMM with an fp32 output), and turns the fusion on
for the linear layers of DDP-wrapped CUDA chunks. It leaves alone: TransformerEngine's layers
(they fuse by themselves), CPU chunks (no fp32-output GEMM there), and an output layer that shares its
weight with the embedding (megatron marks the whole parameter as already added, which would drop the
embedding's own gradient of the same weight).
"""

from __future__ import annotations

from typing import Any

from trinity.compat.grad_fusion import install as install_wgrad_gemm


def fusable_layers(model: Any) -> list[Any]:
    """megatron's own Column/RowParallelLinear layers of `model` whose weight DDP gave a main_grad,
    less an output layer tied to the embedding."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    tied = getattr(model, "share_embeddings_and_output_weights", False)
    tied_output = getattr(model, "output_layer", None) if tied else None
    found = []
    for module in model.modules():
        if type(module) not in (ColumnParallelLinear, RowParallelLinear) or module is tied_output:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and weight.is_cuda and hasattr(weight, "main_grad"):
            found.append(module)
    return found


def enable(chunks: list[Any]) -> int:
    """Turn on gradient accumulation fusion for the fusable layers of DDP-wrapped `chunks`; returns
    how many layers now accumulate into main_grad."""
    from trinity.models.build import unwrap

    layers = [layer for chunk in chunks for layer in fusable_layers(unwrap(chunk))]
    if layers:
        install_wgrad_gemm()
    for layer in layers:
        layer.gradient_accumulation_fusion = True
    return len(layers)


__all__ = ["enable", "fusable_layers"]
