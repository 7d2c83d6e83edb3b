"""Tool calls in a model family's own format, and whether a tokenizer's chat template shows tools at all.

Parsers are keyed by format name (`TOOL_CALL_PARSERS`); `parser_for` picks one from the template's text.
Qwen2.5 and Qwen3 templates ask for `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per
call, several allowed in one turn. A malformed block is not dropped silently: it becomes an error message
that the workflow sends back to the model as the tool's answer (`ParsedCalls.errors`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol

from trinity.workflows.types import ToolCall


class ToolsNotSupported(ValueError):
    """The tokenizer's chat template has no `tools` variable: tools= would be ignored silently."""


@dataclass(frozen=True)
class ParsedCalls:
    calls: tuple[ToolCall, ...]
    errors: tuple[str, ...]


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedCalls: ...


_QWEN_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class QwenToolCalls:
    """`<tool_call>\\n{"name": "calculator", "arguments": {"expression": "1+2"}}\\n</tool_call>` (arguments
    may also come as a JSON string holding an object, as some fine-tunes write them)."""

    def parse(self, text: str) -> ParsedCalls:
        calls: list[ToolCall] = []
        errors: list[str] = []
        for k, match in enumerate(_QWEN_BLOCK.finditer(text), 1):
            call, error = self._one(match.group(1).strip())
            if call is not None:
                calls.append(call)
            else:
                errors.append(f"error: tool call {k} {error}")
        unclosed = text.count("<tool_call>") - len(calls) - len(errors)
        if unclosed > 0:
            errors.append("error: a <tool_call> block is not closed with </tool_call>")
        return ParsedCalls(tuple(calls), tuple(errors))

    @staticmethod
    def _one(body: str) -> tuple[ToolCall | None, str]:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return None, f"is not valid JSON ({e.msg} at character {e.pos})"
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None, 'needs a JSON object with a "name" string'
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None, '"arguments" is a string that is not a JSON object'
        if not isinstance(args, dict):
            return None, '"arguments" must be a JSON object'
        return ToolCall(obj["name"], args), ""


TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {"qwen": QwenToolCalls()}


def _template(tokenizer: object) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        raise ToolsNotSupported(f"tokenizer {_name(tokenizer)} has no chat template")
    return template


def _name(tokenizer: object) -> str:
    return repr(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def template_uses_tools(tokenizer: object) -> bool:
    """Whether the chat template reads a `tools` variable (jinja's own analysis of the template)."""
    import jinja2
    from jinja2 import meta

    return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(_template(tokenizer)))


def check_tools_supported(tokenizer: object) -> None:
    if not template_uses_tools(tokenizer):
        raise ToolsNotSupported(
            f"the chat template of tokenizer {_name(tokenizer)} does not use `tools` (a SmolLM2-style template), "
            "so the model would never see them: call session.chat without tools= and describe the tools in the "
            "messages, or use a tokenizer whose template renders tools (Qwen2.5, Qwen3)")


def parser_for(tokenizer: object, name: str | None = None) -> ToolCallParser:
    """The parser `name`, else the one the template's own tool instructions name."""
    if name is not None:
        if name not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool-call format {name!r}; one of {sorted(TOOL_CALL_PARSERS)}")
        return TOOL_CALL_PARSERS[name]
    if "<tool_call>" in _template(tokenizer):
        return TOOL_CALL_PARSERS["qwen"]
    raise ToolsNotSupported(f"no tool-call parser knows the template of tokenizer {_name(tokenizer)}; "
                            f"formats: {sorted(TOOL_CALL_PARSERS)}")
