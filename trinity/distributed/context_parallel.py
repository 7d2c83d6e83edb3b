"""Context parallelism's data side: which tokens a CP rank holds, and the reductions over the CP group.

megatron-core's load-balanced split (`megatron.core.utils.get_batch_on_this_cp_rank`): a row of s tokens is
cut into 2·CP chunks of s / (2·CP); CP rank r holds chunk r and chunk 2·CP-1-r, in that order. Under causal
attention the early chunks attend to few keys and the late ones to many, so pairing them gives every rank
the same work. The model's RoPE follows the same split (megatron's `get_pos_emb_on_this_cp_rank`), and
`trinity.models.ring_attention` computes attention over the pairs.

Every per-token tensor of a batch ([b, s]: tokens, labels, loss mask, document ids, log-probs) is split
with `split_for_rank`; per-token outputs come back with `gather_sequence` (no gradient: log-probs for RL's
old / reference passes). Losses: each CP rank's token sum is its own; `token_totals` sums sums and counts
over the group for the normaliser and the logs, and `sum_over_ranks` sums a value that a nonlinear loss
needs whole (DPO's per-sequence log-prob), with the gradient each rank's own part needs.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

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
    without its pinned host index, which a CPU-only torch refuses: cpu_compat puts this one in its place."""
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


def gather_sequence(local: Tensor, group: Optional[collectives.ProcessGroup], seq_dim: int = 1) -> Tensor:
    """The whole rows of a per-token output (log-probs, entropies) from every CP rank's part, on every rank.
    Detached: for values a later step reads, not for a loss's gradient."""
    if collectives.size(group) == 1:
        return local.detach()
    return merge_ranks(collectives.all_gather(local, group), seq_dim)


def token_totals(loss_sum: Tensor, token_count: Tensor,
                 group: Optional[collectives.ProcessGroup]) -> tuple[Tensor, Tensor]:
    """(sum, count) of a token loss over the CP group, detached: the normaliser of the loss (divide each
    rank's own differentiable sum by the total count) and the logged value (sum / count)."""
    both = torch.stack([loss_sum.detach().to(torch.float64), token_count.detach().to(torch.float64)])
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
    with the convention of `_SumOverRanks`."""
    if collectives.size(group) == 1:
        return t
    return _SumOverRanks.apply(t, group)


__all__ = [
    "chunk_positions", "chunk_size", "gather_sequence", "merge_ranks", "pos_emb_on_this_rank", "split_batch",
    "split_for_rank",
    "sum_over_ranks", "token_totals",
]
