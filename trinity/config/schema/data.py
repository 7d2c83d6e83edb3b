"""The `data:` block: training and validation files, their keys, lengths and batches, and the one parser
of data.train_files' accepted forms (`split_train_files`).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from trinity.config.megatron import StrictModel


def split_train_files(value: Any) -> tuple[list[str], list[float] | None]:
    """`data.train_files` in any accepted form -> (paths, blend weights or None). The one place the
    forms are told apart:

    - a list of paths (`[a.jsonl, b.jsonl]`), or one path as a string;
    - a list of `{path, weight}` mappings (weight defaults to 1);
    - Megatron-LM's `--data-path` form, `weight path weight path ...`, as a list (`[0.3, a, 0.7, b]`)
      or one whitespace-separated string (`"0.3 a 0.7 b"`).

    Raises ValueError with the fix when the value is none of these.
    """

    def number(x: Any) -> float | None:
        if isinstance(x, bool):
            return None
        if isinstance(x, (int, float)):
            return float(x)
        if isinstance(x, str):
            try:
                return float(x)
            except ValueError:
                return None
        return None

    if isinstance(value, str):
        value = value.split() if len(value.split()) > 1 and number(value.split()[0]) is not None else [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError("must be a list of paths, of {path, weight} mappings, or Megatron's `weight path ...` pairs")
    items = list(value)
    if items and all(isinstance(x, dict) for x in items):
        paths, weights = [], []
        for i, x in enumerate(items):
            if set(x) - {"path", "weight"} or not isinstance(x.get("path"), str):
                raise ValueError(f"entry {i} must be a mapping of `path` (a string) and optional `weight`, got {x}")
            w = number(x.get("weight", 1.0))
            if w is None:
                raise ValueError(f"entry {i} ({x['path']}): weight must be a number, got {x.get('weight')!r}")
            paths.append(x["path"])
            weights.append(w)
        return paths, weights
    if items and number(items[0]) is not None:
        if len(items) % 2 or any(number(w) is None for w in items[::2]) or not all(isinstance(p, str) for p in items[1::2]):
            raise ValueError(
                "Megatron's form alternates weights and paths (`weight path weight path ...`); got an odd "
                "number of entries or a weight that is not a number"
            )
        return [str(p) for p in items[1::2]], [number(w) for w in items[::2]]  # type: ignore[misc]
    if not all(isinstance(x, str) for x in items):
        raise ValueError("mixes paths and other entries; use only paths, only {path, weight} mappings, or `weight path` pairs")
    return items, None


class DataConfig(StrictModel):
    """Local training data (jsonl or parquet)."""

    train_files: list[str] = Field(default_factory=list)
    """Training files: SFT samples (prompt/response or messages) or RL prompts (prompt + answer), as .jsonl,
    .json (an array of objects; alpaca's instruction/input/output and ShareGPT's conversations are read as
    prompt/response and messages), .parquet, or a Hugging Face `datasets` folder written by save_to_disk
    (its train split; needs `pip install datasets`). For pt:
    text files (.jsonl/.json/.parquet with data.text_key, plain .txt/.md) and Megatron indexed datasets
    (their path prefix, without .bin/.idx); a blend is `[{path: a, weight: 0.3}, {path: b, weight: 0.7}]`
    or Megatron's `[0.3, a, 0.7, b]`: the weights move to data.train_weights."""
    train_weights: list[float] | None = None
    """pt: blend weights, one per train_files entry (normally written inline in train_files); each
    epoch draws rows from the files in these proportions. Unset: every row of every file once per epoch."""
    text_key: str = "text"
    """pt: field holding a document's text in .jsonl/.json/.parquet files."""
    prompt_key: str = "prompt"
    """Field holding the prompt text."""
    response_key: str = "response"
    """SFT: field holding the target response text."""
    messages_key: str = "messages"
    """Field holding a chat (list of {role, content}); used when present instead of prompt/response."""
    answer_key: str = "answer"
    """RL: field holding the ground-truth answer passed to the reward function."""
    val_files: list[str] = Field(default_factory=list)
    """Held-out files in the training files' format, evaluated before the first step
    (trainer.val_before_train), every trainer.val_interval steps and after the last step: SFT logs the
    loss over all their samples (`val/loss`), RL the mean reward of one greedy response per prompt
    (`val/reward_mean`, pass@1; sampled responses with actor_rollout_ref.rollout.val_kwargs). Empty: no
    evaluation."""
    chosen_key: str = "chosen"
    """dpo: field holding the preferred response (a string, or a list of chat messages ending with the
    assistant's answer)."""
    rejected_key: str = "rejected"
    """dpo: field holding the dispreferred response (same form as chosen_key)."""
    seq_length: int = Field(default=1024, ge=8)
    """SFT and pt: tokens per training row (samples are packed into or padded to this length). dpo:
    tokens per sequence (prompt + chosen or prompt + rejected, each padded to it; longer ones truncated)."""
    packing: bool = True
    """SFT: pack several samples per row with per-document attention masks instead of padding. On CUDA our
    layer spec runs flash attention over the document boundaries (no [b, 1, s, s] mask); CPU layers
    gather each row's documents into a batch of their own; TransformerEngine uses the dense block mask.
    pt: default false (documents concatenated with EOS and cut
    into rows, attention across documents, no padding: Megatron-LM's default); true packs documents
    whole (split at seq_length) with per-document attention. dpo: false (one sequence per row)."""
    shuffle: bool = True
    """Shuffle rows each epoch (deterministically from trainer.seed)."""
    max_prompt_length: int = Field(default=256, ge=1)
    """RL: prompts longer than this (in tokens) are truncated from the left."""
    train_batch_size: int = Field(default=8, ge=1)
    """RL: prompts per training step (each gets rollout.n responses)."""

    @model_validator(mode="before")
    @classmethod
    def _split_blend(cls, data: Any) -> Any:
        """Weighted forms of train_files -> paths + train_weights (a malformed value is left for the
        field check below, which names data.train_files)."""
        if not isinstance(data, dict) or "train_files" not in data:
            return data
        try:
            paths, weights = split_train_files(data["train_files"])
        except ValueError:
            return data
        data = {**data, "train_files": paths}
        if weights is not None:
            data["train_weights"] = weights
        return data

    @field_validator("train_files", mode="before")
    @classmethod
    def _check_train_files(cls, value: Any) -> Any:
        try:
            return split_train_files(value)[0]
        except ValueError as exc:
            raise PydanticCustomError("train_files", str(exc)) from None
