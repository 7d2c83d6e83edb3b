"""torch.optim without importing torch._dynamo, in CPU jobs: ~0.6-1.1 s of CPU less per process.

torch.optim imports torch._dynamo at an optimizer's first use, in two places:
- Optimizer methods (`add_param_group`, `zero_grad`, `state_dict`, `load_state_dict`, the step hook)
  and the functional updates (`adam`, `adamw`, `sgd`, ...) are wrapped in
  `torch._compile._disable_dynamo`, whose wrapper imports torch._dynamo at its first call to build
  `torch._dynamo.disable(fn)` and caches the result as `fn.__dynamo_disable`;
- `step` of Adam(W), SGD, ... is wrapped in `_use_grad_for_differentiable`, which imports torch._dynamo
  at every call for two `torch._dynamo.graph_break()` markers around the update.
On the 2-core dev machine (torch 2.13 CPU wheel) the import costs 1.1 s of CPU: `python -c "import
torch, trinity, megatron.core"` 4.5 CPU-s, with `torch._dynamo` added 5.6. In a CPU job the optimizer
is the only thing that imports it (an import hook on a CPU SFT worker found no other importer), and
the CPU test suite starts hundreds of such processes. The quickstart's worker, 8 alternated runs
(docs/performance.md, "CPU jobs no longer import torch._dynamo"): 9.41 against 10.06 CPU-s.

Outside a torch.compile region both wrappers reduce to plain calls: `torch._dynamo.disable(fn)(...)` is
`fn(...)` (the eval-frame callback it clears is already clear) and `graph_break()` does nothing. trinity
never runs optimizer code inside a compiled region (it compiles layers, a model's forward or single
kernels). So `skip_dynamo_import()`:
- caches every function torch.optim passes to `_disable_dynamo` as its own disabled version (the
  wrappers are found by their code object among torch.optim's module functions, the Optimizer classes'
  methods and the functions those wrap or close over);
- gives each Optimizer class whose own `step` is a `_use_grad_for_differentiable` wrapper the same
  wrapper without the markers: grad mode set to the optimizer's `differentiable` default for the call.
Each part first checks that the torch code it stands in for is still the one described here (the
wrapper reads `__dynamo_disable` from its closure variable `fn`; `_use_grad` calls `graph_break` and
`set_grad_enabled` around its closure variable `func`); where torch changed, that part changes nothing
and dynamo is imported as before.

CPU jobs only (`trinity.trainer.engine.setup.build_optimizer`): on CUDA trinity compiles kernels
(log-probs, flex attention), which import dynamo anyway.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterator

_ATTR = "__dynamo_disable"  # the cache `_disable_dynamo`'s wrapper reads (torch/_compile.py)


def _wrapper_code() -> Any:
    """The code object of `_disable_dynamo`'s wrapper, or None where it no longer caches in `fn`."""
    import torch._compile

    code = torch._compile._disable_dynamo(lambda: None).__code__
    if _ATTR not in code.co_consts or "fn" not in code.co_freevars:
        return None
    return code


def _functions(obj: Any, depth: int = 0) -> Iterator[Callable[..., Any]]:
    """obj (a function, staticmethod or classmethod), what it wraps (`__wrapped__`) and the functions
    in its closure, a few levels deep."""
    obj = getattr(obj, "__func__", obj)
    if depth > 4 or not callable(obj) or not hasattr(obj, "__code__"):
        return
    yield obj
    inner = getattr(obj, "__wrapped__", None)
    if inner is not None:
        yield from _functions(inner, depth + 1)
    for cell in obj.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(value) and hasattr(value, "__code__"):
            yield from _functions(value, depth + 1)


def _use_grad_code() -> Any:
    """The code object of `_use_grad_for_differentiable`'s wrapper, or None where it changed."""
    from torch.optim.optimizer import _use_grad_for_differentiable

    code = _use_grad_for_differentiable(lambda self: None).__code__
    names = set(code.co_names)
    if code.co_freevars != ("func",) or not {"graph_break", "set_grad_enabled", "is_grad_enabled"} <= names:
        return None
    return code


def _step_without_markers(func: Callable[..., Any]) -> Callable[..., Any]:
    """`_use_grad_for_differentiable(func)` without its `torch._dynamo.graph_break()` markers."""
    import functools

    import torch

    @functools.wraps(func)
    def step(*args: Any, **kwargs: Any) -> Any:
        prev = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(args[0].defaults["differentiable"])
            return func(*args, **kwargs)
        finally:
            torch.set_grad_enabled(prev)

    return step


def skip_dynamo_import() -> int:
    """Stand in for torch.optim's two dynamo-importing wrappers (module doc); returns how many
    functions it changed (0 where torch changed, or where this already ran)."""
    import torch.optim

    owners: list[Any] = []
    for name, module in list(sys.modules.items()):
        if name == "torch.optim" or name.startswith("torch.optim."):
            owners.append(module)
            owners += [v for v in vars(module).values()
                       if isinstance(v, type) and issubclass(v, torch.optim.Optimizer)]
    done = 0
    code = _wrapper_code()
    if code is not None:
        fn_index = code.co_freevars.index("fn")
        for owner in owners:
            for value in list(vars(owner).values()):
                for f in _functions(value):
                    if f.__code__ is not code:
                        continue
                    fn = f.__closure__[fn_index].cell_contents
                    if getattr(fn, _ATTR, None) is None:
                        setattr(fn, _ATTR, fn)
                        done += 1
    use_grad = _use_grad_code()
    if use_grad is not None:
        for cls in {o for o in owners if isinstance(o, type)}:
            step = vars(cls).get("step")
            if getattr(step, "__code__", None) is use_grad:
                setattr(cls, "step", _step_without_markers(step.__closure__[0].cell_contents))
                done += 1
    return done
