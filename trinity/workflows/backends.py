"""Chat backends: the actor's own megatron-core model (`RolloutBackend`: the continuous engine as a running
batch, or the static reference engine the tests compare it with), and a scripted one.

`RolloutBackend` with `engine="continuous"` streams (`open`): one open continuous engine
(`trinity.rollout.continuous.open_engine`, keyed draws) whose rows are the running batch's turns
(`trinity.workflows.stream.SchedulerStream`); the RL recipe's workflow sampling runs it over the actor's
model chunks. With `engine="reference"` it answers each step's new turns in one `reference_generate` call
(`generate`, through `trinity.workflows.stream.BatchStream`). `ScriptedBackend` answers from a list of texts
(a fixed policy: tests of the conversation bookkeeping that need exact assistant text a random model never
writes, e.g. a Qwen3 <think> block); it cannot stream, so the runner wraps it in
`trinity.workflows.stream.Batched`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Iterator, Literal, Sequence

import torch

from trinity.rollout.kv_budget import KVBudget
from trinity.rollout.types import Rollout, RolloutStats, SamplingParams
from trinity.workflows.stream import BatchStream, SchedulerStream, TurnStream
from trinity.workflows.types import ChatTokenizer, TokenRequest, TokenResult


def _results(rollout: Rollout, eos: Sequence[int]) -> list[TokenResult]:
    out = []
    for i in range(rollout.tokens.shape[0]):
        n = int(rollout.response_mask[i].sum())
        ids = tuple(int(t) for t in rollout.responses[i, :n])
        logp = tuple(float(x) for x in rollout.logprobs[i, :n])
        out.append(TokenResult(ids, logp, "stop" if ids and ids[-1] in eos else "length"))
    return out


@dataclass
class PrefillTotals:
    """Prompt tokens the prefill forwards computed, and those whose keys and values came from a parked slot."""

    prefilled_tokens: int = 0
    reused_tokens: int = 0


@dataclass
class RolloutBackend:
    """A megatron GPTModel (or the rank's model chunks) behind the sessions, on one rank (workflows run
    without model parallelism). `context_tokens`: the most tokens of a turn's prompt and response together
    (the sessions' `Limits.context_tokens`): the KV cache of a slot. `calls`: engines opened (continuous) or
    engine calls made (reference). `reuse`: a turn takes its conversation's parked KV slot and prefills only
    the tokens past what it holds (`trinity.workflows.stream.SchedulerStream`; off: every turn's prompt is
    prefilled whole, for a comparison). `stats`: what the continuous engines opened so far did, summed
    (prompt tokens prefilled and taken from parked slots)."""

    model: torch.nn.Module | list[torch.nn.Module]  # a GPTModel (or DDP wrapper), or the rank's VPP chunks
    vocab_size: int  # the tokenizer's: padded vocabulary columns are never sampled
    pad_id: int
    engine: Literal["continuous", "reference"] = "continuous"
    budget: KVBudget = field(default_factory=KVBudget)
    generator: torch.Generator | None = None
    context_tokens: int = 4096
    calls: int = 0
    seed: int | None = None  # the keyed draws' seed, drawn from `generator` when the first engine opens
    reuse: bool = True
    stats: PrefillTotals = field(default_factory=PrefillTotals)

    def _chunks(self) -> list[torch.nn.Module]:
        return list(self.model) if isinstance(self.model, (list, tuple)) else [self.model]

    def _set_device(self) -> torch.device:
        device = next(self._chunks()[0].parameters()).device
        if device.type == "cuda":  # the engine runs in the batcher's worker thread, whose device is cuda:0
            torch.cuda.set_device(device)
        return device

    @contextmanager
    def open(self, sampling: SamplingParams, rows: int) -> Iterator[TurnStream]:
        """The running batch (`trinity.workflows.stream.StreamBackend`); the reference engine: one call per
        step."""
        if self.engine == "reference":
            yield BatchStream(self)
            return
        from trinity.rollout.continuous import open_engine
        from trinity.rollout.sampler import draw_seed

        device = self._set_device()
        if self.seed is None:
            self.seed = int(draw_seed(self.generator, device))
        # every turn's prompt plus its max_new_tokens fits context_tokens (the session's limit): the engine's
        # token bound, each row limited to its own turn's max_new_tokens
        params = replace(sampling, max_new_tokens=self.context_tokens)
        self.calls += 1
        stats = RolloutStats()
        try:
            with open_engine(self.model, params, rows=rows, longest_prompt=0, vocab_size=self.vocab_size,
                             pad_id=self.pad_id, budget=self.budget, generator=self.generator, keyed=True,
                             seed=self.seed, stats=stats) as sched:
                yield SchedulerStream(sched, self.context_tokens, sampling.eos_token_ids, reuse=self.reuse)
        finally:
            self.stats.prefilled_tokens += stats.prefilled_tokens
            self.stats.reused_tokens += stats.reused_tokens

    def generate(self, requests: Sequence[TokenRequest]) -> list[TokenResult]:
        """One call per distinct sampling setting, in the requests' order."""
        from trinity.rollout.continuous import generate_continuous
        from trinity.rollout.reference import reference_generate

        self._set_device()
        groups: dict[SamplingParams, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(r.sampling, []).append(i)
        results: list[TokenResult | None] = [None] * len(requests)
        for params, rows in groups.items():
            prompts = [list(requests[i].prompt_ids) for i in rows]
            if self.engine == "continuous":
                rollout = generate_continuous(self.model, prompts, params, vocab_size=self.vocab_size,
                                              pad_id=self.pad_id, budget=self.budget, generator=self.generator)
            else:
                rollout = reference_generate(self.model, prompts, params, vocab_size=self.vocab_size,
                                             pad_id=self.pad_id, generator=self.generator)
            self.calls += 1
            for i, result in zip(rows, _results(rollout, params.eos_token_ids)):
                results[i] = result
        return [r for r in results if r is not None]


@dataclass
class ScriptedBackend:
    """Answers the k-th request with replies[k] (text encoded by `tokenizer`, then the request's first stop
    id), each token with log-prob `logprob`; records the prompts it saw."""

    tokenizer: ChatTokenizer
    replies: Sequence[str]
    logprob: float = -0.5
    prompts: list[tuple[int, ...]] = field(default_factory=list)

    def generate(self, requests: Sequence[TokenRequest]) -> list[TokenResult]:
        out = []
        for r in requests:
            k = len(self.prompts)
            if k >= len(self.replies):
                raise RuntimeError(f"ScriptedBackend: no reply {k} scripted")
            self.prompts.append(r.prompt_ids)
            ids = tuple(self.tokenizer.encode(self.replies[k], add_special_tokens=False))
            ids = ids[: r.sampling.max_new_tokens]
            stop = r.sampling.eos_token_ids[:1] if len(ids) < r.sampling.max_new_tokens else ()
            ids = ids + tuple(stop)
            out.append(TokenResult(ids, (self.logprob,) * len(ids), "stop" if stop else "length"))
        return out
