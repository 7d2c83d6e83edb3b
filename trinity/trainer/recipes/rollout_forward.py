"""Forward passes over rollouts, shared by the RL recipes: whole-sequence outputs, response log-probs
and values, and the forward-only inference of the ref / old log-probs / critic values through a role
engine (`RoleEngine.infer_batch`).

They take a `Rollout` (left-padded prompts + responses, see trinity.rollout.types) and return
per-response-token tensors `[B, R]`: logits at position t predict token t + 1, so the response
tokens' predictions sit at positions P - 1 ... P + R - 2; a value V_t is read at the position of
response token t (the state after it was generated is not what PPO's critic scores: verl reads the
value at the same positions as the log-probs, and so do we).

Two layouts of micro batches (`Batching`): padded rows, `trainer.micro_batch_size` rollout rows at a
time; or packed rows (`pack_rollout`, the default): each sequence's real tokens only, first-fit
decreasing into rows of a token budget, one row per micro batch, attending through the document-packed
attention SFT uses. Both give [B, R] results in the rollout's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, TypeVar

import numpy as np
import torch

from trinity.rollout.types import Rollout
from trinity.trainer.engine import MicroBatch, forward_only


def forward_output(model: torch.nn.Module, tokens: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    """The model's output over whole sequences in megatron's layout: [S, B, vocab / TP] logits (or
    [S, B, 1] values) on the last stage (`trinity.models.logprobs.stage_output`: no [B, S] copy).

    A row is its prompt's left padding (key_mask 0) then one sequence: attention runs as for packed rows
    with those two documents (flash varlen on CUDA with our spec instead of a [B, 1, S, S] mask in every
    layer); real tokens see exactly what `trinity.rollout.reference.attention_mask(key_mask)` lets
    them see."""
    from trinity.distributed.sequence_parallel import pad_to_multiple, sp_multiple
    from trinity.models.build import packed_attention, unwrap
    from trinity.models.logprobs import stage_output

    from trinity.distributed.context_parallel import cp_group, local_rows

    # Sequence parallel splits the sequence over the TP ranks: pad at the right with masked positions
    # and strip them from the last stage's (gathered) output; other stages pass their shard on as is.
    # Context parallelism: the rows padded to 2·CP chunks, this CP rank's two chunks go in and come out
    # (`cp_response`: the per-token results of every rank, whole).
    s = tokens.shape[1]
    tokens, key_mask = pad_to_multiple(tokens, key_mask, sp_multiple(model))
    pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    attention = packed_attention(model, key_mask.long() - 1, tokens.device)
    if cp_group() is not None:
        return stage_output(model, *local_rows(tokens, pos), **attention)
    out = stage_output(model, tokens, pos, **attention)
    return out[:s] if tokens.shape[1] != s and unwrap(model).post_process else out


def _next_tokens(tokens: torch.Tensor, length: int) -> torch.Tensor:
    """[B, length]: position k's target, the token at k + 1 (0 past the row's end)."""
    nxt = tokens[:, 1:]
    return torch.nn.functional.pad(nxt, (0, length - nxt.shape[1]), value=0)


def cp_logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int, *,
                with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Context parallelism: (log p(next token), entropy or None) [B, S'] fp32 at every position of the
    padded rows, from this CP rank's logits [S' / CP, B, V / TP] (`forward_output`); every CP rank's part,
    gathered (differentiable: each rank's own part, trinity.distributed.context_parallel.gather_sequence).
    Per-token results are small beside the logits, which never leave their rank."""
    from megatron.core import parallel_state as ps

    from trinity.algorithms.logprob import vocab_parallel_log_probs, vocab_parallel_log_probs_and_entropy
    from trinity.distributed.context_parallel import local_rows, whole_rows

    group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
    length = logits.shape[0] * ps.get_context_parallel_world_size()
    (targets,) = local_rows(_next_tokens(tokens, length))
    targets = targets.t()  # [S' / CP, B]
    if with_entropy:
        logp, entropy = vocab_parallel_log_probs_and_entropy(logits, targets, group=group, vocab_size=vocab_size)
        return whole_rows(logp.t()), whole_rows(entropy.t())
    return whole_rows(vocab_parallel_log_probs(logits, targets, group=group, vocab_size=vocab_size).t()), None


def response_slice(rollout: Rollout) -> slice:
    p, r = rollout.prompt_len, rollout.response_len
    return slice(p - 1, p + r - 1)


def response_logprobs(
    logits: torch.Tensor, rollout: Rollout, vocab_size: int, *, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(response tokens), entropy or None), [B, R] fp32, from vocab-parallel logits [S, B, V / TP]."""
    from megatron.core import parallel_state as ps

    from trinity.algorithms.logprob import vocab_parallel_log_probs, vocab_parallel_log_probs_and_entropy

    if ps.get_context_parallel_world_size() > 1:
        logp, entropy = cp_logprobs(logits, rollout.tokens, vocab_size, with_entropy=with_entropy)
        cut = response_slice(rollout)
        return logp[:, cut], None if entropy is None else entropy[:, cut]
    group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
    shard = logits[response_slice(rollout)]  # [R, B, V / TP], contiguous
    targets = rollout.responses.t()
    if with_entropy:
        logp, entropy = vocab_parallel_log_probs_and_entropy(shard, targets, group=group, vocab_size=vocab_size)
        return logp.t(), entropy.t()
    return vocab_parallel_log_probs(shard, targets, group=group, vocab_size=vocab_size).t(), None


def response_values(output: torch.Tensor, rollout: Rollout) -> torch.Tensor:
    """Critic values [B, R] fp32 at the response tokens' positions (see module doc), from [S, B, 1]."""
    from trinity.distributed.context_parallel import whole_rows

    p, r = rollout.prompt_len, rollout.response_len
    return whole_rows(output[:, :, 0].t())[:, p : p + r].float()  # context parallelism: every rank's part


@dataclass(frozen=True)
class PaddedRollout:
    """A micro batch of rollout rows as they are (`Batching` without a token budget): `rows` of the
    rollout, each a left-padded prompt then its right-padded response."""

    rollout: Rollout
    index: torch.Tensor  # [b] rows of the split rollout (host, int64)

    @property
    def tokens(self) -> torch.Tensor:
        return self.rollout.tokens

    @property
    def size(self) -> int:
        return int(self.index.numel())

    def forward(self, chunk: torch.nn.Module) -> torch.Tensor:
        return forward_output(chunk, self.rollout.tokens, self.rollout.attention_pad_mask())

    def logprobs(self, output: torch.Tensor, vocab_size: int, *,
                 with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log p(response tokens), entropy or None), [b, R] fp32, from the last stage's logits."""
        return response_logprobs(output, self.rollout, vocab_size, with_entropy=with_entropy)

    def values(self, output: torch.Tensor) -> torch.Tensor:
        """Critic values [b, R] fp32, from the last stage's [S, b, 1]."""
        return response_values(output, self.rollout)


# ---------------------------------------------------------------- packed (padding-free) micro batches


@dataclass(frozen=True)
class PackedMicro:
    """One packed row: the real tokens (prompt without its left padding, then the response up to and
    including EOS, nothing else) of the rollout rows `index`, back to back, then padding up to the row
    length. Token ids are on the model's device; `doc_ids` stay on the host (the varlen boundaries are
    computed there without a device sync).

    The logits at row position `pos[k]` predict the response token `t[k]` of the micro batch's sequence
    `seq[k]`; a value is read one position later (at the token itself, see the module doc)."""

    index: torch.Tensor  # [b] rows of the packed rollout, in row order (host, int64)
    tokens: torch.Tensor  # [1, S] (device)
    position_ids: torch.Tensor  # [1, S] 0, 1, ... restarting at each sequence (device)
    doc_ids: torch.Tensor  # [1, S] sequence within the row, -1 on padding (host)
    pos: torch.Tensor  # [N] (device)
    seq: torch.Tensor  # [N] (device)
    t: torch.Tensor  # [N] (device)
    next_tokens: torch.Tensor  # [S] the row's tokens shifted left by one: position k's target (device)
    response_len: int  # R of the rollout: results come back as [b, R]
    real_tokens: int

    @property
    def size(self) -> int:
        return int(self.index.numel())

    def forward(self, chunk: torch.nn.Module) -> torch.Tensor:
        return packed_forward(chunk, self)

    def logprobs(self, output: torch.Tensor, vocab_size: int, *,
                 with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log p(response tokens), entropy or None), [b, R] fp32 in the row's sequence order."""
        return packed_response_logprobs(output, self, vocab_size, with_entropy=with_entropy)

    def values(self, output: torch.Tensor) -> torch.Tensor:
        return packed_response_values(output, self)


# A micro batch of rollout sequences: padded rows, or one packed row (`Batching` decides).
RolloutMicro = PaddedRollout | PackedMicro


def sequence_lengths(rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """(real prompt tokens, response tokens) per row, host int64: the response runs up to its last
    masked-in token (EOS included), so a mask with holes still packs every scored token."""
    p = rollout.prompt_mask.sum(-1).long().cpu()
    m = rollout.response_mask.bool().cpu()
    last = torch.where(m, torch.arange(1, m.shape[1] + 1).expand_as(m), torch.zeros_like(m, dtype=torch.long))
    return p, last.max(-1).values if m.shape[1] else torch.zeros_like(p)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """arange(starts[k], starts[k] + lengths[k]) for every k, concatenated (no Python loop)."""
    total = int(lengths.sum())
    before = np.cumsum(lengths) - lengths
    return np.repeat(starts - before, lengths) + np.arange(total)


def pack_rollout(rollout: Rollout, budget: int, *, multiple: int = 1, same_length: bool = False) -> list[PackedMicro]:
    """The rollout's sequences packed into rows of at most `budget` tokens (first-fit decreasing,
    `trinity.data.packing.first_fit_decreasing`), one row per micro batch. A row is as long as what it
    holds, rounded up to `multiple` (TP with sequence parallel splits the row over TP ranks);
    `same_length`: every row as long as the longest (one shape through a pipeline schedule).

    The index arithmetic runs on the host in numpy (vectorised per row) and reaches the device in one
    copy; the token ids are gathered there (one kernel per row)."""
    from trinity.data.packing import first_fit_decreasing

    p_t, r_t = sequence_lengths(rollout)
    p, r = p_t.numpy(), r_t.numpy()
    if len(p) and int(p.min()) < 1:
        raise ValueError("a rollout row has no prompt token: its first response token has no prediction")
    n_all = p + r
    bins = first_fit_decreasing(n_all.tolist(), budget)
    width = rollout.tokens.shape[1]
    P, R = rollout.prompt_len, rollout.response_len
    fills = [int(n_all[b].sum()) for b in bins]
    row_lens = [_round_up(max(f, 1), multiple) for f in fills]
    if same_length and row_lens:
        row_lens = [max(row_lens)] * len(row_lens)
    # per row: [src (S) | position_ids (S) | pos (N) | seq (N) | t (N)], all rows in one host buffer
    host, spans = [], []
    for b, fill, s in zip(bins, fills, row_lens):
        items = np.asarray(b, dtype=np.int64)
        pi, ri, ni = p[items], r[items], n_all[items]
        offsets = np.cumsum(ni) - ni
        pad = s - fill
        src = np.concatenate([_ranges(items * width + P - pi, ni), np.full(pad, -1, dtype=np.int64)])
        pos_ids = np.concatenate([_ranges(np.zeros_like(ni), ni), np.zeros(pad, dtype=np.int64)])
        j = np.arange(len(items))
        fields = [src, pos_ids, _ranges(offsets + pi - 1, ri), np.repeat(j, ri), _ranges(np.zeros_like(ri), ri)]
        host.extend(fields)
        spans.append((s, int(ri.sum()), np.concatenate([np.repeat(j, ni), np.full(pad, -1, dtype=np.int64)])))
    if not bins:
        return []
    dev = torch.from_numpy(np.concatenate(host)).to(rollout.tokens.device, non_blocking=True)
    flat_tokens = torch.cat([rollout.tokens.reshape(-1), rollout.tokens.new_zeros(1)])  # index -1: padding id 0
    out, at = [], 0
    for b, fill, (s, n, docs) in zip(bins, fills, spans):
        src, pos_ids, pos, seq, t = dev[at: at + s], dev[at + s: at + 2 * s], *dev[at + 2 * s: at + 2 * s + 3 * n].view(3, n)
        at += 2 * s + 3 * n
        tokens = flat_tokens[src].unsqueeze(0)
        out.append(PackedMicro(
            index=torch.tensor(b, dtype=torch.long), tokens=tokens, position_ids=pos_ids.unsqueeze(0),
            doc_ids=torch.from_numpy(docs).unsqueeze(0), pos=pos, seq=seq, t=t,
            next_tokens=torch.cat([tokens[0, 1:], tokens.new_zeros(1)]),
            response_len=R, real_tokens=fill,
        ))
    return out


def packed_forward(model: torch.nn.Module, part: PackedMicro) -> torch.Tensor:
    """The model's output over one packed row ([S, 1, vocab / TP] logits or [S, 1, 1] values on the
    last stage): each sequence attends only to itself (flash varlen on CUDA with our spec)."""
    from trinity.distributed.context_parallel import local_rows
    from trinity.models.build import packed_attention
    from trinity.models.logprobs import stage_output

    # context parallelism: this CP rank's chunks of the row (a multiple of 2·CP long, `Batching.multiple`)
    return stage_output(model, *local_rows(part.tokens, part.position_ids),
                        **packed_attention(model, part.doc_ids, part.tokens.device))


def _scatter(values: torch.Tensor, part: PackedMicro) -> torch.Tensor:
    """[N] per response token -> [b, R] (0 past each response), differentiable."""
    out = values.new_zeros(part.size, part.response_len)
    return out.index_put((part.seq, part.t), values)


def packed_response_logprobs(
    logits: torch.Tensor, part: PackedMicro, vocab_size: int, *, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_logprobs` of a packed row: [b, R] fp32 in the row's sequence order."""
    from megatron.core import parallel_state as ps

    from trinity.algorithms.logprob import vocab_parallel_log_probs, vocab_parallel_log_probs_and_entropy

    if ps.get_context_parallel_world_size() > 1:  # this CP rank's chunks in, the whole row's results out
        logp, entropy = cp_logprobs(logits, part.tokens, vocab_size, with_entropy=with_entropy)
        return _scatter(logp[0, part.pos], part), None if entropy is None else _scatter(entropy[0, part.pos], part)
    group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
    # Over the whole row, then the response positions picked from the [S] result: gathering the response
    # positions' logits first would copy up to all of them ([N, V / TP], GBs at a 150k vocabulary); the
    # padded layout's response slice is a view. The extra prompt positions cost only the softmax pass.
    shard = logits[:, 0]  # [S, V / TP], a view (one row)
    if with_entropy:
        logp, entropy = vocab_parallel_log_probs_and_entropy(shard, part.next_tokens, group=group, vocab_size=vocab_size)
        return _scatter(logp[part.pos], part), _scatter(entropy[part.pos], part)
    return _scatter(vocab_parallel_log_probs(shard, part.next_tokens, group=group, vocab_size=vocab_size)[part.pos], part), None


def packed_response_values(output: torch.Tensor, part: PackedMicro) -> torch.Tensor:
    """`response_values` of a packed row: [b, R] fp32."""
    from trinity.distributed.context_parallel import whole_rows

    return _scatter(whole_rows(output[:, 0, 0].unsqueeze(0))[0, part.pos + 1].float(), part)


@dataclass
class Batching:
    """How a phase cuts its sequences into micro batches: padded rows, `micro` per micro batch
    (`budget` None), or packed rows of at most `budget` real tokens (dynamic micro batches).

    `real` / `computed` count the tokens of what `split` handed out since `reset()`: real prompt and
    response tokens, and what the forward passes computed (padding included), for the phase metrics."""

    micro: int
    budget: int | None = None
    multiple: int = 1
    same_length: bool = False
    real: int = 0
    computed: int = 0

    def reset(self) -> "Batching":
        self.real = self.computed = 0
        return self

    def split(self, rollout: Rollout) -> list[RolloutMicro]:
        """The rollout's micro batches: packed rows (`budget`), or `micro` rows at a time."""
        if self.budget is not None:
            parts = pack_rollout(rollout, self.budget, multiple=self.multiple, same_length=self.same_length)
            self.real += sum(m.real_tokens for m in parts)
            self.computed += sum(m.tokens.shape[1] for m in parts)
            return parts
        p, r = sequence_lengths(rollout)
        self.real += int((p + r).sum())
        self.computed += rollout.tokens.numel()
        n = rollout.tokens.shape[0]
        return [PaddedRollout(rollout.select(slice(s, s + self.micro)), torch.arange(s, min(s + self.micro, n)))
                for s in range(0, n, self.micro)]

    def counts(self, _result: object = None) -> tuple[int, int]:
        return self.real, self.computed


M = TypeVar("M", bound=MicroBatch)


class Inference(Protocol):
    """What runs forward-only passes over micro batches: a `RoleEngine`, or the LoRA actor with its
    adapters off (`lora_ref.AdaptersOff`); `need` makes its parameters resident for them (offload)."""

    def infer_batch(self, micro_batches: Sequence[M], reduce_fn: Callable[[torch.Tensor, M], torch.Tensor],
                    result_shape: tuple[int, ...]) -> torch.Tensor: ...

    def need(self, *, params: bool, grads: bool = False, optim: bool = False) -> None: ...


# What the forward-only phases run: an engine, or bare model chunks (this rank's, in VPP order).
InferenceModel = Inference | Sequence[torch.nn.Module]


def _infer(model: InferenceModel, rollout: Rollout, batching: Batching | int,
           reduce: Callable[[torch.Tensor, RolloutMicro], torch.Tensor]) -> torch.Tensor:
    if isinstance(batching, int):
        batching = Batching(batching)
    parts = batching.split(rollout)
    shape = tuple(rollout.response_mask.shape)
    if isinstance(model, (list, tuple)):
        result = forward_only(model, parts, reduce, shape)
    else:
        result = model.infer_batch(parts, reduce, shape)
    if batching.budget is None:
        return result
    # rows came back in packing order: put them back in the rollout's
    order = torch.cat([m.index for m in parts]).to(result.device)
    out = torch.empty_like(result)
    out[order] = result
    return out


@torch.no_grad()
def infer_logprobs(model: InferenceModel, rollout: Rollout, vocab_size: int, micro_batch: Batching | int) -> torch.Tensor:
    """Forward-only log-probs of the responses, micro batch by micro batch (ref and old log-probs); at
    PP>1 through megatron's pipeline schedule, returned on every stage. `model`: a RoleEngine (or
    `AdaptersOff`) or model chunks; `micro_batch`: a `Batching`, or rows per padded micro batch."""
    def reduce(logits: torch.Tensor, part: RolloutMicro) -> torch.Tensor:
        return part.logprobs(logits, vocab_size, with_entropy=False)[0]

    return _infer(model, rollout, micro_batch, reduce) * rollout.response_mask


@torch.no_grad()
def infer_values(model: InferenceModel, rollout: Rollout, micro_batch: Batching | int) -> torch.Tensor:
    def reduce(output: torch.Tensor, part: RolloutMicro) -> torch.Tensor:
        return part.values(output)

    return _infer(model, rollout, micro_batch, reduce) * rollout.response_mask
