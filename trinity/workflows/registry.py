"""Built-in workflows by name, and `module:function` resolution (`workflow.function` in a config)."""

from __future__ import annotations

import importlib
import inspect
import re
from typing import TYPE_CHECKING, Awaitable, Callable

if TYPE_CHECKING:
    from trinity.workflows.types import Episode

BUILTIN_WORKFLOWS: dict[str, str] = {
    "calculator": "trinity.workflows.calculator:calculator_workflow",
    "guess_number": "trinity.workflows.guess_number:guess_number_workflow",
}
FUNCTION_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")

Workflow = Callable[..., Awaitable["Episode"]]


def resolve_workflow(function: str) -> Workflow:
    """The workflow named `function`: a built-in name or `module.path:function`, an `async def`."""
    target = BUILTIN_WORKFLOWS.get(function, function)
    if not FUNCTION_PATTERN.match(target):
        raise ValueError(f"workflow {function!r}: expected a built-in ({', '.join(sorted(BUILTIN_WORKFLOWS))}) "
                         "or module.path:function")
    module, attr = target.split(":")
    fn = getattr(importlib.import_module(module), attr, None)
    if fn is None:
        raise ValueError(f"workflow {function!r}: module {module} has no {attr}")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"workflow {function!r} must be an `async def` function (task, session, **args) -> Episode")
    return fn
