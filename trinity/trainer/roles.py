"""The RL roles (actor, ref, critic): building and loading them, and their forward passes over rollouts.

All roles run in one parallel state, so they must share one layout (TP/PP/VPP/CP/EP); moving weights
between layouts would need resharding, which is out of scope (`check_same_layout`).

- actor: the trained policy (the worker builds and loads it), DDP + optimizer; also generates.
- ref: the frozen initial policy, forward only (no DDP, no optimizer, no grads), loaded like the actor.
- critic: same backbone with a scalar value head (`build_model(value_head=True)`); backbone weights from
  the HF checkpoint or the converted dist checkpoint, the vocabulary output layer skipped, the head
  initialised by build_model (normal, std = init_method_std).

Forward helpers take a `Rollout` (left-padded prompts + responses, see trinity.rollout.generate) and
return per-response-token tensors `[B, R]`: logits at position t predict token t + 1, so the response
tokens' predictions sit at positions P - 1 ... P + R - 2; a value V_t is read at the position of
response token t (the state after it was generated is not what PPO's critic scores: verl reads the
value at the same positions as the log-probs, and so do we).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from trinity.errors import UserError
from trinity.rollout.generate import Rollout

LAYOUT_FIELDS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
)


def check_same_layout(roles: dict[str, Any]) -> None:
    """UserError when a role's parallel sizes differ from the actor's (naming the key)."""
    actor_key = "actor_rollout_ref.actor"
    actor = roles[actor_key]
    for key, megatron in roles.items():
        for f in LAYOUT_FIELDS:
            if getattr(megatron, f) != getattr(actor, f):
                raise UserError(
                    f"{key}.megatron.{f}: {getattr(megatron, f)} differs from the actor's {getattr(actor, f)}; "
                    "roles with different parallel layouts would need weight resharding, which is not supported: "
                    "use the actor's layout"
                )


@dataclass
class Role:
    """One role's model chunks (DDP-wrapped when trained) and, when trained, its TrainState."""

    name: str
    megatron: Any  # MegatronConfig
    model: list[Any]
    state: Any = None  # trinity.trainer.setup.TrainState or None (frozen)
    offloader: Any = None  # trinity.trainer.offload.RoleOffloader
    extras: dict[str, Any] = field(default_factory=dict)


def _load_backbone(chunks: list[Any], megatron: Any, hf_dir: str, facts: Any, *, value_head: bool, key: str) -> None:
    """Load weights as the worker loads the actor's; for a critic only the backbone (no output layer)."""
    if megatron.use_dist_checkpointing:
        if not megatron.dist_checkpointing_path:
            raise UserError(f"{key}.megatron.dist_checkpointing_path: required with use_dist_checkpointing")
        if value_head:
            load_backbone_from_dist_checkpoint(chunks, megatron.dist_checkpointing_path)
        else:
            from trinity.convert.dist_ckpt import load_model_checkpoint

            load_model_checkpoint(chunks, megatron.dist_checkpointing_path)
    elif megatron.use_mbridge and not value_head:
        from trinity.convert.mbridge_adapter import load_weights

        load_weights(chunks, hf_dir, facts)
    else:  # builtin HF loader; it knows a [1, hidden] output layer is a value head and skips it
        from trinity.convert.builtin import load_hf_weights

        load_hf_weights(chunks, hf_dir, facts)


def load_backbone_from_dist_checkpoint(chunks: list[Any], ckpt_dir: str) -> None:
    """A critic from an LM dist checkpoint: every sharded tensor but the output layer."""
    from megatron.core import dist_checkpointing

    from trinity.convert.dist_ckpt import _flat_sharded, read_meta

    read_meta(ckpt_dir)
    flat, back = _flat_sharded(chunks)
    wanted = {k: v for k, v in flat.items() if not k.endswith("output_layer.weight")}
    loaded = dist_checkpointing.load({"model": wanted}, str(ckpt_dir))["model"]
    for chunk, local_to_key in zip(chunks, back):
        sd = {local: loaded[key] for local, key in local_to_key.items() if key in loaded}
        chunk.load_state_dict(sd, strict=False)


def build_frozen(facts: Any, megatron: Any, hf_dir: str, *, device: str, dtype: torch.dtype, key: str) -> list[Any]:
    from trinity.models.build import build_model

    chunks = build_model(facts, megatron, device=device, dtype=dtype)
    _load_backbone(chunks, megatron, hf_dir, facts, value_head=False, key=key)
    for chunk in chunks:
        chunk.eval()
        chunk.requires_grad_(False)
    return chunks


def build_critic_chunks(facts: Any, megatron: Any, hf_dir: str, *, device: str, dtype: torch.dtype) -> list[Any]:
    from trinity.models.build import build_model

    chunks = build_model(facts, megatron, device=device, dtype=dtype, value_head=True)
    _load_backbone(chunks, megatron, hf_dir, facts, value_head=True, key="critic")
    return chunks


# ---------------------------------------------------------------- forward passes over rollouts


def forward_output(model: Any, tokens: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    """The model's output over whole sequences in megatron's layout: [S, B, vocab / TP] logits (or
    [S, B, 1] values) on the last stage (`trinity.models.logprobs.stage_output`: no [B, S] copy).

    A row is its prompt's left padding (key_mask 0) then one sequence: attention runs as for packed rows
    with those two documents (flash varlen on CUDA with our spec instead of a [B, 1, S, S] mask in every
    layer); real tokens see exactly what `trinity.rollout.generate.attention_mask(key_mask)` lets
    them see."""
    from trinity.models.build import packed_attention
    from trinity.models.logprobs import stage_output

    pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    return stage_output(model, tokens, pos, **packed_attention(model, key_mask.long() - 1, tokens.device))


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


def _pipeline_forward_only(
    model: list[Any], rollout: Rollout, micro_batch: int, reduce: Callable[[torch.Tensor, Rollout], torch.Tensor]
) -> torch.Tensor:
    """`reduce(output, micro rollout)` [b, R] of every micro batch through megatron's pipeline schedule
    (forward only), on every stage of the pipeline: the last stage computes it and broadcasts it."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator: Any, chunk: Any) -> tuple[torch.Tensor, Callable]:
        part: Rollout = next(data_iterator)
        output = forward_output(chunk, part.tokens, part.attention_pad_mask())
        return output, lambda out: (out.new_zeros(()), {"out": reduce(out, part)})

    parts = [rollout.select(slice(s, s + micro_batch)) for s in range(0, rollout.tokens.shape[0], micro_batch)]
    out: list[torch.Tensor] = []
    # the schedule's point-to-point buffers have one shape: one call per run of equal-sized micro batches
    start = 0
    while start < len(parts):
        end = start
        while end < len(parts) and parts[end].tokens.shape[0] == parts[start].tokens.shape[0]:
            end += 1
        store = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(parts[start:end]), model=model[0],
            num_microbatches=end - start, seq_length=rollout.tokens.shape[1],
            micro_batch_size=parts[start].tokens.shape[0], forward_only=True,
        )
        out.extend(d["out"] for d in store)
        start = end
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        result = torch.cat(out).float().contiguous()
    else:
        result = torch.empty(rollout.response_mask.shape, dtype=torch.float32, device=rollout.tokens.device)
    torch.distributed.broadcast(result, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return result


def _forward_only(
    model: list[Any], rollout: Rollout, micro_batch: int, reduce: Callable[[torch.Tensor, Rollout], torch.Tensor]
) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        return _pipeline_forward_only(model, rollout, micro_batch, reduce)
    out = []
    for start in range(0, rollout.tokens.shape[0], micro_batch):
        part = rollout.select(slice(start, start + micro_batch))
        out.append(reduce(forward_output(model[0], part.tokens, part.attention_pad_mask()), part))
    return torch.cat(out)


@torch.no_grad()
def infer_logprobs(model: list[Any], rollout: Rollout, vocab_size: int, micro_batch: int) -> torch.Tensor:
    """Forward-only log-probs of the responses, micro batch by micro batch (ref and old log-probs); at
    PP>1 through megatron's pipeline schedule, returned on every stage."""
    def reduce(logits: torch.Tensor, part: Rollout) -> torch.Tensor:
        return response_logprobs(logits, part, vocab_size, with_entropy=False)[0]

    return _forward_only(model, rollout, micro_batch, reduce) * rollout.response_mask


@torch.no_grad()
def infer_values(model: list[Any], rollout: Rollout, micro_batch: int) -> torch.Tensor:
    return _forward_only(model, rollout, micro_batch, response_values) * rollout.response_mask
