"""The calculator tool (safe arithmetic over Python's `ast`, never `eval`) and a workflow that solves the tiny
assets' arithmetic task with it.

`evaluate` accepts numbers, + - * / // % **, unary + and -, and parentheses; anything else (names, calls,
attributes, subscripts, comparisons, strings, ...) is refused. Sizes are bounded before they are computed:
an expression of at most `MAX_CHARS` characters, exponents of at most `MAX_EXPONENT`, results of at most
`MAX_DIGITS` digits, so a call never runs long or eats memory.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from typing import Callable

from trinity.workflows.session import EpisodeLimit, Reply, Session
from trinity.workflows.tool_calls import TOOL_CALL_PARSERS
from trinity.workflows.types import JSON, Episode, Task

MAX_CHARS = 200
MAX_EXPONENT = 100
MAX_DIGITS = 100
_LIMIT = 10**MAX_DIGITS


class CalculatorError(ValueError):
    pass


Number = int | float
_BINARY: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}


def _check(value: Number) -> Number:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    if abs(value) >= _LIMIT:
        raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    return value


def _power(base: Number, exponent: Number) -> Number:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent} is larger than {MAX_EXPONENT}")
    if base != 0 and abs(base) != 1 and exponent > 0 and exponent * math.log10(abs(base)) >= MAX_DIGITS:
        raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    result = base ** exponent
    if isinstance(result, complex):
        raise CalculatorError("the result is not a real number")
    return result


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check(_power(left, right))
        fn = _BINARY.get(type(node.op))
        if fn is None:
            raise CalculatorError(f"operator {type(node.op).__name__} is not allowed")
        try:
            return _check(fn(left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
    raise CalculatorError(f"{type(node).__name__} is not allowed: only numbers, + - * / // % ** and parentheses")


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression; `CalculatorError` says why one is refused."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise CalculatorError(f"not an arithmetic expression: {e.msg if isinstance(e, SyntaxError) else e}") from None
    return _eval(tree)


def calculator(expression: str) -> str:
    """The tool: the value as text (integers exact, floats as Python prints them)."""
    return str(evaluate(expression))


CALCULATOR_TOOL: dict[str, JSON] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example (12+7)*3"}},
            "required": ["expression"],
        },
    },
}

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The last number in a reply's text outside its tool calls."""
    found = _NUMBER.findall(re.sub(r"<tool_call>.*?(</tool_call>|$)", "", text, flags=re.DOTALL))
    return found[-1] if found else None


TOOL_PROMPT = ("You can use a calculator: write <tool_call>{\"name\": \"calculator\", \"arguments\": "
               "{\"expression\": \"(12+7)*3\"}}</tool_call> and its result comes back.")


async def calculator_workflow(task: Task, session: Session, *, max_new_tokens: int | None = None,
                              tools_in_prompt: bool = False) -> Episode:
    """Task {"prompt": "12+7=", "answer": "19"} (`trinity.testing.tiny_assets.arithmetic_problem`): the model
    may call the calculator, each result comes back as a tool message, and the first reply without a tool
    call is the answer: reward 1 when its last number is the answer, else 0.

    The tool goes to the chat template as `tools=` (Qwen2.5, Qwen3 render it; a template that does not
    is refused, `ToolsNotSupported`); `tools_in_prompt`: described in the user message instead
    (`TOOL_PROMPT`, for templates without tools: the tiny assets', SmolLM2's), the reply parsed in Qwen's
    `<tool_call>` format all the same."""
    native = not tools_in_prompt
    hint = "" if native else " " + TOOL_PROMPT
    messages = [{"role": "user", "content": f"Compute {task['prompt']} Use the calculator tool if it helps, "
                                            f"then answer with the number.{hint}"}]
    try:
        while True:
            reply = await session.chat(messages, tools=[CALCULATOR_TOOL] if native else None,
                                       max_new_tokens=max_new_tokens)
            if not native:
                parsed = TOOL_CALL_PARSERS["qwen"].parse(reply.text)
                reply = Reply(reply.message, reply.finish, parsed.calls, parsed.errors)
            messages.append(reply.message)
            if not reply.tool_calls and not reply.tool_errors:
                correct = final_number(reply.text) == str(task["answer"])
                return session.finish(reward=1.0 if correct else 0.0)
            messages += await session.call_tools(reply, {"calculator": calculator})
    except EpisodeLimit as e:
        return session.finish(reward=0.0, end=e.reason)
