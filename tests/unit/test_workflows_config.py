"""The `workflow:` config model (not part of the job config yet): function names, limits, the runner's Limits."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trinity.config.schema.workflow import Limits, WorkflowConfig


def test_defaults_are_the_runners():
    cfg = WorkflowConfig(function="guess_number")
    assert cfg.limits() == Limits()
    cfg = WorkflowConfig(function="my_pkg.flows:play", args={"level": 3, "names": ["a"], "opts": {"x": None}},
                         max_turns=4, context_tokens=512, turn_timeout_s=5, episode_timeout_s=30, on_error="zero",
                         template_mismatch="fail", template_args={"enable_thinking": False})
    assert cfg.limits() == Limits(4, 512, 5.0, 30.0, "zero", "fail")
    assert cfg.args == {"level": 3, "names": ["a"], "opts": {"x": None}}
    assert cfg.template_args == {"enable_thinking": False}


@pytest.mark.parametrize("function", ["calculatr", "my_pkg.flows", "my_pkg.flows:", ":play", "my-pkg:play",
                                      "a:b:c", "os.system('x'):y", ""])
def test_function_must_be_a_builtin_or_module_attr(function):
    with pytest.raises(ValidationError, match="neither a built-in workflow .calculator, guess_number. nor "
                                              "module.path:function"):
        WorkflowConfig(function=function)


@pytest.mark.parametrize("key,value", [("max_turns", 0), ("context_tokens", -1), ("turn_timeout_s", 0),
                                       ("episode_timeout_s", float("inf")), ("on_error", "skip"),
                                       ("template_mismatch", "retokenize"), ("max_turn", 3)])
def test_limits_are_checked(key, value):
    with pytest.raises(ValidationError, match=key):
        WorkflowConfig(function="calculator", **{key: value})


def test_runner_limits_refuse_nonpositive_values():
    with pytest.raises(ValueError, match="max_turns must be at least 1, got 0"):
        Limits(max_turns=0)
    with pytest.raises(ValueError, match="episode_timeout_s must be positive, got -1"):
        Limits(episode_timeout_s=-1)
    with pytest.raises(ValueError, match="on_error must be fail or zero, got 'skip'"):
        Limits(on_error="skip")
