"""What a rollout engine takes and gives back, and the interface any rollout engine offers.

`SamplingParams` in, `Rollout` out; `RolloutEngine` is what the RL recipes call. The built-in engine
is `trinity.rollout.continuous.ActorRollout` (continuous batching over the actor's own megatron-core model);
another (vLLM, SGLang, a remote server) only has to return the same `Rollout`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 128
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Rollout:
    """A batch of sequences `[prompt (left-padded) | response (right-padded)]`.

    tokens [B, P + R]; prompt_mask [B, P] (1 on real prompt tokens); response_mask [B, R] (1 on generated
    tokens up to and including EOS); logprobs [B, R] fp32 (see module doc; 0 where the mask is 0).
    """

    tokens: torch.Tensor
    prompt_mask: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor

    @property
    def prompt_len(self) -> int:
        return self.prompt_mask.shape[1]

    @property
    def response_len(self) -> int:
        return self.response_mask.shape[1]

    @property
    def responses(self) -> torch.Tensor:
        return self.tokens[:, self.prompt_len :]

    def attention_pad_mask(self) -> torch.Tensor:
        """[B, P + R] 1 where a key is a real token (prompt padding is 0; response tail counts as real:
        only tokens after EOS look at it, and they are masked out of every loss)."""
        ones = torch.ones_like(self.response_mask)
        return torch.cat([self.prompt_mask, ones], dim=1)

    def select(self, index: torch.Tensor | slice) -> "Rollout":
        return Rollout(self.tokens[index], self.prompt_mask[index], self.response_mask[index], self.logprobs[index])


@dataclass
class RolloutStats:
    """What the last `generate` call did (benchmarks/rl_step.py and the tests read it)."""

    rows: int = 0
    slots: int = 0
    cache_len: int = 0
    kv_bytes_per_token: int = 0
    prefill_calls: int = 0
    prefilled_prompts: int = 0
    prefilled_tokens: int = 0  # prompt tokens the prefill forwards computed (a prompt shared by samples once)
    reused_tokens: int = 0  # prompt tokens whose keys and values a parked slot held (multi-turn workflows)
    decode_steps: int = 0
    live_kv_tokens: int = 0  # sum over decode steps of the live rows' context lengths (KV read floor)
    read_kv_tokens: int = 0  # the same with a prompt's keys counted once per step where its samples share them
    slot_steps: int = 0  # sum over decode steps of the batch bucket (rows computed, live or not)
    tokens: int = 0
    attention: str = ""  # the decode attention: "triton split-KV" (CUDA) or "sdpa"
    bucket_note: str = ""  # batch buckets left out of the ladder as slower than a larger one (`decode_buckets`)
    sampler: str = ""  # "fused" (one Triton pass over the logits) or "torch"
    graph_tail: bool = False  # sampling and bookkeeping captured in the decode step's CUDA graph
    graph_captures: int = 0
    capture_s: float = 0.0
    waves: int = 0  # admissions
    time_buckets: bool = False  # set by the caller: time every decode step, per batch bucket (`BucketTime`)
    buckets: dict[int, "BucketTime"] = field(default_factory=dict)  # batch bucket -> its steps (time_buckets)
    prefill_ms: float = 0.0  # the prefill forwards' time (time_buckets; on CUDA GPU time between events)

    def bucket_lines(self) -> list[str]:
        """The decode steps per batch bucket (`time_buckets`) as the lines of a table, for a profiled RL
        step's summary (trinity.trainer.profiling); [] when they were not timed."""
        if not self.buckets:
            return []
        total = sum(t.ms for t in self.buckets.values())
        lines = [f"rollout: {self.decode_steps} decode steps, {total:.1f} ms in them; per batch bucket",
                 "bucket | steps | live rows per step | ms per step | share of the steps' time"]
        for b in sorted(self.buckets, reverse=True):
            t = self.buckets[b]
            lines.append(f"{b} | {t.steps} | {t.live_rows / t.steps:.0f} | {t.ms / t.steps:.3f} | "
                         f"{100 * t.ms / max(total, 1e-9):.1f}%")
        if self.bucket_note:
            lines.append(f"(left out as slower than a larger bucket: {self.bucket_note})")
        return lines

    @property
    def computed_tokens(self) -> int:
        """Tokens the engine computed: each row's first (from its prefill) and every decode step's batch
        bucket, rows that had ended or held nothing included."""
        return self.rows + self.slot_steps


@dataclass
class BucketTime:
    """The decode steps of one batch bucket (`RolloutStats.time_buckets`). On CUDA `ms` is GPU time between
    events recorded around each step (its layers, sampling and bookkeeping; not the host's gaps between
    steps), on CPU the wall time of each (synchronous) step."""

    steps: int = 0
    ms: float = 0.0
    live_rows: int = 0  # sum over the steps of the rows not yet retired
    live_kv_tokens: int = 0
    read_kv_tokens: int = 0


class RolloutEngine(Protocol):
    """Generates `max_new_tokens` (at most) after each prompt; every rank of a model-parallel group
    returns the same `Rollout`. `stats` describes the last call (an engine that measures nothing leaves
    the defaults); `time_buckets`, set by the caller (a profiled step), asks it to time its decode steps
    per batch bucket.

    An engine that decodes with the training modules themselves (the built-in one) runs them as they are
    configured: the RL recipe wraps it in `trinity.trainer.recipes.rl.SequenceParallelOff`, itself a
    `RolloutEngine`, which switches sequence parallel off around `generate` (one token per decode step
    cannot be split over TP ranks)."""

    stats: RolloutStats
    time_buckets: bool

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generator: torch.Generator | None = None) -> Rollout: ...
