"""RL prompt datasets: prompt (or chat) + ground-truth answer, tokenised as generation will see them.

A record has a `prompt` string or a `messages` chat (the chat wins when present; it must not end with
an assistant turn), and an `answer` (string or number) for the reward function; key names are
configurable. Prompts are rendered with the chat template plus the generation prompt, exactly as SFT
renders its prompts (`sft.render_prompt`), and truncated from the left to `max_prompt_length` tokens
(the end of a prompt, next to the answer, matters most).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trinity.data.loader import RowSampler, load_tokenizer
from trinity.data.readers import Record, read_records
from trinity.data.sft import has_chat_template, render_prompt, tokenize_texts
from trinity.errors import UserError


class RankState(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Prompt:
    """One RL prompt: token ids to generate from, the answer for the reward, and its origin."""

    prompt_ids: list[int]
    answer: str
    text: str  # the rendered prompt text (before truncation)
    source: str  # "file:line", to trace a surprising reward back to the data


@dataclass(frozen=True)
class PromptKeys:
    """Field names of an RL record (data.prompt_key / messages_key / answer_key)."""

    prompt_key: str = "prompt"
    messages_key: str = "messages"
    answer_key: str = "answer"


def _prompt_text(record: Record, tokenizer: Any, keys: PromptKeys) -> str:
    if keys.messages_key in record.row:
        chat = record.messages(keys.messages_key)
        if chat[-1]["role"] == "assistant":
            raise record.error(f"{keys.messages_key} ends with an assistant turn; a prompt ends before the answer")
        if not has_chat_template(tokenizer):
            raise record.error("chat messages need a tokenizer with a chat template; this one has none")
        return render_prompt(tokenizer, chat)
    return render_prompt(tokenizer, record.text(keys.prompt_key))


def _short(text: str, n: int = 40) -> str:
    return repr(text[:n] + ("..." if len(text) > n else ""))


def tokenize_prompts(
    records: Iterable[Record], tokenizer: Any, *, max_prompt_length: int, keys: PromptKeys = PromptKeys()
) -> tuple[list[Prompt], int]:
    """Prompts in record order, and how many were truncated (from the left) to max_prompt_length."""
    rendered = [(r, _prompt_text(r, tokenizer, keys), r.answer(keys.answer_key)) for r in records]
    ids = tokenize_texts(tokenizer, [text for _, text, _ in rendered])
    prompts: list[Prompt] = []
    truncated = 0
    for (record, text, answer), prompt_ids in zip(rendered, ids):
        if not prompt_ids:
            raise record.error(
                f"the prompt tokenises to no tokens ({_short(text)}); the tokenizer drops its text "
                "(is it this model's tokenizer?)"
            )
        if len(prompt_ids) > max_prompt_length:
            prompt_ids = prompt_ids[-max_prompt_length:]
            truncated += 1
        prompts.append(Prompt(prompt_ids, answer, text, record.where))
    return prompts, truncated


class PromptData:
    """Prompts plus their sampler. `next_batch()` gives this rank's prompts of the next step.

    A step uses `batch_size` prompts over all data-parallel ranks, `batch_size / dp_size` per rank;
    order, sharding and resumption follow `loader.RowSampler`.
    """

    def __init__(self, prompts: list[Prompt], sampler: RowSampler, truncated: int):
        self.prompts, self.sampler, self.truncated = prompts, sampler, truncated
        # what a checkpoint saves per rank beside the data position rank 0 saves (partial rollouts: each
        # rank's own position and carried groups; trinity.trainer.checkpoint)
        self.rank_state: RankState | None = None

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    def next_batch(self) -> list[Prompt]:
        return [self.prompts[i] for i in self.next_indices()]

    def next_indices(self) -> list[int]:
        """This rank's prompts of the next step, as indices into `prompts` (partial rollouts take them one
        by one: trinity.trainer.recipes.rl_partial)."""
        (mine,) = self.sampler.rank_micro_batches(self.sampler.next_global_indices())
        return [int(i) for i in mine]

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def summary(self) -> str:
        return (
            f"{self.num_prompts} prompts ({self.truncated} truncated from the left), "
            f"{self.steps_per_epoch} steps per epoch"
        )


def build_prompt_data(
    files: Sequence[str | Path],
    tokenizer: Any,
    *,
    batch_size: int,
    max_prompt_length: int,
    seed: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    shuffle: bool = True,
    prompt_key: str = "prompt",
    messages_key: str = "messages",
    answer_key: str = "answer",
) -> PromptData:
    """Read and tokenise RL prompt files (data.train_files) with a sampler of `batch_size` prompts a step."""
    if batch_size % dp_size:
        raise UserError(f"data.train_batch_size ({batch_size}) must be a multiple of the data-parallel size ({dp_size})")
    tok = load_tokenizer(tokenizer)
    keys = PromptKeys(prompt_key=prompt_key, messages_key=messages_key, answer_key=answer_key)
    prompts, truncated = tokenize_prompts(read_records(files), tok, max_prompt_length=max_prompt_length, keys=keys)
    if not prompts:
        raise UserError(f"{', '.join(map(str, files))}: no prompts; the training files hold no records")
    sampler = RowSampler(
        len(prompts),
        global_batch_size=batch_size,
        micro_batch_size=batch_size // dp_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        shuffle=shuffle,
        what="data.train_batch_size",
    )
    return PromptData(prompts, sampler, truncated)


def prompt_data_from_job(job: Any, *, dp_rank: int, dp_size: int, tokenizer: Any = None) -> PromptData:
    """`build_prompt_data` with the settings of a validated JobConfig (data.*, trainer.seed, model.*)."""
    data = job.data
    return build_prompt_data(
        data.train_files,
        tokenizer if tokenizer is not None else (job.model.tokenizer_path or job.model.path),
        batch_size=data.train_batch_size,
        max_prompt_length=data.max_prompt_length,
        seed=job.trainer.seed,
        dp_rank=dp_rank,
        dp_size=dp_size,
        shuffle=data.shuffle,
        prompt_key=data.prompt_key,
        messages_key=data.messages_key,
        answer_key=data.answer_key,
    )
