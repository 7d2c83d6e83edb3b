"""The bundled arithmetic rewards (trinity/rewards/arithmetic_reward.py) used by the tiny RL configs."""

from __future__ import annotations

import pytest

from trinity.rewards.arithmetic_reward import closeness, within_ten


def test_within_ten_grades_by_distance_and_gives_nothing_far_off():
    responses = ["25", "20", "24.0", "35", "-3", "no number", "7"]
    answers = ["25", "25", "25", "25", "3", "25", None]
    assert within_ten([""] * 7, responses, answers) == pytest.approx([1.0, 0.25, 0.45, 0.0, 0.2, 0.0, 0.0])


def test_closeness_is_the_gentle_slope():
    assert closeness(["", ""], ["20", "35"], ["25", "25"]) == pytest.approx([0.475, 0.45])


def test_digit_fraction_counts_ascii_digits_per_character():
    from trinity.rewards.arithmetic_reward import digit_fraction

    # Fullwidth and other non-ASCII digits do not count; an empty response earns 0.
    assert digit_fraction([""] * 5, ["12ab", "", "\uff11\uff12", "-25", "0000"], [None] * 5) == pytest.approx(
        [0.5, 0.0, 0.0, 2 / 3, 1.0]
    )
