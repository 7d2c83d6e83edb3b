"""Context parallelism's data side: which tokens a CP rank holds, and the reductions over the CP group.

megatron-core's load-balanced split (`megatron.core.utils.get_batch_on_this_cp_rank`): a row of s tokens is
cut into 2·CP chunks of s / (2·CP); CP rank r holds chunk r and chunk 2·CP-1-r, in that order. Under causal
attention the early chunks attend to few keys and the late ones to many, so pairing them gives every rank
the same work. The model's RoPE follows the same split (megatron's `get_pos_emb_on_this_cp_rank`), and
`trinity.models.ring_attention` computes attention over the pairs.

Every per-token tensor of a batch ([b, s]: tokens, labels, loss mask, document ids, log-probs) is split
with `split_for_rank`; per-token outputs come back whole with `gather_sequence` (RL's log-probs, entropies
and values: its backward hands each rank the gradient of its own part). Losses: each CP rank's token sum is its own; `token_totals` sums sums and counts
over the group for the normaliser and the logs, and `sum_over_ranks` sums a value that a nonlinear loss
needs whole (DPO's per-sequence log-prob), with the gradient each rank's own part needs.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor

from trinity.distributed import collectives


def chunk_size(seq_len: int, cp_size: int) -> int:
    """Tokens per chunk: s / (2·CP); s must divide evenly (pad rows to a multiple of 2·CP, times TP
    with sequence parallelism)."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 x context_parallel_size = "
                         f"{2 * cp_size}: pad the rows to a multiple of it")
    return seq_len // (2 * cp_size)


def chunk_positions(seq_len: int, cp_size: int, cp_rank: int, device: torch.device | str | None = None) -> Tensor:
    """The positions (0-based, within the row) CP rank `cp_rank` holds, in its order: chunk r then chunk
    2·CP-1-r. Increasing, so causal order among a rank's own tokens is their local order."""
    c = chunk_size(seq_len, cp_size)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c, device=device)
    return torch.cat([first, second])


def split_for_rank(t: Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1) -> Tensor:
    """This CP rank's two chunks of `t` along `seq_dim` (a new tensor; `t` is not changed)."""
    if cp_size == 1:
        return t
    index = chunk_positions(t.size(seq_dim), cp_size, cp_rank, device=t.device)
    return t.index_select(seq_dim, index)


def pos_emb_on_this_rank(pos_emb: Tensor, seq_dim: int, cp_group: collectives.ProcessGroup) -> Tensor:
    """megatron-core's `get_pos_emb_on_this_cp_rank` (rope_utils; RotaryEmbedding.forward calls it at CP>1)
    without its pinned host index, which a CPU-only torch refuses: build_model puts this one in its place
    at CP>1 (`trinity.compat.rope.install_cp_pos_emb`)."""
    return split_for_rank(pos_emb, cp_group.size(), cp_group.rank(), seq_dim)


def split_batch(batch: Mapping[str, Optional[Tensor]], cp_size: int, cp_rank: int,
                seq_dim: int = 1) -> dict[str, Optional[Tensor]]:
    """Every tensor of `batch` ([b, s, ...] per-token: tokens, position ids, labels, loss mask, document ids)
    split with `split_for_rank`; None stays None."""
    return {k: None if v is None else split_for_rank(v, cp_size, cp_rank, seq_dim) for k, v in batch.items()}


def merge_ranks(parts: Sequence[Tensor], seq_dim: int = 1) -> Tensor:
    """The inverse of `split_for_rank`: every CP rank's local tensor, in CP rank order, back in row order."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    local = torch.cat(list(parts), dim=seq_dim)  # rank 0's two chunks, rank 1's, ...
    seq_len = local.size(seq_dim)
    order = torch.cat([chunk_positions(seq_len, cp, r) for r in range(cp)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len)
    return local.index_select(seq_dim, inverse.to(local.device))


class _GatherSequence(torch.autograd.Function):
    """Forward: the whole rows from every CP rank's part. Backward: this rank's chunks of the incoming
    gradient, not reduced: every CP rank computes the same loss from the whole rows, and megatron sums
    the parameters' gradients over the CP group (as `_SumOverRanks`), which adds up each rank's part."""

    @staticmethod
    def forward(ctx, local: Tensor, group: collectives.ProcessGroup, seq_dim: int) -> Tensor:  # type: ignore[override]
        ctx.cp, ctx.rank, ctx.seq_dim = collectives.size(group), collectives.rank(group), seq_dim
        return merge_ranks(collectives.all_gather(local, group), seq_dim)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return split_for_rank(grad, ctx.cp, ctx.rank, ctx.seq_dim).contiguous(), None, None


def gather_sequence(local: Tensor, group: Optional[collectives.ProcessGroup], seq_dim: int = 1) -> Tensor:
    """The whole rows of a per-token output (log-probs, entropies, values) from every CP rank's part, on
    every rank; differentiable with the convention of `_GatherSequence` (each rank's own part). `group`
    None: CP=1 (`cp_group`), not the world."""
    if group is None or collectives.size(group) == 1:
        return local
    return _GatherSequence.apply(local, group, seq_dim)


def token_totals(loss_sum: Tensor, token_count: Tensor,
                 group: Optional[collectives.ProcessGroup]) -> tuple[Tensor, Tensor]:
    """(sum, count) of a token loss over the CP group, detached: the normaliser of the loss (divide each
    rank's own differentiable sum by the total count) and the logged value (sum / count)."""
    both = torch.stack([loss_sum.detach().to(torch.float64), token_count.detach().to(torch.float64)])
    if group is None:  # CP=1 (`cp_group`), not the world
        return both[0], both[1]
    total = collectives.all_reduce(both, "sum", group)
    return total[0], total[1]


class _SumOverRanks(torch.autograd.Function):
    """Forward: the sum over the group. Backward: the incoming gradient as is, because every rank computes
    the same loss from the sum and the parameters' gradients are then summed over the CP group (megatron's
    DDP reduces over data x context parallel ranks), which adds up each rank's own part."""

    @staticmethod
    def forward(ctx, t: Tensor, group: Optional[collectives.ProcessGroup]) -> Tensor:  # type: ignore[override]
        return collectives.all_reduce(t, "sum", group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def sum_over_ranks(t: Tensor, group: Optional[collectives.ProcessGroup]) -> Tensor:
    """`t` summed over the CP group (a sequence's log-prob from its tokens on every rank), differentiable
    with the convention of `_SumOverRanks`. `group` None: CP=1 (`cp_group`), not the world."""
    if group is None or collectives.size(group) == 1:
        return t
    return _SumOverRanks.apply(t, group)


def cp_group() -> Optional[collectives.ProcessGroup]:
    """megatron's CP group of this rank; None at CP=1 (or before parallel state exists)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_context_parallel_world_size() == 1:
        return None
    return ps.get_context_parallel_group()


def model_cp_size(model: Any) -> int:
    """The CP size `model` (a GPTModel chunk or its wrapper) was built with."""
    from trinity.distributed.wrappers import unwrap

    return unwrap(model).config.context_parallel_size


def local_rows(*tensors: Optional[Tensor]) -> list[Optional[Tensor]]:
    """This CP rank's part of each [b, s] row tensor (the tensors as they are at CP=1)."""
    group = cp_group()
    if group is None:
        return list(tensors)
    cp, rank = collectives.size(group), collectives.rank(group)
    return [None if t is None else split_for_rank(t, cp, rank) for t in tensors]


def whole_rows(local: Tensor, seq_dim: int = 1) -> Tensor:
    """`gather_sequence` over this rank's CP group (`local` as it is at CP=1)."""
    group = cp_group()
    return local if group is None else gather_sequence(local, group, seq_dim)


@contextmanager
def context_parallel_disabled(chunks: Any) -> Iterator[None]:
    """Run `chunks` with every rotary embedding's table whole (not this CP rank's chunks): the rollout
    decodes whole sequences on each CP rank. megatron's RotaryEmbedding.forward is lru-cached on its
    arguments (the CP group is an attribute, not one of them), so the cache is cleared on entry and exit."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from trinity.distributed.wrappers import unwrap

    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    if all(model_cp_size(c) == 1 for c in chunks):
        yield
        return
    ropes = [m for c in chunks for m in unwrap(c).modules() if isinstance(m, RotaryEmbedding)]
    saved = [m.cp_group for m in ropes]
    caches = {type(m).forward for m in ropes if hasattr(type(m).forward, "cache_clear")}

    def clear() -> None:
        for forward in caches:
            forward.cache_clear()

    try:
        clear()
        for m in ropes:
            m.cp_group = None
        yield
    finally:
        for m, g in zip(ropes, saved):
            m.cp_group = g
        clear()


def same_on_cp_ranks(tensors: Sequence[Tensor], group: Optional[collectives.ProcessGroup]) -> list[Tensor]:
    """CP rank 0's `tensors` on every rank of `group` (shapes may differ between ranks): the CP ranks of a
    replica decode the same prompts with the same seed, and this makes their rollouts identical even
    where a kernel is not bitwise deterministic."""
    if collectives.size(group) == 1:
        return list(tensors)
    import torch.distributed as dist

    src = dist.get_global_rank(group, 0)
    shapes = collectives.broadcast_object([tuple(t.shape) for t in tensors], src, group)
    out = []
    for t, shape in zip(tensors, shapes):
        buf = t if tuple(t.shape) == shape else t.new_empty(shape)
        out.append(collectives.broadcast(buf, src, group))
    return out


__all__ = [
    "chunk_positions", "context_parallel_disabled", "cp_group", "local_rows", "model_cp_size", "same_on_cp_ranks",
    "whole_rows", "chunk_size", "gather_sequence", "merge_ranks", "pos_emb_on_this_rank", "split_batch",
    "split_for_rank",
    "sum_over_ranks", "token_totals",
]
