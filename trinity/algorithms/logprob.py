"""Log-probs of target tokens and entropy from vocab-parallel logits, without gathering the vocabulary.

With tensor parallelism the output layer gives each rank the logits of its slice of the vocabulary
(`[..., vocab / tp]`, rank r owning ids `[vocab_start, vocab_start + vocab / tp)`). Gathering the full
vocabulary (152k for Qwen) in fp32 for every token costs far more memory than the model's activations,
so the softmax statistics are reduced across the group instead:
  pass 1  per-token max of the local logits (in the logits' dtype, exact) -> all-reduce MAX
  pass 2  per chunk of tokens, in fp32: sum exp(x - max), the target's shifted logit (0 on ranks that do
          not own it) and, for entropy, sum exp(x - max) * (x - max) -> one all-reduce SUM at the end
  log p(target) = shifted_target - log(sumexp);  entropy = log(sumexp) - weighted_sum / sumexp
Backward needs no communication: d logp / d x_j = onehot_j - p_j and d H / d x_j = p_j (E[x] - x_j),
with p_j = exp(x_j - logsumexp) using the global logsumexp saved by forward. The gradient of the
sharded logits is what megatron's ColumnParallelLinear output layer expects.

Vocabulary padding: megatron models carry a vocabulary padded to a multiple of 128 * TP, whose extra
logits are not the HF model's; pass `vocab_size` (the real one) and those columns are left out of the
softmax (and get zero gradient). A shard that is all padding takes part with empty statistics.

On CUDA, pass 2 and the backward are each one compiled kernel over all tokens (`torch.compile`: the
fp32 math stays in registers, the logits are read once per pass and the gradient is written once, in
the logits' dtype); elsewhere (CPU, fp64) they run eagerly with fp32 temporaries bounded by
`chunk_size` tokens at a time (default: about 2^26 elements). Either way `[seq, vocab]` is never
materialised in fp32. With group None (or of size 1) the results equal `torch.log_softmax` ones.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from trinity.distributed import collectives

_CHUNK_ELEMENTS = 1 << 26  # fp32 elements per temporary: 256 MiB
_compiled: dict[str, Any] = {}


def _stats_kernel(x: torch.Tensor, maxes: torch.Tensor, local: torch.Tensor, owned: torch.Tensor,
                  with_targets: bool, with_entropy: bool) -> torch.Tensor:
    """[n, 3] in maxes' dtype (fp32, or fp64 for fp64 logits): sum exp(x - max), the owned target's
    x - max (else 0), sum exp(x - max) * (x - max)."""
    shifted = x.to(maxes.dtype) - maxes[:, None]
    exp = shifted.exp()
    zeros = torch.zeros_like(maxes)
    picked = zeros
    if with_targets:
        picked = torch.where(owned, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), zeros)
    weighted = (exp * shifted).sum(-1) if with_entropy else zeros
    return torch.stack([exp.sum(-1), picked, weighted], dim=1)


def _grad_kernel(x: torch.Tensor, vocab_local: int, logsumexp: torch.Tensor, local: torch.Tensor,
                 owned: torch.Tensor, g_logp: torch.Tensor | None, mean_logit: torch.Tensor,
                 g_ent: torch.Tensor | None) -> torch.Tensor:
    """d(sum g_logp * logp + g_ent * entropy) / d x over all columns of x (0 past vocab_local), in x's dtype."""
    xf = x.to(logsumexp.dtype)
    probs = (xf - logsumexp[:, None]).exp()
    cols = torch.arange(x.shape[-1], device=x.device)
    grad = torch.zeros_like(xf)
    if g_logp is not None:
        onehot = (cols[None, :] == local[:, None]) & owned[:, None]
        grad = (onehot.to(xf.dtype) - probs) * g_logp[:, None]
    if g_ent is not None:
        grad = grad + probs * (mean_logit[:, None] - xf) * g_ent[:, None]
    return torch.where(cols[None, :] < vocab_local, grad, 0.0).to(x.dtype)


def _kernel(name: str, fn: Any, logits: torch.Tensor) -> Any:
    """`fn` compiled on CUDA for the float dtypes a model trains in; None elsewhere (the eager chunks)."""
    if not logits.is_cuda or logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=None)
    return _compiled[name]


def _group_size_rank(group: Any) -> tuple[int, int]:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_reduce(tensor: torch.Tensor, op: Any, group: Any) -> None:
    """In place: the vocabulary-parallel statistics live on the logits' device."""
    if _group_size_rank(group)[0] > 1:
        collectives.all_reduce_(tensor, op, group=group)


class _VocabParallelStats(torch.autograd.Function):
    """(log p(target), entropy) per token from vocab-sharded logits; either can be skipped."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor | None,
        group: Any,
        vocab_start: int,
        vocab_local: int,
        chunk_size: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # vocab_local: leading columns of this shard that are real tokens (the rest is vocab padding)
        lead_shape = logits.shape[:-1]
        flat = logits.reshape(-1, logits.shape[-1])[:, :vocab_local]
        n = flat.shape[0]
        flat_targets = None if targets is None else targets.reshape(-1)

        # fp32 at least; fp64 inputs stay fp64 (lets gradcheck verify the backward exactly)
        compute = torch.promote_types(logits.dtype, torch.float32)
        if vocab_local > 0:
            maxes = flat.max(dim=-1).values.to(compute)
        else:  # a shard that is all padding
            maxes = torch.full((n,), float("-inf"), dtype=compute, device=logits.device)
        _all_reduce(maxes, dist.ReduceOp.MAX, group)

        # columns: sumexp, shifted target logit, sum exp(x - max) * (x - max)
        stats = torch.zeros(n, 3, dtype=compute, device=logits.device)
        kernel = _kernel("stats", _stats_kernel, logits) if vocab_local > 0 else None
        if kernel is not None:
            with_targets = flat_targets is not None
            local = flat_targets - vocab_start if with_targets else maxes.new_zeros(n, dtype=torch.long)
            owned = (local >= 0) & (local < vocab_local)
            stats = kernel(flat, maxes, local.clamp(0, vocab_local - 1), owned, with_targets, with_entropy)
        for start in range(0, n if kernel is None else 0, chunk_size):
            end = min(start + chunk_size, n)
            shifted = flat[start:end].to(compute) - maxes[start:end, None]
            exp = shifted.exp()
            stats[start:end, 0] = exp.sum(-1)
            if flat_targets is not None and vocab_local > 0:  # an all-padding shard owns no target
                local = flat_targets[start:end] - vocab_start
                owned = (local >= 0) & (local < vocab_local)
                picked = shifted.gather(-1, local.clamp(0, vocab_local - 1).unsqueeze(-1)).squeeze(-1)
                stats[start:end, 1] = torch.where(owned, picked, torch.zeros_like(picked))
            if with_entropy:
                stats[start:end, 2] = (exp * shifted).sum(-1)
            del shifted, exp
        _all_reduce(stats, dist.ReduceOp.SUM, group)

        log_z = stats[:, 0].log()
        logsumexp = maxes + log_z
        mean_shifted = stats[:, 2] / stats[:, 0]
        logp = (stats[:, 1] - log_z).reshape(lead_shape)
        entropy = (log_z - mean_shifted).reshape(lead_shape)
        has_targets = flat_targets is not None
        saved_targets = flat_targets if has_targets else maxes.new_empty(0, dtype=torch.long)
        ctx.save_for_backward(logits, saved_targets, logsumexp, maxes + mean_shifted)
        ctx.has_targets = has_targets
        ctx.vocab_start = vocab_start
        ctx.vocab_local = vocab_local
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None, None, None, None, None]:
        logits, flat_targets, logsumexp, mean_logit = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        vocab_local = ctx.vocab_local
        full = logits.reshape(-1, logits.shape[-1])
        flat = full[:, :vocab_local]
        compute = logsumexp.dtype
        g_logp = None if grad_logp is None or not ctx.has_targets else grad_logp.reshape(-1).to(compute)
        g_ent = None if grad_entropy is None else grad_entropy.reshape(-1).to(compute)
        if vocab_local == 0 or (g_logp is None and g_ent is None):
            return torch.zeros_like(logits), None, None, None, None, None, None
        kernel = _kernel("grad", _grad_kernel, logits)
        if kernel is not None:
            n = full.shape[0]
            local = flat_targets - ctx.vocab_start if ctx.has_targets else logsumexp.new_zeros(n, dtype=torch.long)
            owned = (local >= 0) & (local < vocab_local)
            grad = kernel(full, vocab_local, logsumexp, local, owned, g_logp, mean_logit, g_ent)
            return grad.reshape(logits.shape), None, None, None, None, None, None
        grad = torch.zeros_like(full)  # padding columns get no gradient
        for start in range(0, flat.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, flat.shape[0])
            x = flat[start:end].to(compute)
            probs = (x - logsumexp[start:end, None]).exp()
            chunk_grad = torch.zeros_like(x)
            if g_logp is not None:
                g = g_logp[start:end]
                chunk_grad -= probs * g[:, None]
                local = flat_targets[start:end] - ctx.vocab_start
                owned = (local >= 0) & (local < vocab_local)
                chunk_grad.scatter_add_(
                    -1, local.clamp(0, vocab_local - 1).unsqueeze(-1), torch.where(owned, g, torch.zeros_like(g)).unsqueeze(-1)
                )
            if g_ent is not None:
                chunk_grad += probs * (mean_logit[start:end, None] - x) * g_ent[start:end, None]
            grad[start:end, :vocab_local] = chunk_grad.to(grad.dtype)
        return grad.reshape(logits.shape), None, None, None, None, None, None


def _resolve(
    logits: torch.Tensor, group: Any, vocab_start: int | None, vocab_size: int | None, chunk_size: int | None
) -> tuple[int, int, int]:
    """(vocab_start, real columns on this shard, chunk_size)."""
    _, rank = _group_size_rank(group)
    width = logits.shape[-1]
    if vocab_start is None:
        vocab_start = rank * width  # megatron's equal vocabulary partition
    valid = width if vocab_size is None else max(0, min(width, vocab_size - vocab_start))
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_ELEMENTS // max(1, width))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return vocab_start, valid, chunk_size


def _check_targets(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} != logits leading shape {tuple(logits.shape[:-1])}")


def vocab_parallel_log_probs_and_entropy(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    group: Any = None,
    vocab_start: int | None = None,
    chunk_size: int | None = None,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(targets), entropy), both fp32 (fp64 for fp64 logits) with the shape of `targets`.

    targets hold global vocabulary ids. vocab_start (first id of this shard) defaults to
    rank-in-group * shard width, megatron's partition. vocab_size is the tokenizer's vocabulary when
    the model's is padded (trinity.models.build pads to a multiple of 128 * TP): ids >= vocab_size
    are left out of the softmax, as in the HF model. Differentiable w.r.t. logits_shard.
    """
    _check_targets(logits_shard, targets)
    start, valid, chunk = _resolve(logits_shard, group, vocab_start, vocab_size, chunk_size)
    return _VocabParallelStats.apply(logits_shard, targets, group, start, valid, chunk, True)


def vocab_parallel_log_probs(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    group: Any = None,
    vocab_start: int | None = None,
    chunk_size: int | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """log p(targets) (fp32, shape of targets) from vocab-sharded logits; see the module doc."""
    _check_targets(logits_shard, targets)
    start, valid, chunk = _resolve(logits_shard, group, vocab_start, vocab_size, chunk_size)
    return _VocabParallelStats.apply(logits_shard, targets, group, start, valid, chunk, False)[0]


def vocab_parallel_entropy(
    logits_shard: torch.Tensor,
    group: Any = None,
    chunk_size: int | None = None,
    vocab_size: int | None = None,
    vocab_start: int | None = None,
) -> torch.Tensor:
    """Entropy of the full-vocabulary softmax (fp32, logits' leading shape) from vocab-sharded logits."""
    start, valid, chunk = _resolve(logits_shard, group, vocab_start, vocab_size, chunk_size)
    return _VocabParallelStats.apply(logits_shard, None, group, start, valid, chunk, True)[1]
