"""Built-in rewards (extractors, normalisation, format) and user reward functions."""

from __future__ import annotations

import sys
import textwrap
import time

import pytest

from trinity.config.schema import RewardConfig
from trinity.errors import UserError
from trinity.rewards.extract import extract_after_marker, extract_boxed, extract_last_number, normalize_answer
from trinity.rewards.loader import BUILTIN_REWARDS, load_reward_fn, reward_fn_from_config
from trinity.rewards.process import RewardResult


def test_extractors():
    assert extract_last_number("3 apples and 4.5 pears, total -1,234.") == "-1,234"
    assert extract_last_number("no digits") is None
    assert extract_boxed(r"so \boxed{1} or rather \boxed{\frac{3}{4}} done") == r"\frac{3}{4}"
    assert extract_boxed(r"\boxed{12") is None
    assert extract_boxed("nothing") is None
    assert extract_after_marker("work\n#### 72\nthanks") == "72"
    assert extract_after_marker("a #### 1 then ####\n\n  19 ") == "19"
    assert extract_after_marker("no marker") is None


@pytest.mark.parametrize("text", ["19", "19.0", " 19 ", "19.", "$19", "+19", "19.000"])
def test_normalize_numbers(text):
    assert normalize_answer(text) == "19"


def test_normalize_other_forms():
    assert normalize_answer("1,000") == normalize_answer("1000")
    assert normalize_answer("1.5") == normalize_answer("3/2")
    assert normalize_answer("0.1") != normalize_answer("0.10001")
    assert normalize_answer("  x  =  y ") == "x = y"


def test_math_exact_match_extractors():
    responses = ["The answer is 19.0", "I think 18", "so 7 apples"]
    answers = ["19", "19", None]
    fn = load_reward_fn("math_exact_match")
    assert fn(["p"] * 2, responses[:2], answers[:2]) == [1.0, 0.0]
    with pytest.raises(UserError, match="sample 2 has no reference answer"):
        fn(["p"] * 3, responses, answers)

    boxed = load_reward_fn("math_exact_match", extractor="boxed")
    assert boxed(["p"] * 3, [r"\boxed{ 3/4 }", r"0.75 \boxed{0.75}", "0.75"], ["0.75"] * 3) == [1.0, 1.0, 0.0]

    marker = load_reward_fn("math_exact_match", extractor="after_marker", marker="####")
    # a GSM8K full solution as the reference is reduced to the text after its marker
    assert marker(["p"] * 2, ["5 + 2 = 7\n#### 7", "#### 8"], ["5+2=7\n#### 7", "7"]) == [1.0, 0.0]


def test_unknown_extractor():
    with pytest.raises(UserError, match="reward.extractor"):
        load_reward_fn("math_exact_match", extractor="first_number")


def test_format_reward():
    fn = load_reward_fn("format", format_pattern=r"<think>.*</think>\s*<answer>.*</answer>")
    responses = ["<think>a\nb</think> <answer>1</answer>", "<answer>1</answer>", "<think>x</think><answer>1</answer> extra"]
    assert fn(["p"] * 3, responses, [None] * 3) == [1.0, 0.0, 0.0]
    with pytest.raises(UserError, match="reward.format_pattern: must be set"):
        load_reward_fn("format")
    with pytest.raises(UserError, match="invalid regex"):
        load_reward_fn("format", format_pattern="(")


def test_from_config_and_registry():
    assert set(BUILTIN_REWARDS) == {"math_exact_match", "format", "math_verify"}
    fn = reward_fn_from_config(RewardConfig(function="math_exact_match", extractor="boxed"))
    assert fn(["p"], [r"\boxed{2}"], ["2.0"]) == [1.0]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            def length_reward(prompts, responses, answers):
                return [len(r) / 10 for r in responses]

            def fragile(prompts, responses, answers):
                return [1.0 / (len(r) - 3) for r in responses]

            def wrong_count(prompts, responses, answers):
                return [1.0]

            def not_numbers(prompts, responses, answers):
                return ["high" for r in responses]

            NOT_A_FUNCTION = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_rewards", None)


def test_user_function_loads_and_scores(user_module):
    fn = load_reward_fn("my_rewards:length_reward")
    assert fn(["p", "q"], ["abcde", ""], ["x", None]) == [0.5, 0.0]
    by_path = load_reward_fn(f"{user_module / 'my_rewards.py'}:length_reward")
    assert by_path(["p"], ["ab"], [None]) == [0.2]


# --- the job's rewards: a worker process with a deadline (trinity.rewards.process) ---

MIXED = """
import math, time

def mixed(prompts, responses, answers):
    out = []
    for r in responses:
        if r == "hang":
            while True:
                time.sleep(0.01)
        if r == "raise":
            raise ValueError("cannot score " + r)
        out.append({"abc": "abc", "nan": math.nan, "inf": math.inf}.get(r, len(r)))
    return out
"""


def _guard(user_module, on_error: str):
    from trinity.rewards.process import GuardedReward

    (user_module / "mixed_rewards.py").write_text(MIXED)
    return GuardedReward(RewardConfig(function="mixed_rewards:mixed", timeout_s=0.5, on_error=on_error))


def _line(what: str, i: int, response: str, detail: str = "") -> str:
    line = f"reward function mixed_rewards:mixed {what} sample {i} (prompt 'p{i}', response {response!r})"
    return line + (f": {detail}" if detail else "")


def test_failing_samples_stop_the_job_with_one_line(user_module):
    """on_error: fail (the default): a reward that never returns is cut at its deadline (timeout_s per
    sample, then the samples alone), one that raises or returns no finite number is named at once."""
    guard = _guard(user_module, "fail")
    try:
        cases = [
            (["ok", "hang", "abcd"], _line("took longer than 0.5 s (reward.timeout_s: 0.5 per sample) on", 1, "hang")),
            (["ok", "ok", "raise"], _line("failed on", 2, "raise", "ValueError: cannot score raise")),
            (["abc", "ok"], _line("returned a non-number ('abc') for", 0, "abc")),
            (["ok", "nan"], _line("returned nan for", 1, "nan")),
            (["inf"], _line("returned inf for", 0, "inf")),
        ]
        for responses, line in cases:
            prompts = [f"p{i}" for i in range(len(responses))]
            with pytest.raises(UserError) as caught:
                guard.score(prompts, responses, [None] * len(responses))
            assert str(caught.value) == line
        # the worker stuck in the endless loop was replaced: the next batch scores as usual
        assert guard.score(["p0", "p1"], ["ab", "abcd"], [None, None]).scores == [2.0, 4.0]
    finally:
        guard.close()


def test_failing_samples_score_zero_with_their_lines(user_module):
    """on_error: zero: exactly one score per sample, 0 for each failing one, whose line is returned."""
    guard = _guard(user_module, "zero")
    try:
        responses = ["ab", "hang", "raise", "abc", "nan", "abcd"]
        started = time.monotonic()
        result = guard.score([f"p{i}" for i in range(6)], responses, [None] * 6)
        took = time.monotonic() - started
    finally:
        guard.close()
    assert result.scores == [2.0, 0.0, 0.0, 0.0, 0.0, 4.0]
    assert result.errors == [
        _line("took longer than 0.5 s (reward.timeout_s: 0.5 per sample) on", 1, "hang"),
        _line("failed on", 2, "raise", "ValueError: cannot score raise"),
        _line("returned a non-number ('abc') for", 3, "abc"),
        _line("returned nan for", 4, "nan"),
    ]
    assert took < 60, took  # the batch's 6 x 0.5 s, the sample's 0.5 s, and restarts: not a hang


def test_guarded_scores_are_the_functions_own(user_module):
    """The normal path: the same scores as the function called in this process, also for a built-in."""
    from trinity.rewards.process import GuardedReward

    responses, answers = [r"\boxed{19.0}", "18", "so 19", "19 then 20"], ["19"] * 4
    spec = RewardConfig(function="math_exact_match", extractor="boxed")
    builtin = GuardedReward(spec)
    user = GuardedReward(RewardConfig(function="my_rewards:length_reward"))
    try:
        assert builtin.score(["p"] * 4, responses, answers).scores == load_reward_fn(
            "math_exact_match", extractor="boxed")(["p"] * 4, responses, answers) == [1.0, 0.0, 0.0, 0.0]
        assert user.score(["p", "q"], ["abcde", ""], ["x", None]) == RewardResult([0.5, 0.0], [])
        # a built-in's UserError is the data's problem, never a sample to score 0
        with pytest.raises(UserError, match="sample 1 has no reference answer"):
            GuardedReward(spec.model_copy(update={"on_error": "zero"}))(["p", "q"], ["1", "2"], ["1", None])
    finally:
        builtin.close()
        user.close()


def test_user_function_bad_outputs(user_module):
    from trinity.rewards.process import GuardedReward

    guard = GuardedReward(RewardConfig(function="my_rewards:wrong_count"))
    try:
        with pytest.raises(UserError, match="must return a list of 2 floats, got 1 values"):
            guard(["p"] * 2, ["a", "b"], [None] * 2)
    finally:
        guard.close()
    with pytest.raises(UserError, match="reward function my_rewards:missing: module my_rewards has no attribute"):
        GuardedReward(RewardConfig(function="my_rewards:missing"))


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan")])
def test_timeout_must_be_positive_and_finite(value):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="timeout_s"):
        RewardConfig(timeout_s=value)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_module_xyz:f", "reward function no_such_module_xyz:f: cannot import no_such_module_xyz"),
        ("my_rewards:missing", "module my_rewards has no attribute 'missing'"),
        ("my_rewards:NOT_A_FUNCTION", "NOT_A_FUNCTION is a int, not a function"),
        ("exact_match", "'exact_match' is neither a built-in"),
        ("/nonexistent/r.py:f", "file /nonexistent/r.py does not exist"),
    ],
)
def test_user_function_load_errors(user_module, spec, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        load_reward_fn(spec)


def test_former_module_paths_of_the_shipped_rewards_still_load():
    """Configs written before the rewards had their own package name `trinity.rollout.<module>:function`:
    the loader, the validation and the plan read them as the module's name now."""
    import importlib
    import importlib.util
    from pathlib import Path

    from trinity.rewards import arithmetic_reward
    from trinity.rewards.loader import MOVED_MODULES, reward_code_file, reward_problems

    old = "trinity.rollout.arithmetic_reward:digit_fraction"
    assert load_reward_fn(old) is arithmetic_reward.digit_fraction
    assert reward_problems(old) == []
    assert Path(reward_code_file(old)).resolve() == Path(arithmetic_reward.__file__).resolve()
    (problem,) = reward_problems("trinity.rollout.arithmetic_reward:nope")
    assert problem.startswith("reward.function: ") and "does not define 'nope' at top level" in problem
    for former, now in MOVED_MODULES.items():
        assert importlib.util.find_spec(former) is None and importlib.import_module(now).__name__ == now
