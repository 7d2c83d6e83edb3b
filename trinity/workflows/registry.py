"""Built-in workflows by name, and `module:function` resolution (`workflow.function` in a config)."""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Awaitable, Callable

from trinity.config.schema.workflow import BUILTIN_WORKFLOWS, FUNCTION_PATTERN  # noqa: F401 (resolved here)

if TYPE_CHECKING:
    from trinity.workflows.types import Episode

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
