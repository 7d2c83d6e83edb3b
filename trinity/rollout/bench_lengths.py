"""The benchmark-only EOS schedule: response lengths drawn from a distribution, for random-weight models
that never emit EOS (benchmarks/rl_step.py --lengths, benchmarks/generate.py). The rollout reads it
through the TRINITY_BENCH_RESPONSE_LENGTHS environment variable; unset, rows end at EOS or
max_new_tokens as in every real run.
"""

from __future__ import annotations

import math
import os

import torch

BENCH_LENGTHS_ENV = "TRINITY_BENCH_RESPONSE_LENGTHS"
_bench_calls = [0]  # seeds each draw: every rank of a job makes the same calls, so draws the same


def bench_response_lengths(rows: int, max_new: int) -> list[int] | None:
    """Benchmark-only EOS schedule (benchmarks/rl_step.py --lengths): with TRINITY_BENCH_RESPONSE_LENGTHS
    set to `uniform`, `lognormal` or `fixed:N`, each row ends after a drawn number of tokens (see
    `draw_response_lengths`), seeded by the call count so that every rank of a job draws the same;
    `fixed` or unset: no schedule (rows end at EOS or max_new_tokens)."""
    kind = os.environ.get(BENCH_LENGTHS_ENV, "fixed")
    if kind == "fixed":
        return None
    _bench_calls[0] += 1
    return draw_response_lengths(kind, rows, max_new, seed=1000 + _bench_calls[0])


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
