"""Chat backends: the actor's own megatron-core model through today's rollout engines, a `RolloutEngine`
(what the RL recipe generates with: `EngineBackend`), and a scripted one.

`RolloutBackend` calls `trinity.rollout.continuous.generate_continuous` (or the reference generator the
tests compare engines with, `trinity.rollout.reference.reference_generate`) once per distinct sampling setting of a wave: those take one
`SamplingParams` per call. `ScriptedBackend` answers from a list of texts (a fixed policy: tests of the
conversation bookkeeping that need exact assistant text a random model never writes, e.g. a Qwen3 <think>
block).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch

from trinity.rollout.kv_budget import KVBudget
from trinity.rollout.types import Rollout, RolloutEngine, SamplingParams
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
class RolloutBackend:
    """A megatron GPTModel (or the rank's model chunks) behind a session, on every rank of its
    model-parallel group alike (the engines' own contract)."""

    model: torch.nn.Module | list[torch.nn.Module]  # a GPTModel (or DDP wrapper), or the rank's VPP chunks
    vocab_size: int  # the tokenizer's: padded vocabulary columns are never sampled
    pad_id: int
    engine: Literal["continuous", "reference"] = "continuous"
    budget: KVBudget = field(default_factory=KVBudget)
    generator: torch.Generator | None = None
    calls: int = 0  # engine calls made

    def _chunks(self) -> list[torch.nn.Module]:
        return list(self.model) if isinstance(self.model, (list, tuple)) else [self.model]

    def generate(self, requests: Sequence[TokenRequest]) -> list[TokenResult]:
        from trinity.rollout.continuous import generate_continuous
        from trinity.rollout.reference import reference_generate

        device = next(self._chunks()[0].parameters()).device
        if device.type == "cuda":  # the engine runs in the batcher's worker thread, whose device is cuda:0
            torch.cuda.set_device(device)
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
class EngineBackend:
    """A `RolloutEngine` behind the sessions (the RL recipe's: sequence parallel off, its KV budget), one
    engine call per distinct sampling setting of a wave. Each call's prompts go in a canonical order (by
    their token ids, ties in arrival order), so that which draws of `generator` a turn gets does not
    depend on which episode asked first (a tool's thread finishing sooner or later)."""

    engine: RolloutEngine
    generator: torch.Generator | None = None
    calls: int = 0  # engine calls made
    tokens: int = 0  # tokens sampled

    def generate(self, requests: Sequence[TokenRequest]) -> list[TokenResult]:
        if self.generator is not None and self.generator.device.type == "cuda":
            torch.cuda.set_device(self.generator.device)  # the batcher's worker thread starts on cuda:0
        groups: dict[SamplingParams, list[int]] = {}
        for i in sorted(range(len(requests)), key=lambda i: requests[i].prompt_ids):
            groups.setdefault(requests[i].sampling, []).append(i)
        results: list[TokenResult | None] = [None] * len(requests)
        for params, rows in groups.items():
            rollout = self.engine.generate([list(requests[i].prompt_ids) for i in rows], params, self.generator)
            self.calls += 1
            for i, result in zip(rows, _results(rollout, params.eos_token_ids)):
                results[i] = result
                self.tokens += len(result.token_ids)
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
