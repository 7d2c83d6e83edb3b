"""Silence the known, harmless third-party warnings that bury a job's useful lines.

A tiny CPU job printed 30 warning lines per process before its first step: megatron-core's fallbacks
for a missing Transformer Engine / apex, deprecations inside megatron-core and torch.distributed that
the user cannot act on. They are filtered by message (and category) only, so any other warning still
shows; `trinity run --debug` (TRINITY_DEBUG=1 in the workers) keeps every one of them.

`install()` must run before megatron-core is imported: most of these fire at import time.
"""

from __future__ import annotations

import warnings

# (category, regex matched against the start of the warning's message, where it comes from)
KNOWN: list[tuple[type[Warning], str, str]] = [
    # megatron-core at import without Transformer Engine / apex (every CPU job, GPUs without TE)
    (UserWarning, r"Transformer Engine and Apex are not installed", "megatron.core (optimizer, fsdp, clip_grads)"),
    (UserWarning, r"Apex is not installed", "megatron.core (models/backends, gpt_layer_specs)"),
    # TransformerConfig's own default cuda_graph_scope="full" warns about itself (megatron-core 0.16)
    (UserWarning, r"full scope is deprecated", "megatron.core.transformer.transformer_config"),
    # megatron-core's dist_checkpointing on torch's deprecated APIs
    (FutureWarning, r"`load_state_dict` is deprecated", "megatron.core.dist_checkpointing.strategies.torch"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor", "torch.distributed.checkpoint"),
    # megatron-core's DDP / distributed optimizer on deprecated torch.distributed collectives
    (FutureWarning, r"`torch\.distributed\.\w+` is deprecated", "torch.distributed.c10d_logger"),
    # megatron-core's grad buffer offload (param_and_grad_buffer) on tensor.storage()
    (UserWarning, r"TypedStorage is deprecated", "megatron.core.distributed.param_and_grad_buffer"),
    # megatron-core's zero_grad reads `.grad` of every param in its groups
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor", "megatron.core.optimizer.optimizer"),
]


def install(debug: bool) -> None:
    """Ignore the KNOWN warnings in this process, unless `debug`."""
    if debug:
        return
    for category, message, _ in KNOWN:
        warnings.filterwarnings("ignore", message=message, category=category)
