"""The `math_verify` built-in reward: equivalence of boxed / last-number answers, on values."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("math_verify")

from trinity.errors import UserError  # noqa: E402
from trinity.rewards.math_verify_reward import MathVerifyReward, extract_answer  # noqa: E402
from trinity.rewards.loader import load_reward_fn, reward_problems  # noqa: E402


def _score(responses: list[str], answers: list[str | None], **kw: str) -> list[float]:
    return MathVerifyReward(**kw)([""] * len(responses), responses, answers)


def test_builtin_is_registered_and_validated():
    fn = load_reward_fn("math_verify")
    assert isinstance(fn, MathVerifyReward) and fn.extractor == "last_number"
    assert reward_problems("math_verify") == []
    assert reward_problems("math_verify", extractor="nope") == [
        "reward.extractor: unknown extractor 'nope'; known: last_number, boxed, after_marker"
    ]


@pytest.mark.parametrize(
    "response,answer,want",
    [
        ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),  # fraction vs decimal
        ("So the result is \\boxed{2/4}", "\\frac{1}{2}", 1.0),
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),  # expression equivalence
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("7 + 5 = 12", "12", 1.0),  # last number
        ("It costs 1,000 dollars", "1000", 1.0),
        ("I think -3/2", "-1.5", 1.0),
        ("7 + 5 = 13", "12", 0.0),
        ("\\boxed{3} but later 4", "3", 1.0),  # a boxed answer wins over a later number
        ("no number here", "12", 0.0),
        ("\\boxed{x^2+1}", "x^2-1", 0.0),
    ],
)
def test_last_number_extractor_values(response, answer, want):
    assert _score([response], [answer]) == [want]


def test_boxed_and_after_marker_extractors():
    assert _score(["7 + 5 = 12", "\\boxed{12}"], ["12", "12"], extractor="boxed") == [0.0, 1.0]
    # a GSM8K-style reference is reduced to what follows its marker
    reference = "Natalia sold 48 clips in April and 24 in May.\n#### 72"
    assert _score(["work...\n#### 72.0", "#### 70"], [reference, reference], extractor="after_marker") == [1.0, 0.0]
    assert _score(["she sold 72 clips"], [reference]) == [1.0]


def test_extract_answer_parts():
    assert extract_answer("a \\boxed{\\frac{1}{\\sqrt{2}}} b 7", "last_number", "####") == "\\frac{1}{\\sqrt{2}}"
    assert extract_answer("1 then 2.5", "last_number", "####") == "2.5"
    assert extract_answer("1 then 2.5", "boxed", "####") is None


def test_missing_reference_names_the_sample():
    with pytest.raises(UserError, match="reward math_verify: sample 1 has no reference answer"):
        _score(["1", "2"], ["1", None])


def test_works_outside_the_main_thread():
    # math-verify's time limit uses SIGALRM, which only the main thread may set
    out: list[list[float]] = []
    t = threading.Thread(target=lambda: out.append(_score(["\\boxed{0.5}", "3"], ["1/2", "4"])))
    t.start()
    t.join()
    assert out == [[1.0, 0.0]]


@pytest.mark.parametrize(
    "response,answer,exact,verified",
    [  # the table of docs/rl.md (math_exact_match with its default extractor)
        ("So the result is \\boxed{2/4}", "\\frac{1}{2}", 0.0, 1.0),
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 0.0, 1.0),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 0.0, 1.0),
        ("7 + 5 = 12", "12", 1.0, 1.0),
        ("I think -3/2", "-1.5", 1.0, 1.0),
        ("\\boxed{3} but later 4", "3", 0.0, 1.0),
        ("7 + 5 = 13", "12", 0.0, 0.0),
    ],
)
def test_documented_comparison_with_exact_match(response, answer, exact, verified):
    assert load_reward_fn("math_exact_match")([""], [response], [answer]) == [exact]
    assert load_reward_fn("math_verify")([""], [response], [answer]) == [verified]
