"""Per-token log-probabilities from a megatron-core GPTModel without full-vocabulary fp32 logits.

megatron's own loss path (`GPTModel(labels=...)`) runs the output layer over the whole sequence and
its vocab-parallel cross-entropy upcasts those logits to fp32 and keeps their exp for backward: at a
Qwen2.5-7B shape (vocab 152k) and 4096 tokens that is 1.2 GB of bf16 logits plus ~5 GB of fp32, and on
an H200 its eager elementwise passes took 15% of a 0.5B training step (benchmarks/NOTES.md).
- The log-probs are the trainer's own, `trinity.algorithms.logprob.vocab_parallel_log_probs` (one
  compiled kernel each way on CUDA, fp32 math inside; only the bf16 logits and one fp32 logsumexp
  per token are kept for backward; max and sums all-reduced over the TP group).
- `chunk_tokens`: the output layer and the log-prob run over sequence chunks under activation
  checkpointing, so at most one chunk's logits exist at a time (the output matmul runs twice: a
  memory-for-time trade, off by default).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from megatron.core import parallel_state as ps


def _vocab_logprobs(logits: Tensor, labels: Tensor, vocab_size: int | None) -> Tensor:
    from trinity.algorithms.logprob import vocab_parallel_log_probs

    return vocab_parallel_log_probs(logits, labels, group=ps.get_tensor_model_parallel_group(), vocab_size=vocab_size)


def decoder_hidden(model: Any, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor | None = None,
                   **kwargs: Any) -> Tensor:
    """Final-normed hidden states [s, b, h] of a post_process GPTModel (or a DDP wrapper of one), without
    the output layer. GPTModel returns the decoder output when `post_process` is off (its final norm
    lives in the decoder, which keeps its own flag), so the flag is lowered for this one call."""
    from trinity.models.build import unwrap

    inner = unwrap(model)
    if not inner.post_process:
        raise ValueError("decoder_hidden needs the last pipeline stage (post_process) model chunk")
    inner.post_process = False
    try:
        return model(input_ids, position_ids, attention_mask, **kwargs)
    finally:
        inner.post_process = True


def output_layer(model: Any, hidden: Tensor) -> Tensor:
    """The output layer over `hidden` [s, b, h]: logits [s, b, vocab / TP] (a critic's values [s, b, 1])."""
    from trinity.models.build import unwrap

    inner = unwrap(model)
    weight = inner.shared_embedding_or_output_weight() if inner.share_embeddings_and_output_weights else None
    out, _ = inner.output_layer(hidden, weight=weight)
    return out


def stage_output(model: Any, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor | None = None,
                 **kwargs: Any) -> Tensor:
    """A model chunk's forward in megatron's own [s, b, ...] layout: the last stage's logits [s, b,
    vocab / TP] (values [s, b, 1] for the critic), other stages' hidden states as `model()` gives them.

    GPTModel returns the last stage's logits as `logits.transpose(0, 1).contiguous()`: a full copy of
    the logits, and two more in the backward (the output layer's matmuls on the transposed gradient),
    9.2 ms of a 0.5B SFT step on an H200 (benchmarks/NOTES.md). Callers index the logits [s, b]."""
    from trinity.models.build import unwrap

    if not unwrap(model).post_process:
        return model(input_ids, position_ids, attention_mask, **kwargs)
    return output_layer(model, decoder_hidden(model, input_ids, position_ids, attention_mask, **kwargs))


def _chunk_logprobs(model: Any, hidden: Tensor, labels: Tensor, vocab_size: int | None) -> Tensor:
    return _vocab_logprobs(output_layer(model, hidden), labels, vocab_size)


def token_logprobs(model: Any, hidden: Tensor, labels: Tensor, chunk_tokens: int | None = None,
                   vocab_size: int | None = None) -> Tensor:
    """log p(labels) [b, s] in fp32 from `hidden` [s, b, h] (decoder_hidden) and `labels` [b, s];
    `vocab_size`: the tokenizer's, when the model's vocabulary is padded (padding left out)."""
    labels_sb = labels.transpose(0, 1).contiguous()
    if model.output_layer.sequence_parallel:
        # hidden is this rank's sequence shard and the output layer gathers it: chunking would need
        # the labels gathered to match; one chunk keeps megatron's own behaviour.
        return _chunk_logprobs(model, hidden, labels_sb, vocab_size).transpose(0, 1)
    s, b = labels_sb.shape
    rows = max(1, (chunk_tokens or 1) // b)
    if chunk_tokens is None or rows >= s:
        return _chunk_logprobs(model, hidden, labels_sb, vocab_size).transpose(0, 1)
    pieces = [
        checkpoint(_chunk_logprobs, model, hidden[i:i + rows], labels_sb[i:i + rows], vocab_size, use_reentrant=False)
        for i in range(0, s, rows)
    ]
    return torch.cat(pieces, dim=0).transpose(0, 1)


__all__ = ["decoder_hidden", "output_layer", "stage_output", "token_logprobs"]
