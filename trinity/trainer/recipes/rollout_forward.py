"""Forward passes over rollouts, shared by the RL recipes: whole-sequence outputs, response log-probs
and values, and the forward-only inference of the ref / old log-probs / critic values through a role
engine (`RoleEngine.infer_batch`).

They take a `Rollout` (left-padded prompts + responses, see trinity.rollout.types) and return
per-response-token tensors `[B, R]`: logits at position t predict token t + 1, so the response
tokens' predictions sit at positions P - 1 ... P + R - 2; a value V_t is read at the position of
response token t (the state after it was generated is not what PPO's critic scores: verl reads the
value at the same positions as the log-probs, and so do we).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from trinity.rollout.types import Rollout
from trinity.trainer.engine import forward_only


def forward_output(model: Any, tokens: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    """The model's output over whole sequences in megatron's layout: [S, B, vocab / TP] logits (or
    [S, B, 1] values) on the last stage (`trinity.models.logprobs.stage_output`: no [B, S] copy).

    A row is its prompt's left padding (key_mask 0) then one sequence: attention runs as for packed rows
    with those two documents (flash varlen on CUDA with our spec instead of a [B, 1, S, S] mask in every
    layer); real tokens see exactly what `trinity.rollout.generate.attention_mask(key_mask)` lets
    them see."""
    from trinity.distributed.sequence_parallel import pad_to_multiple, sp_multiple
    from trinity.models.build import packed_attention, unwrap
    from trinity.models.logprobs import stage_output

    # Sequence parallel splits the sequence over the TP ranks: pad at the right with masked positions
    # and strip them from the last stage's (gathered) output; other stages pass their shard on as is.
    s = tokens.shape[1]
    tokens, key_mask = pad_to_multiple(tokens, key_mask, sp_multiple(model))
    pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    out = stage_output(model, tokens, pos, **packed_attention(model, key_mask.long() - 1, tokens.device))
    return out[:s] if tokens.shape[1] != s and unwrap(model).post_process else out


def response_slice(rollout: Rollout) -> slice:
    p, r = rollout.prompt_len, rollout.response_len
    return slice(p - 1, p + r - 1)


def response_logprobs(
    logits: torch.Tensor, rollout: Rollout, vocab_size: int, *, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(response tokens), entropy or None), [B, R] fp32, from vocab-parallel logits [S, B, V / TP]."""
    from megatron.core import parallel_state as ps

    from trinity.algorithms.logprob import vocab_parallel_log_probs, vocab_parallel_log_probs_and_entropy

    group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
    shard = logits[response_slice(rollout)]  # [R, B, V / TP], contiguous
    targets = rollout.responses.t()
    if with_entropy:
        logp, entropy = vocab_parallel_log_probs_and_entropy(shard, targets, group=group, vocab_size=vocab_size)
        return logp.t(), entropy.t()
    return vocab_parallel_log_probs(shard, targets, group=group, vocab_size=vocab_size).t(), None


def response_values(output: torch.Tensor, rollout: Rollout) -> torch.Tensor:
    """Critic values [B, R] fp32 at the response tokens' positions (see module doc), from [S, B, 1]."""
    p, r = rollout.prompt_len, rollout.response_len
    return output[p : p + r, :, 0].t().float()


def _rollout_forward(chunk: Any, part: Rollout) -> torch.Tensor:
    return forward_output(chunk, part.tokens, part.attention_pad_mask())


def _infer(model: Any, rollout: Rollout, micro_batch: int,
           reduce: Callable[[torch.Tensor, Rollout], torch.Tensor]) -> torch.Tensor:
    parts = [rollout.select(slice(s, s + micro_batch)) for s in range(0, rollout.tokens.shape[0], micro_batch)]
    shape = tuple(rollout.response_mask.shape)
    if hasattr(model, "infer_batch"):  # a RoleEngine
        return model.infer_batch(parts, _rollout_forward, reduce, shape)
    return forward_only(model, parts, _rollout_forward, reduce, shape)


@torch.no_grad()
def infer_logprobs(model: Any, rollout: Rollout, vocab_size: int, micro_batch: int) -> torch.Tensor:
    """Forward-only log-probs of the responses, micro batch by micro batch (ref and old log-probs); at
    PP>1 through megatron's pipeline schedule, returned on every stage. `model`: a RoleEngine or its
    chunks."""
    def reduce(logits: torch.Tensor, part: Rollout) -> torch.Tensor:
        return response_logprobs(logits, part, vocab_size, with_entropy=False)[0]

    return _infer(model, rollout, micro_batch, reduce) * rollout.response_mask


@torch.no_grad()
def infer_values(model: Any, rollout: Rollout, micro_batch: int) -> torch.Tensor:
    return _infer(model, rollout, micro_batch, response_values) * rollout.response_mask
