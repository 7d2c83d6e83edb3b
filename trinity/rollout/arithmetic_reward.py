"""A dense reward for the bundled arithmetic task (`trinity tiny-assets`), used by the tiny RL configs.

Exact match alone is too sparse for a ~0.5M-parameter model: after the quickstart SFT it answers about
1% of the prompts right, so most GRPO groups have no signal. `closeness` keeps exact answers at 1.0 and
gives wrong numbers partial credit that shrinks with their distance from the answer, so "about right"
(sign, magnitude, leading digit) is learnable in a few dozen steps on CPU. It is also the example of a
user reward function: `reward.function: trinity.rollout.arithmetic_reward:closeness`.
"""

from __future__ import annotations

from fractions import Fraction

from trinity.rollout.rewards import extract_last_number, normalize_answer

SCALE = 100.0  # distance at which partial credit reaches 0
PARTIAL = 0.5  # the most a wrong answer earns


def _value(text: str | None) -> Fraction | None:
    if text is None:
        return None
    try:
        return Fraction(normalize_answer(text))
    except (ValueError, ZeroDivisionError):
        return None


def closeness(prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]:
    """1.0 for the exact answer; PARTIAL * max(0, 1 - |got - answer| / SCALE) for another number; 0 else."""
    scores = []
    for response, answer in zip(responses, answers, strict=True):
        got, want = _value(extract_last_number(response)), _value(answer)
        if got is None or want is None:
            scores.append(0.0)
        elif got == want:
            scores.append(1.0)
        else:
            scores.append(PARTIAL * max(0.0, 1.0 - float(abs(got - want)) / SCALE))
    return scores
