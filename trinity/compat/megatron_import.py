"""`import megatron.core` without the code trinity never runs at import: 4.3-5.4 -> 1.7-1.9 s on 2 cores.

Every process of a job imports megatron-core (each torchrun rank, the CLI when it converts), and the
CPU test suite starts hundreds (torch 2.13.0 CPU wheel, megatron-core 0.16.1). Two changes, both only
while the `megatron.core` package executes:
- `megatron.core.jit` sets `jit_fuser = torch.compile`, and megatron-core decorates its fused
  pointwise functions with it at import (bias-SwiGLU, bias-GeLU, bias-dropout-add, ...). Decorating
  imports torch._dynamo and parts of inductor (~2 s) although nothing compiles until a first call,
  and CPU runs never call them (every fusion is off there, `trinity.models.build`). torch.compile is
  `lazy_compile` then: it returns a function that compiles at its first call, as torch.compile's own
  result does, and calls the plain function inside an outer compiled region (where dynamo inlines
  it, as it inlines a torch.compile'd function).
- megatron-core's dynamic inference context (`megatron.core.inference.contexts.dynamic_context`, not
  used by trinity: its engine needs flash-attn) imports wandb (~0.8 s) for its own logging, if wandb
  is installed. `import wandb` finds nothing then; afterwards it works as usual (trinity's trackers
  import it themselves).

The same import is also where megatron-core warns that TransformerEngine / Apex are missing (every CPU
process): it runs inside trinity.compat.quiet.hidden(), so a user's own script that calls
`trinity.compat.install_all()` first (docs/pretraining.md) stays as quiet as `trinity run`
(TRINITY_DEBUG=1 shows them).

`install()` (through `trinity.compat.install_all()`, which the workers and the CLI call before any
megatron import; cheap: it imports neither torch nor megatron) adds a finder that applies both around
the execution of the `megatron.core` package only, once. It checks its targets when they come into
play: the package's loader must execute modules, and torch must have `compile`.
TRINITY_EAGER_MEGATRON_IMPORT=1 turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any, Callable, Iterator

from trinity.compat.quiet import hidden
from trinity.compat.checks import PINNED, require

TARGET = "megatron.core"


def lazy_compile(real: Callable[..., Any]) -> Callable[..., Any]:
    """A torch.compile (`real`) whose result for a plain function compiles at its first call."""

    def compile_(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # @torch.compile(mode=...): a decorator
            return lambda fn: compile_(fn, **kwargs)
        import torch

        if isinstance(model, torch.nn.Module) or not callable(model):
            return real(model, **kwargs)
        compiled: list[Callable[..., Any]] = []

        @functools.wraps(model)
        def call(*args: Any, **kw: Any) -> Any:
            if torch.compiler.is_compiling():  # traced by an outer compile: let dynamo inline the function
                return model(*args, **kw)
            if not compiled:
                compiled.append(real(model, **kwargs))
            return compiled[0](*args, **kw)

        return call

    return compile_


@contextlib.contextmanager
def _light_import() -> Iterator[None]:
    import torch

    require("megatron_import", torch, "compile")
    real = torch.compile
    hide_wandb = "wandb" not in sys.modules
    torch.compile = lazy_compile(real)
    if hide_wandb:
        sys.modules["wandb"] = None  # type: ignore[assignment]  # `import wandb` raises ImportError
    try:
        yield
    finally:
        torch.compile = real
        if hide_wandb and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]


class _Finder(importlib.abc.MetaPathFinder):
    """Finds `megatron.core` with the other finders and runs its module code under `_light_import`."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        uninstall()  # once per process, and not for the lookup below
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:  # megatron-core not installed: the import fails as it would without the finder
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            raise ImportError(f"{TARGET} is not a package of source files that trinity's megatron_import patch can "
                              f"execute (loader {spec.loader!r}); install the megatron-core version trinity pins, "
                              f"{PINNED} (pip install -e . in the repository), or set TRINITY_EAGER_MEGATRON_IMPORT=1")
        exec_module = spec.loader.exec_module

        def exec_light(module: Any) -> None:
            with hidden(), _light_import():
                exec_module(module)

        spec.loader.exec_module = exec_light  # type: ignore[method-assign]  # this spec's own loader instance
        return spec


_FINDER = _Finder()


def install() -> None:
    if os.environ.get("TRINITY_EAGER_MEGATRON_IMPORT") == "1" or TARGET in sys.modules:
        return
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
