"""A conversation's tokens as the model saw and produced them, turned into training sequences.

Each turn's prompt is the chat template applied to the conversation so far
(`apply_chat_template(messages, tools=..., add_generation_prompt=True)`). The template's text is compared
with the text of the tokens the segment already holds (earlier prompts' ids and the sampled ids, decoded):
- it extends them: the new prompt is those same ids plus the encoding of the new text only, so every
  earlier id stays what the model saw or sampled (never re-tokenized), and the engine is given exactly
  the sequence that is later trained on;
- it does not (a template that re-renders earlier turns differently, e.g. Qwen3 drops the <think> block
  of turns before the last user message): with the `segment` policy the current sequence is closed as a
  training sequence of its own and a new one starts from the whole re-rendered prompt (its earlier
  assistant text is then context, masked out); with `fail`, `TemplateMismatch` names the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from trinity.config.schema.workflow import TemplatePolicy
from trinity.workflows.types import JSON, ChatTokenizer, Message, TrainingSequence


class TemplateMismatch(ValueError):
    """The rendered prompt does not extend the conversation's tokens (policy `fail`)."""


@dataclass
class _Segment:
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""  # the text of `tokens` as rendered and sampled

    def sequence(self) -> TrainingSequence:
        return TrainingSequence(tuple(self.tokens), tuple(self.mask), tuple(self.logprobs))


@dataclass(frozen=True)
class Prompt:
    """The next turn's prompt: `ids` (the segment's tokens, then `tail_ids`) and whether it opens a new
    segment."""

    ids: tuple[int, ...]
    tail_ids: tuple[int, ...]
    tail_text: str
    new_segment: bool


def render(tokenizer: ChatTokenizer, messages: Sequence[Message], tools: Sequence[dict[str, JSON]] | None,
           template_args: Mapping[str, JSON] | None = None) -> str:
    """The chat template's text of the next turn's prompt; `template_args`: the template's own variables
    (Qwen3's `enable_thinking`, for example)."""
    kwargs: dict[str, JSON] = dict(template_args or {})
    if tools:
        kwargs["tools"] = list(tools)
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True, **kwargs)


class Transcript:
    def __init__(self, tokenizer: ChatTokenizer, policy: TemplatePolicy = "segment",
                 template_args: Mapping[str, JSON] | None = None) -> None:
        self.tokenizer = tokenizer
        self.policy = policy
        self.template_args = dict(template_args or {})
        self._closed: list[_Segment] = []
        self._seg = _Segment()

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, messages: Sequence[Message], tools: Sequence[dict[str, JSON]] | None = None) -> Prompt:
        """The next turn's prompt (nothing is recorded until `record`)."""
        text = render(self.tokenizer, messages, tools, self.template_args)
        seg = self._seg
        if seg.tokens and text.startswith(seg.text):
            tail = text[len(seg.text):]
            tail_ids = self._encode(tail)
            return Prompt(tuple(seg.tokens) + tail_ids, tail_ids, tail, False)
        if seg.tokens and self.policy == "fail":
            at = next((i for i, (a, b) in enumerate(zip(seg.text, text)) if a != b), min(len(seg.text), len(text)))
            name = getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__
            raise TemplateMismatch(
                f"the chat template of tokenizer {name!r} re-renders the conversation so far differently at character "
                f"{at} (had {seg.text[at:at + 40]!r}, now {text[at:at + 40]!r}), so the new prompt does not extend "
                "the tokens the model saw; set the template mismatch policy to `segment` to train each part as "
                "its own sequence")
        ids = self._encode(text)
        return Prompt(ids, ids, text, bool(seg.tokens))

    def record(self, prompt: Prompt, output_ids: Sequence[int], logprobs: Sequence[float], output_text: str) -> None:
        """Append a turn: the prompt's new tokens (mask 0), then the sampled ids (mask 1, their log-probs);
        `output_text` is the sampled ids' text as the next render shows it."""
        if prompt.new_segment:
            self._closed.append(self._seg)
            self._seg = _Segment()
        seg = self._seg
        if tuple(seg.tokens) != prompt.ids[: len(seg.tokens)]:
            raise ValueError("record: the prompt does not extend this transcript (a prompt from another turn?)")
        seg.tokens += prompt.tail_ids
        seg.mask += [0] * len(prompt.tail_ids)
        seg.logprobs += [0.0] * len(prompt.tail_ids)
        seg.text += prompt.tail_text
        seg.tokens += list(output_ids)
        seg.mask += [1] * len(output_ids)
        seg.logprobs += [float(x) for x in logprobs]
        seg.text += output_text

    def sequences(self) -> tuple[TrainingSequence, ...]:
        """One training sequence per segment that holds an assistant token."""
        return tuple(s.sequence() for s in [*self._closed, self._seg] if any(s.mask))
