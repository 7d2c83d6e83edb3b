"""Preference pairs (DPO) -> padded rows, the two sequences of a pair in the same micro batch.

A record holds a prompt and two responses, in the common TRL / HF forms:
- `prompt`, `chosen`, `rejected` strings: the prompt is rendered as for SFT (one user turn through the
  chat template plus the generation prompt, raw text without one); each response is followed by EOS.
- `prompt` as a chat (a list of messages) and `chosen` / `rejected` as the assistant's answer (a list
  holding the assistant message(s), or a string).
- no `prompt`, `chosen` / `rejected` as whole conversations (HH-RLHF's conversational form): the prompt
  is every message before the last, which must be the assistant's answer; the two conversations must
  share it.
Loss is on the answer tokens only (and, for chats, the end-of-turn tokens the template writes), exactly
as `trinity.data.sft` marks them: the tokenisation helpers are shared.

Row 2i is pair i's chosen sequence, row 2i + 1 its rejected one, one sequence per row padded to
data.seq_length. `PreferenceData.next_global_batch()` gives this rank's micro batches of
`micro_batch_size` pairs: `tokens` etc. [2 x pairs, seq_len], chosen rows first, then rejected rows in
the same pair order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trinity.data.readers import Record
from trinity.data.sft import (
    Sample, Segment, SFTStats, has_chat_template, join_segments, render_prompt, tokenize_texts, trained_labels,
)
from trinity.errors import UserError


@dataclass(frozen=True)
class PreferenceKeys:
    """Field names of a preference record (data.prompt_key / chosen_key / rejected_key)."""

    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"


def _chat_answer(record: Record, key: str) -> list[dict[str, str]]:
    """A response given as a chat list: its messages (all assistant turns)."""
    chat = record.messages(key)
    if chat[-1]["role"] != "assistant":
        raise record.error(f"key {key!r}: the last message must be the assistant's answer, got role {chat[-1]['role']!r}")
    return chat


def _chat_pair_segments(record: Record, tokenizer: Any, prompt: list[dict[str, str]],
                        answer: list[dict[str, str]]) -> list[Segment]:
    """(prompt, no loss), (answer turns through the template, loss), (anything the template adds after)."""
    if not has_chat_template(tokenizer):
        raise record.error("chat messages need a tokenizer with a chat template; this one has none")
    before = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    after = tokenizer.apply_chat_template(prompt + answer, tokenize=False, add_generation_prompt=False)
    if not after.startswith(before):
        raise record.error(
            "the tokenizer's chat template renders the prompt differently once the answer is added, so the "
            "answer tokens cannot be located; use prompt/chosen/rejected strings instead"
        )
    return [(before, False), (after[len(before) :], True)]


def pair_segments(record: Record, tokenizer: Any, keys: PreferenceKeys) -> tuple[list[Segment], list[Segment]]:
    """Loss/no-loss text segments of a record's chosen and rejected sequences."""
    row = record.row
    for key in (keys.chosen_key, keys.rejected_key):
        if key not in row:
            raise record.error(f"missing key {key!r} (keys present: {sorted(row)}); a preference pair needs "
                               f"{keys.chosen_key!r} and {keys.rejected_key!r}")
    out = []
    if keys.prompt_key not in row:  # whole conversations: the prompt is everything before the last message
        chats = [_chat_answer(record, k) for k in (keys.chosen_key, keys.rejected_key)]
        prompt = chats[0][:-1]
        if not prompt or chats[1][:-1] != prompt:
            raise record.error(
                f"without a {keys.prompt_key!r} key, {keys.chosen_key!r} and {keys.rejected_key!r} must be "
                "conversations that share every message but the last (the assistant's answer)"
            )
        return tuple(_chat_pair_segments(record, tokenizer, prompt, [c[-1]]) for c in chats)  # type: ignore[return-value]
    prompt_value = row[keys.prompt_key]
    prompt: Any = record.messages(keys.prompt_key) if isinstance(prompt_value, list) else record.text(keys.prompt_key)
    for key in (keys.chosen_key, keys.rejected_key):
        if isinstance(row[key], list):
            answer = _chat_answer(record, key)
            chat = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            out.append(_chat_pair_segments(record, tokenizer, chat, answer))
            continue
        text = record.text(key)
        if not text.strip():
            raise record.error(f"key {key!r} is blank")
        eos = tokenizer.eos_token
        if not eos:
            raise UserError("tokenizer has no eos_token; set one in its tokenizer_config.json")
        out.append([(render_prompt(tokenizer, prompt), False), (text + eos, True)])
    return out[0], out[1]


def tokenize_pairs(records: Iterable[Record], tokenizer: Any, *, max_seq_len: int,
                   keys: PreferenceKeys = PreferenceKeys()) -> tuple[list[Sample], SFTStats]:
    """Samples [chosen 0, rejected 0, chosen 1, ...] of at most `max_seq_len` tokens (longer ones keep
    their first max_seq_len tokens); a pair where either sequence has no answer token left is dropped.
    Stats count pairs as samples."""
    per_seq: list[list[Segment]] = []
    wheres: list[str] = []
    for r in records:
        chosen, rejected = pair_segments(r, tokenizer, keys)
        per_seq += [chosen, rejected]
        wheres.append(r.where)
    flat_ids = tokenize_texts(tokenizer, [text for segments in per_seq for text, _ in segments])
    stats = SFTStats()
    samples: list[Sample] = []
    k = 0
    for i, where in enumerate(wheres):
        stats.records += 1
        pair: list[Sample] = []
        truncated = False
        for segments in per_seq[2 * i : 2 * i + 2]:
            ids, mask, k = join_segments(segments, flat_ids, k)
            if not trained_labels(mask):
                raise UserError(
                    f"{where}: nothing to train on: a response tokenises to no token after the prompt; the "
                    "tokenizer drops its text (is it this model's tokenizer?)"
                )
            if len(ids) > max_seq_len:
                ids, mask, truncated = ids[:max_seq_len], mask[:max_seq_len], True
            pair.append(Sample(ids, mask))
        if not all(trained_labels(s.loss_mask) for s in pair):
            stats.dropped += 1
            continue
        stats.truncated += truncated
        samples += pair
        stats.samples += 1
        stats.tokens += sum(len(s) for s in pair)
        stats.loss_tokens += sum(sum(s.loss_mask) for s in pair)
    return samples, stats


class PreferenceData:
    """Preference rows plus a sampler over pairs (trinity.data.loader.RowSampler): what the DPO recipe
    iterates. State (epoch, position) checkpoints like SFT's."""

    def __init__(self, rows: Any, sampler: Any, stats: SFTStats, source: str):
        self.rows, self.sampler, self.stats, self.source = rows, sampler, stats, source

    @property
    def num_pairs(self) -> int:
        return self.rows.num_rows // 2

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    @property
    def tokens_per_step(self) -> int:
        """Token positions per optimizer step over all DP ranks (both sequences, padding included)."""
        return 2 * self.sampler.global_batch_size * self.rows.seq_len

    def next_global_batch(self) -> list[dict[str, Any]]:
        import torch

        pairs = self.sampler.next_global_indices()
        out = []
        for micro in self.sampler.rank_micro_batches(pairs):
            rows = np.concatenate([2 * micro, 2 * micro + 1])  # chosen rows, then rejected rows
            out.append({name: torch.from_numpy(a) for name, a in self.rows.rows(rows).items()})
        return out

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def summary(self) -> str:
        s = self.stats
        return (f"{s.samples} pairs, {s.tokens} tokens ({s.loss_tokens} trained), {s.truncated} truncated, "
                f"{s.dropped} dropped as too long; sequences padded to {self.rows.seq_len} tokens, "
                f"{self.steps_per_epoch} steps per epoch")


def build_preference_data(
    files: Sequence[str | Path], tokenizer: Any, *, seq_len: int, global_batch_size: int, micro_batch_size: int,
    seed: int, dp_rank: int = 0, dp_size: int = 1, shuffle: bool = True, keys: PreferenceKeys = PreferenceKeys(),
) -> PreferenceData:
    """Read and tokenise preference files into padded rows (see module doc), with a sampler over pairs.
    Every rank builds the same rows and takes its own pairs of each step."""
    from trinity.data.loader import RowSampler, load_tokenizer, pad_token_id
    from trinity.data.packing import pad
    from trinity.data.readers import read_records

    tok = load_tokenizer(tokenizer)
    samples, stats = tokenize_pairs(read_records(files), tok, max_seq_len=seq_len, keys=keys)
    names = ", ".join(map(str, files))
    if not stats.records:
        raise UserError(f"{names}: no preference pairs; the training files hold no records")
    if not samples:
        raise UserError(
            f"{names}: all {stats.records} pairs were dropped as too long: no response token fits within "
            f"data.seq_length = {seq_len} tokens; raise data.seq_length or shorten the prompts"
        )
    rows = pad(samples, seq_len, pad_id=pad_token_id(tok))
    sampler = RowSampler(rows.num_rows // 2, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                         dp_rank=dp_rank, dp_size=dp_size, seed=seed, shuffle=shuffle)
    return PreferenceData(rows, sampler, stats, names)
