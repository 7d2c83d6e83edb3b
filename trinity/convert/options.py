"""A conversion's options as the code uses them: its dtype and the megatron block of its layout."""

from __future__ import annotations

from typing import Any

from trinity.errors import UserError

DTYPES = ("bf16", "fp16", "fp32")


def torch_dtype(name: str) -> Any:
    import torch

    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if name not in table:
        raise UserError(f"--dtype: {name!r} is not one of {', '.join(DTYPES)}")
    return table[name]


def megatron_config(*, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1) -> Any:
    """The job-config megatron block for a conversion layout (other fields at their defaults).

    Parameters are not randomly initialised: every one is overwritten by the loader (which checks
    that), and megatron-core's CPU init materialises full master weights, which would set the peak.
    """
    from trinity.config.megatron import MegatronConfig

    return MegatronConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        # megatron-core refuses TP>1 with EP>1 without it; it changes activations only, never weights.
        sequence_parallel=tp > 1 and ep > 1,
        override_transformer_config={"perform_initialization": False},
    )


# How the conversion CLI spells the layout fields (trinity.distributed.layout.layout_problems names them).
