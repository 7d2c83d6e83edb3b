"""Dense rewards for the bundled arithmetic task (`trinity tiny-assets`), used by the tiny RL configs.

Exact match alone is too sparse for a ~0.6M-parameter model: after the quickstart SFT it answers about
1% of the prompts right, so most GRPO groups have no signal. Both functions keep exact answers at 1.0 and
give wrong numbers partial credit that shrinks with their distance from the answer, so "about right"
(sign, magnitude, leading digit) is learnable in a few dozen steps on CPU:

- `closeness`: credit down to 0 at a distance of 100. On this task (answers -20..40) nearly every number
  earns 0.4-0.5, so the mean reward barely moves while the answers get closer (PPO config).
- `within_ten`: credit down to 0 at a distance of 10, so each step closer moves the reward by 0.05 and a
  number far off earns nothing.

Neither makes a mean reward rise clearly within a CPU minute: from the quickstart SFT export, 50 GRPO
steps moved the 10-step mean by -0.06 to +0.14 depending on the seed (docs/rl.md). `digit_fraction`
is the quickstart's GRPO demo instead: a task a random model learns in a few dozen steps, so that the
run shows GRPO learning, not arithmetic.

They are also the examples of a user reward function:
`reward.function: trinity.rewards.arithmetic_reward:closeness`.
"""

from __future__ import annotations

from fractions import Fraction

from trinity.rewards.extract import extract_last_number, normalize_answer

SCALE = 100.0  # distance at which closeness's partial credit reaches 0
NEAR_SCALE = 10.0  # the same for within_ten
PARTIAL = 0.5  # the most a wrong answer earns


def _value(text: str | None) -> Fraction | None:
    if text is None:
        return None
    try:
        return Fraction(normalize_answer(text))
    except (ValueError, ZeroDivisionError):
        return None


def _graded(responses: list[str], answers: list[str | None], scale: float) -> list[float]:
    scores = []
    for response, answer in zip(responses, answers, strict=True):
        got, want = _value(extract_last_number(response)), _value(answer)
        if got is None or want is None:
            scores.append(0.0)
        elif got == want:
            scores.append(1.0)
        else:
            scores.append(PARTIAL * max(0.0, 1.0 - float(abs(got - want)) / scale))
    return scores


def closeness(prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]:
    """1.0 for the exact answer; PARTIAL * max(0, 1 - |got - answer| / SCALE) for another number; 0 else."""
    return _graded(responses, answers, SCALE)


def within_ten(prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]:
    """1.0 for the exact answer; PARTIAL * max(0, 1 - |got - answer| / 10) for another number; 0 else."""
    return _graded(responses, answers, NEAR_SCALE)


def digit_fraction(prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]:
    """The share of the response's characters that are ASCII digits (0.0 for an empty response).

    A random model emits one of 259 byte tokens at each position, a digit about 4% of the time; rewarding
    digits teaches it the first thing an answer to these prompts needs, with signal in every group."""
    return [sum(c.isascii() and c.isdigit() for c in r) / len(r) if r else 0.0 for r in responses]
