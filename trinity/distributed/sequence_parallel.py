"""Sequence parallel (SP) around the RL roles: padding a batch's sequence length to a multiple of TP for
the training / log-prob / value forwards, and switching SP off on the same modules for the rollout.

With SP, megatron-core splits the sequence dimension of the activations between layers over the TP
ranks (embedding reduce-scatter, norms and dropout on a shard, all-gather before each
ColumnParallelLinear, reduce-scatter after each RowParallelLinear), so a forward's sequence length
must be a multiple of TP. Decoding feeds one token per step, which cannot be split over TP ranks:
the rollout runs the same modules with SP off (`sequence_parallel_disabled`), which computes the
same function (only where the TP reductions happen changes), as megatron's own static-batch inference
does for TP x EP (`megatron.core.transformer.utils.set_model_to_sequence_parallel`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

# The module attributes megatron-core 0.16.1 reads at forward time to decide whether a module works on a
# sequence shard (the set its own `set_model_to_sequence_parallel` flips):
# - `sequence_parallel`: ColumnParallelLinear / RowParallelLinear (incl. the output layer), the MTP
#   block, trinity's critic ValueHead;
# - `reduce_scatter_embeddings`: VocabParallelEmbedding and LanguageModelEmbedding (reduce-scatter the
#   embedding output instead of all-reducing it);
# - `scatter_to_sequence_parallel`: LanguageModelEmbedding (scatter the embedding output);
# and `config.sequence_parallel` of every TransformerConfig the modules hold (the transformer block's
# RNG fork, the embedding's scatter, GPTModel's padding mask, MoE / shared experts; some modules hold a
# deep copy of the model's config, so every distinct config object is flipped).
SP_ATTRS = ("sequence_parallel", "reduce_scatter_embeddings", "scatter_to_sequence_parallel")


def round_up(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def sp_multiple(model: Any) -> int:
    """What a forward's sequence length must be a multiple of for `model` (a GPTModel chunk or its
    wrapper): TP with sequence parallel on, else 1; times 2·CP with context parallelism (each CP rank
    holds two equal chunks, trinity.distributed.context_parallel, which SP then splits over TP)."""
    from trinity.distributed.wrappers import unwrap

    config = unwrap(model).config
    cp = config.context_parallel_size
    return (config.tensor_model_parallel_size if config.sequence_parallel else 1) * (2 * cp if cp > 1 else 1)


def pad_to_multiple(tokens: Any, key_mask: Any, multiple: int, pad_id: int = 0) -> tuple[Any, Any]:
    """(tokens, key_mask) [b, s] padded at the right to a multiple of `multiple` columns: the new
    positions are padding (key_mask 0), which no real token attends to (causal: they come after every
    real token; `key_mask` 0 keys are masked). Callers strip the added positions from the output."""
    import torch.nn.functional as F

    extra = round_up(tokens.shape[1], multiple) - tokens.shape[1]
    if extra == 0:
        return tokens, key_mask
    return F.pad(tokens, (0, extra), value=pad_id), F.pad(key_mask, (0, extra), value=0)


def _sp_state(chunks: list[Any]) -> list[tuple[Any, str]]:
    """Every (object, attribute) that carries an SP flag in `chunks`; raises if megatron-core no longer
    has the attributes this module was written against."""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    from trinity.distributed.wrappers import unwrap

    required = {
        ColumnParallelLinear: ("sequence_parallel",),
        RowParallelLinear: ("sequence_parallel",),
        VocabParallelEmbedding: ("reduce_scatter_embeddings",),
        LanguageModelEmbedding: ("reduce_scatter_embeddings", "scatter_to_sequence_parallel"),
    }
    out: list[tuple[Any, str]] = []
    configs: dict[int, Any] = {}
    seen = {"linear": 0, "embedding": 0}
    for chunk in chunks:
        gpt = unwrap(chunk)
        if not hasattr(gpt.config, "sequence_parallel"):
            raise RuntimeError("megatron-core's TransformerConfig has no `sequence_parallel` (trinity supports 0.16.1)")
        for module in gpt.modules():
            for cls, attrs in required.items():
                if isinstance(module, cls):
                    missing = [a for a in attrs if not hasattr(module, a)]
                    if missing:
                        raise RuntimeError(
                            f"megatron-core's {cls.__name__} has no {missing}: sequence_parallel_disabled was written "
                            "against megatron-core 0.16.1; check trinity/distributed/sequence_parallel.py"
                        )
                    seen["embedding" if cls in (VocabParallelEmbedding, LanguageModelEmbedding) else "linear"] += 1
            for attr in SP_ATTRS:
                if isinstance(getattr(module, attr, None), bool):
                    out.append((module, attr))
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "sequence_parallel"):
                configs[id(config)] = config
        if gpt.post_process and not hasattr(gpt.output_layer, "sequence_parallel"):
            raise RuntimeError("the output layer has no `sequence_parallel` attribute (trinity supports megatron-core 0.16.1)")
        if gpt.pre_process and not seen["embedding"]:
            raise RuntimeError("no megatron-core embedding found on the first stage (trinity supports megatron-core 0.16.1)")
    if not seen["linear"]:
        raise RuntimeError("no megatron-core parallel linear layer found (trinity supports megatron-core 0.16.1)")
    out.extend((config, "sequence_parallel") for config in configs.values())
    return out


@contextmanager
def sequence_parallel_disabled(chunks: Any) -> Iterator[None]:
    """Run `chunks` (a model chunk or a list of them, bare or wrapped) with sequence parallel off; every
    flag gets its own value back on exit. A no-op for models built without SP."""
    from trinity.distributed.wrappers import unwrap

    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    if not any(unwrap(c).config.sequence_parallel for c in chunks):
        yield
        return
    state = [(obj, attr, getattr(obj, attr)) for obj, attr in _sp_state(chunks)]
    try:
        for obj, attr, _ in state:
            setattr(obj, attr, False)
        yield
    finally:
        for obj, attr, value in state:
            setattr(obj, attr, value)


__all__ = ["SP_ATTRS", "pad_to_multiple", "round_up", "sequence_parallel_disabled", "sp_multiple"]
