"""The benchmark-only EOS schedule: response lengths drawn from a distribution, for random-weight models that
never emit EOS (benchmarks/generate.py --lengths, benchmarks/rl_step.py --lengths).

benchmarks/generate.py passes the drawn lengths to `generate_continuous(response_lengths=...)`. A real
`trinity run` (benchmarks/rl_step.py) gets them through `benchmarks/eos_hook/sitecustomize.py`: the
benchmark puts that folder on the job's PYTHONPATH with BENCH_LENGTHS_ENV set, and every process of the
job then wraps `trinity.rollout.continuous.generate_continuous` when it is imported (`patch`). Nothing
of this is read by trinity itself: without the hook, rows end at EOS or max_new_tokens.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any, Callable

import torch

BENCH_LENGTHS_ENV = "TRINITY_BENCH_RESPONSE_LENGTHS"


def draw_response_lengths(kind: str, rows: int, max_new: int, seed: int = 0) -> list[int]:
    """`rows` response lengths in 1..max_new: `fixed` (all max_new), `fixed:N` (all N: a fixed-length run
    with the real tokens of another distribution, under the same max_new), `uniform`, or `lognormal`
    (sigma 1, mean 30% of max_new before clipping at max_new)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "fixed":
        return [max_new] * rows
    if kind.startswith("fixed:") and kind[6:].isdigit():
        return [max(1, min(max_new, int(kind[6:])))] * rows
    if kind == "uniform":
        return torch.randint(1, max_new + 1, (rows,), generator=g).tolist()
    if kind == "lognormal":
        sigma = 1.0
        mu = math.log(0.3 * max_new) - sigma**2 / 2  # E[X] = exp(mu + sigma^2 / 2) = 0.3 max_new
        x = torch.exp(mu + sigma * torch.randn(rows, generator=g))
        return x.round().clamp(1, max_new).long().tolist()
    raise ValueError(f"response lengths {kind!r}: expected fixed, fixed:N, uniform or lognormal")


def schedule(kind: str | None) -> Callable[[int, int], list[int]] | None:
    """Lengths for each rollout of a job: (rows, max_new) -> lengths, seeded by the call count so that every
    rank of the job (which makes the same calls) draws the same; None for `fixed` or unset (no schedule)."""
    if not kind or kind == "fixed":
        return None
    calls = [0]

    def draw(rows: int, max_new: int) -> list[int]:
        calls[0] += 1
        return draw_response_lengths(kind, rows, max_new, seed=1000 + calls[0])

    return draw


def per_sample(kind: str, max_new: int, block: int = 4096) -> Callable[[int], int]:
    """Lengths for partial rollouts (trinity.rollout.partial), which name each answer by its sample id:
    sample -> its length, drawn `block` samples at a time (seeded by the block) and so the same in every
    rollout that continues it and on every rank."""
    cache: dict[int, list[int]] = {}

    def length(sample: int) -> int:
        b = sample // block
        if b not in cache:
            cache[b] = draw_response_lengths(kind, block, max_new, seed=2000 + b)
        return cache[b][sample % block]

    return length


def patch(continuous: ModuleType, kind: str | None) -> None:
    """Make `continuous.generate_continuous` (the module `trinity.rollout.continuous`) end rows after the
    schedule's lengths when its caller passes none (the RL recipe's `ActorRollout`), and the partial
    rollouts of `ActorRollout.generate_partial` end each answer after its sample's length (`per_sample`)."""
    draw = schedule(kind)
    if draw is None:
        return
    assert kind is not None
    partial = continuous.ActorRollout.generate_partial

    def scheduled_partial(self: Any, carried: Any, fresh: Any, params: Any, generator: Any = None, **kw: Any) -> Any:
        kw.setdefault("response_length", per_sample(kind, params.max_new_tokens))
        return partial(self, carried, fresh, params, generator, **kw)

    continuous.ActorRollout.generate_partial = scheduled_partial
    original = continuous.generate_continuous

    def scheduled(model: Any, prompts: Any, params: Any, **kw: Any) -> Any:
        if kw.get("response_lengths") is None:
            kw["response_lengths"] = draw(len(prompts), params.max_new_tokens)
        return original(model, prompts, params, **kw)

    continuous.generate_continuous = scheduled
