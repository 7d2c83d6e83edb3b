"""SFT samples -> token ids with a loss mask on the response (assistant) tokens only.

A record is either `prompt`/`response` text or a chat `messages` list (key names configurable; the
chat wins when present). Both are first rendered to text *segments* marked loss or no-loss, then all
segments of all records are tokenised in batched calls (the Rust tokenizer does the work; 10k short
samples take well under a second) and concatenated.

Tokenising each segment on its own (rather than the whole text with offsets) keeps the prompt tokens
identical to what generation sees: at inference the rendered prompt is tokenised alone and the model
continues from its last token, so training must predict the response from exactly those tokens.

- prompt/response: the prompt is rendered with the tokenizer's chat template as one user turn plus the
  generation prompt (`<|im_start|>assistant\\n` for Qwen); without a chat template it is used as raw
  text. The response is followed by the tokenizer's EOS; loss is on response + EOS.
- messages: the conversation is rendered prefix by prefix to find where each assistant turn starts
  and ends; loss is on each assistant turn's content and its end-of-turn tokens, as the template
  renders them.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from trinity.data.readers import Record
from trinity.errors import UserError

# Texts per tokenizer call: large enough for the Rust batch path to pay off, small enough to bound memory.
TOKENIZE_CHUNK = 4096


@dataclass(frozen=True)
class Sample:
    """One tokenised sample: `loss_mask[i] == 1` means token i is a training target."""

    input_ids: list[int]
    loss_mask: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class SFTKeys:
    """Field names of an SFT record (data.prompt_key / response_key / messages_key)."""

    prompt_key: str = "prompt"
    response_key: str = "response"
    messages_key: str = "messages"


class Overlength(str, enum.Enum):
    """What to do with a sample longer than max_seq_len."""

    truncate = "truncate"  # keep the first max_seq_len tokens (dropped if no trained label is left)
    drop = "drop"


@dataclass
class SFTStats:
    """Counts to report after tokenisation."""

    samples: int = 0  # kept samples
    truncated: int = 0
    dropped: int = 0
    tokens: int = 0
    loss_tokens: int = 0  # tokens under the loss mask
    records: int = 0  # records read (kept + dropped)

    def summary(self) -> str:
        return (
            f"{self.samples} samples, {self.tokens} tokens ({self.loss_tokens} trained), "
            f"{self.truncated} truncated, {self.dropped} dropped as too long"
        )


Segment = tuple[str, bool]  # (text, is_loss)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _bos_text(tokenizer: Any) -> str:
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if bos and bos_id is not None and tokenizer("", add_special_tokens=True)["input_ids"][:1] == [bos_id]:
        return bos
    return ""


def with_bos(tokenizer: Any, text: str) -> str:
    """Raw text as a model reads it: with the BOS the tokenizer itself adds (texts are tokenised without
    special tokens). Gemma answers garbage without its <bos>."""
    return _bos_text(tokenizer) + text


def render_prompt(tokenizer: Any, prompt: str | list[dict[str, str]]) -> str:
    """The text a model is given to answer `prompt` (one user turn, or a chat without the answer).

    Shared by SFT and RL so that both see the same prompt text. Chat templates write their own BOS;
    raw text gets the BOS that the tokenizer itself would add (texts are tokenised without it).
    """
    if isinstance(prompt, str):
        if not has_chat_template(tokenizer):
            return with_bos(tokenizer, prompt)
        prompt = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def _render(tokenizer: Any, chat: list[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt)


def chat_segments(record: Record, tokenizer: Any, chat: list[dict[str, str]]) -> list[Segment]:
    """Segments of a conversation with loss on each assistant turn (content + end-of-turn tokens)."""
    if not has_chat_template(tokenizer):
        raise record.error("chat messages need a tokenizer with a chat template; this one has none")
    segments: list[Segment] = []
    done = ""  # text rendered into segments so far
    for i, message in enumerate(chat):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise record.error("the first message is an assistant turn; a conversation starts with a user")
        if not message["content"].strip():
            raise record.error(f"assistant message {i} is empty")
        before = _render(tokenizer, chat[:i], generation_prompt=True)
        after = _render(tokenizer, chat[: i + 1], generation_prompt=False)
        if not (before.startswith(done) and after.startswith(before)):
            raise record.error(
                "the tokenizer's chat template rewrites earlier turns when a turn is added, so the "
                "assistant tokens cannot be located; use prompt/response fields instead"
            )
        segments += [(before[len(done) :], False), (after[len(before) :], True)]
        done = after
    if not segments:
        raise record.error("no assistant message to train on")
    # Rendering is the slow part (Jinja); a chat that ends with its answer is already fully rendered.
    full = done if chat[-1]["role"] == "assistant" else _render(tokenizer, chat, generation_prompt=False)
    if not full.startswith(done):
        raise record.error("the tokenizer's chat template renders the whole chat differently from its turns")
    segments.append((full[len(done) :], False))
    return segments


def record_segments(record: Record, tokenizer: Any, keys: SFTKeys) -> list[Segment]:
    """Loss/no-loss text segments of one SFT record."""
    if keys.messages_key in record.row:
        return chat_segments(record, tokenizer, record.messages(keys.messages_key))
    prompt = record.text(keys.prompt_key)
    response = record.text(keys.response_key)
    if not response.strip():
        raise record.error(f"key {keys.response_key!r} is blank")
    eos = tokenizer.eos_token
    if not eos:
        raise UserError("tokenizer has no eos_token; set one in its tokenizer_config.json")
    return [(render_prompt(tokenizer, prompt), False), (response + eos, True)]


def join_segments(segments: Sequence[Segment], flat_ids: Sequence[list[int]], k: int) -> tuple[list[int], list[int], int]:
    """One sequence's token ids and loss mask from its segments, whose token ids are `flat_ids[k:]`
    (every segment of a batch is tokenised in one call); returns them and the next index into flat_ids."""
    ids: list[int] = []
    mask: list[int] = []
    for _, is_loss in segments:
        ids += flat_ids[k]
        mask += [int(is_loss)] * len(flat_ids[k])
        k += 1
    return ids, mask, k


def tokenize_texts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, without BOS/EOS added, in batched calls."""
    ids: list[list[int]] = []
    for start in range(0, len(texts), TOKENIZE_CHUNK):
        chunk = list(texts[start : start + TOKENIZE_CHUNK])
        ids += tokenizer(chunk, add_special_tokens=False)["input_ids"]
    return ids


def trained_labels(mask: Sequence[int]) -> int:
    """Tokens a sample trains on: loss-masked tokens after the first (the first token is never a label)."""
    return sum(mask[1:])


def tokenize_sft(
    records: Iterable[Record],
    tokenizer: Any,
    *,
    max_seq_len: int,
    keys: SFTKeys = SFTKeys(),
    overlength: Overlength = Overlength.truncate,
) -> tuple[list[Sample], SFTStats]:
    """Tokenise SFT records into samples of at most `max_seq_len` tokens, in record order.

    A record that tokenises to nothing to train on is an error naming it (the tokenizer dropped its
    text); a sample with no trained label left within `max_seq_len` is dropped as too long.
    """
    per_record: list[list[Segment]] = []
    wheres: list[str] = []  # file:line of each record (not the records: their rows can be large)
    for r in records:
        per_record.append(record_segments(r, tokenizer, keys))
        wheres.append(r.where)
    flat = [text for segments in per_record for text, _ in segments]
    flat_ids = tokenize_texts(tokenizer, flat)

    stats = SFTStats()
    samples: list[Sample] = []
    k = 0
    for where, segments in zip(wheres, per_record):
        stats.records += 1
        ids, mask, k = join_segments(segments, flat_ids, k)
        if not trained_labels(mask):
            raise UserError(
                f"{where}: nothing to train on: the sample tokenises to {len(ids)} token(s) with no response "
                "token after the first; the tokenizer drops its text (is it this model's tokenizer?)"
            )
        if len(ids) > max_seq_len:
            if overlength is Overlength.drop or not trained_labels(mask[:max_seq_len]):
                stats.dropped += 1
                continue
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
            stats.truncated += 1
        samples.append(Sample(ids, mask))
        stats.samples += 1
        stats.tokens += len(ids)
        stats.loss_tokens += sum(mask)
    return samples, stats
