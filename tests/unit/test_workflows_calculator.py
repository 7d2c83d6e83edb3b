"""The calculator tool's safe evaluator (what it computes, what it refuses) and Qwen's tool-call format."""

from __future__ import annotations

import pytest

from trinity.workflows.calculator import (
    MAX_DIGITS,
    CalculatorError,
    calculator,
    evaluate,
    final_number,
)
from trinity.workflows.tool_calls import TOOL_CALL_PARSERS, QwenToolCalls
from trinity.workflows.types import ToolCall


@pytest.mark.parametrize("expression,value", [
    ("12+7", 19), ("3-8", -5), ("-(2+3)*4", -20), ("7/2", 3.5), ("7//2", 3), ("-7 % 3", 2), ("2**10", 1024),
    ("+4", 4), ("2**-1", 0.5), ("(1.5+0.5)*3", 6.0), ("((((1))))", 1), (" 6 * 7 ", 42), ("10**99", 10**99),
])
def test_arithmetic(expression, value):
    assert evaluate(expression) == value and type(evaluate(expression)) is type(value)
    assert calculator(expression) == str(value)


@pytest.mark.parametrize("expression,why", [
    ("__import__('os').system('true')", "Call"),
    ("x + 1", "Name"),
    ("(1).real", "Attribute"),
    ("abs(-1)", "Call"),
    ("[1, 2][0]", "Subscript"),
    ("1 if 1 else 2", "IfExp"),
    ("1 < 2", "Compare"),
    ("'a' * 3", "Constant"),
    ("True + 1", "Constant"),
    ("1 << 2", "operator LShift"),
    ("lambda: 1", "Lambda"),
    ("9**9**9", "exponent"),
    ("2**1000", "exponent"),
    ("10**100", f"more than {MAX_DIGITS} digits"),
    ("99999999999**99", f"more than {MAX_DIGITS} digits"),
    ("(10**60) * (10**60)", f"more than {MAX_DIGITS} digits"),
    ("1e400", "not a finite number"),
    ("1e99 * 10.0", f"more than {MAX_DIGITS} digits"),
    ("1/0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0**-1", "division by zero"),
    ("(-8)**0.5", "not a real number"),
    ("1 +", "not an arithmetic expression"),
    ("1; 2", "not an arithmetic expression"),
    ("1" * 201, "longer than 200"),
])
def test_refusals(expression, why):
    with pytest.raises(CalculatorError, match=why.replace("(", r"\(")):
        evaluate(expression)


def test_final_number_skips_tool_calls():
    assert final_number('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call> 4') == "4"
    assert final_number('so -5.') == "-5" and final_number("no idea") is None
    assert final_number('<tool_call>{"arguments": {"expression": "7"}') is None  # unclosed: still a call


def test_qwen_tool_calls():
    parser = TOOL_CALL_PARSERS["qwen"]
    assert isinstance(parser, QwenToolCalls)
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+7"}}\n</tool_call>\n'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3*3\\"}"}</tool_call>')
    got = parser.parse(text)
    assert got.calls == (ToolCall("calculator", {"expression": "12+7"}), ToolCall("calculator", {"expression": "3*3"}))
    assert got.errors == ()
    assert parser.parse("just 19").calls == () and parser.parse("just 19").errors == ()


def test_qwen_malformed_tool_calls_become_errors():
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}</tool_call>'  # one brace short
            '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
            '<tool_call>["calculator"]</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {')
    got = QwenToolCalls().parse(text)
    assert got.calls == (ToolCall("calculator", {"expression": "2+2"}),)
    assert len(got.errors) == 4
    assert got.errors[0].startswith("error: tool call 1 is not valid JSON (")
    assert got.errors[1] == 'error: tool call 3 needs a JSON object with a "name" string'
    assert got.errors[2] == 'error: tool call 4 "arguments" must be a JSON object'
    assert got.errors[3] == "error: a <tool_call> block is not closed with </tool_call>"
