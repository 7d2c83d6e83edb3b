"""Reward functions: built-in rule-based rewards and user functions named `module.path:function`.

Every reward function scores a batch:
    fn(prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]
Built-ins (`BUILTIN_REWARDS`):
  math_exact_match  1.0 when the answer extracted from the response equals the reference answer after
                    number normalisation ("19", "19.0", " 19 ", "1,000", "3/2" == "1.5"), else 0.0.
                    Extractors: last_number, boxed (last \\boxed{...}, nested braces allowed),
                    after_marker (what follows the last marker, GSM8K's "####").
  math_verify       1.0 when the extracted answer is mathematically equivalent to the reference
                    ("\\frac{1}{2}" == "0.5", "(x+1)^2" == "x^2+2x+1"), on the math-verify package:
                    trinity.rewards.math_verify_reward.
  format            1.0 when the whole response matches `format_pattern` (re.fullmatch, DOTALL).
User functions are found by `trinity validate` without running them (`reward_problems` parses the
file for the function) and imported when the job starts (`load_reward_fn`), so a typo fails before any
GPU work; `module.path` may also be a `path/to/file.py`. They run with the job's rights (docs/rl.md).
A job runs its reward in a process of its own with a time limit (trinity.rewards.process); a
failure (an exception, a call past `reward.timeout_s`, a value that is no finite number) is one line
naming the function, the sample's index and the start of its prompt and response (`sample_problem`).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trinity.errors import UserError
from trinity.rewards.extract import extractor, extract_after_marker, normalize_answer

if TYPE_CHECKING:
    from trinity.config.schema import RewardConfig

RewardFn = Callable[[list[str], list[str], list["str | None"]], list[float]]

@dataclass(frozen=True)
class MathExactMatch:
    extractor: str = "last_number"
    marker: str = "####"

    def __post_init__(self) -> None:
        extractor(self.extractor)

    def __call__(self, prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]:
        extract = extractor(self.extractor)
        scores = []
        for i, (response, answer) in enumerate(zip(responses, answers, strict=True)):
            if answer is None:
                raise UserError(f"reward math_exact_match: sample {i} has no reference answer (data.answer_key)")
            # A GSM8K-style full solution as reference is reduced to its final answer.
            reference = extract_after_marker(answer, self.marker) if self.marker and self.marker in answer else answer
            got = extract(response, self.marker)
            scores.append(1.0 if got is not None and normalize_answer(got) == normalize_answer(reference or "") else 0.0)
        return scores


@dataclass(frozen=True)
class FormatReward:
    pattern: str

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "_regex", re.compile(self.pattern, re.DOTALL))
        except re.error as e:
            raise UserError(f"reward.format_pattern: invalid regex {self.pattern!r}: {e}") from None

    def __call__(self, prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]:
        regex: re.Pattern[str] = self._regex  # type: ignore[attr-defined]
        return [1.0 if regex.fullmatch(r) else 0.0 for r in responses]


def _build_math(extractor: str, marker: str, format_pattern: str | None) -> RewardFn:
    return MathExactMatch(extractor, marker)


def _build_format(extractor: str, marker: str, format_pattern: str | None) -> RewardFn:
    if not format_pattern:
        raise UserError("reward.format_pattern: must be set when reward.function is 'format'")
    return FormatReward(format_pattern)


def _build_math_verify(extractor: str, marker: str, format_pattern: str | None) -> RewardFn:
    # Imported here: math-verify (sympy) is only loaded by jobs that use it.
    from trinity.rewards.math_verify_reward import build

    return build(extractor, marker, format_pattern)


BUILTIN_REWARDS: dict[str, Callable[[str, str, str | None], RewardFn]] = {
    "math_exact_match": _build_math,
    "math_verify": _build_math_verify,
    "format": _build_format,
}


def excerpt(text: str, n: int = 40) -> str:
    """The start of a prompt or response for a message: quoted and escaped (newlines as \\n), cut at n."""
    return repr(text[:n] + ("..." if len(text) > n else ""))


def sample_problem(spec: str, i: int, prompt: str, response: str, what: str, detail: str = "") -> str:
    """The one line that names a reward failure: the function, what went wrong ("failed on", "returned
    nan for", ...), the sample's index in the call and the start of its prompt and response, then
    `detail` (the exception)."""
    line = f"reward function {spec} {what} sample {i} (prompt {excerpt(prompt)}, response {excerpt(response)})"
    return f"{line}: {detail}" if detail else line


@dataclass(frozen=True)
class CheckedScores:
    """A reward function's return value read as one score per sample: `scores[i]` is None where
    `problems` says why sample i has none ("returned nan for"); `shape` says what the value was instead
    when it is no list of n ("1 values", "NoneType")."""

    scores: list[float | None]
    problems: dict[int, str]
    shape: str | None = None


def check_scores(value: object, n: int) -> CheckedScores:
    """What a reward function returned for n samples: a list (or tuple) of n finite numbers."""
    if not isinstance(value, (list, tuple)) or len(value) != n:
        got = f"{len(value)} values" if isinstance(value, (list, tuple)) else type(value).__name__
        return CheckedScores([None] * n, {}, got)
    scores: list[float | None] = []
    problems: dict[int, str] = {}
    for i, s in enumerate(value):
        try:
            score = float(s)  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError):
            problems[i] = f"returned a non-number ({_short_repr(s)}) for"
            scores.append(None)
            continue
        if not math.isfinite(score):
            problems[i] = f"returned {score} for"
            scores.append(None)
            continue
        scores.append(score)
    return CheckedScores(scores, problems)


def _short_repr(value: object, n: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n] + "..."


# the shipped reward modules that moved from trinity.rollout to trinity.rewards: configs name them as
# `trinity.rollout.<module>:function`, which still loads (`current_spec`)
MOVED_MODULES = {
    "trinity.rollout.arithmetic_reward": "trinity.rewards.arithmetic_reward",
    "trinity.rollout.math_verify_reward": "trinity.rewards.math_verify_reward",
    "trinity.rollout.rewards": "trinity.rewards.loader",
}


def current_spec(spec: str) -> str:
    """`spec` (`module.path:function`) with a moved shipped module's former name replaced by its name now."""
    module_name, sep, fn_name = spec.rpartition(":")
    return f"{MOVED_MODULES[module_name]}:{fn_name}" if sep and module_name in MOVED_MODULES else spec


def _import_module(spec: str, module_name: str) -> object:
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise UserError(f"reward function {spec}: file {module_name} does not exist")
        mod_spec = importlib.util.spec_from_file_location(f"trinity_user_reward_{path.stem}", path)
        assert mod_spec is not None and mod_spec.loader is not None
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        return module
    # Workers start from the job's directory; make its modules importable as they are from a shell.
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    return importlib.import_module(module_name)


def load_reward_fn(
    spec: str, extractor: str = "last_number", marker: str = "####", format_pattern: str | None = None
) -> RewardFn:
    """A built-in reward by name, or a user function `module.path:function` (or `file.py:function`)."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec](extractor, marker, format_pattern)
    spec = current_spec(spec)
    module_name, sep, fn_name = spec.rpartition(":")
    if not sep or not module_name or not fn_name:
        raise UserError(
            f"reward.function: {spec!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) "
            "nor 'module.path:function'"
        )
    try:
        module = _import_module(spec, module_name)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"reward function {spec}: cannot import {module_name} ({type(e).__name__}: {e})") from e
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise UserError(f"reward function {spec}: module {module_name} has no attribute {fn_name!r}")
    if not callable(fn):
        raise UserError(f"reward function {spec}: {fn_name} is a {type(fn).__name__}, not a function")
    return fn


# --- checks at validate time: find the user's function without running any of the user's code ---


def _top_level_names(tree: ast.Module) -> tuple[set[str], bool]:
    """Names a module binds at its top level (defs, classes, assignments, imports, also inside
    top-level if/try/with blocks), and whether it has a `from x import *` (which binds unknown names)."""
    names: set[str] = set()
    star = False
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    star = True
                else:
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            for field in ("body", "orelse", "finalbody"):
                stack += getattr(node, field, [])
            stack += [stmt for h in getattr(node, "handlers", []) for stmt in h.body]
    return names, star


def _find_module_file(module_name: str, cwd: Path) -> tuple[Path | None, bool]:
    """(source file of `module_name`, found) without importing it: the top-level package is found
    by the import system's finders (the job's directory first, as the workers import it), each
    submodule in its parent's folder. Found without a .py source (built-in, compiled): (None, True)."""
    from importlib.machinery import PathFinder

    parts = module_name.split(".")
    importlib.invalidate_caches()  # a file written since the last lookup in its folder must be seen
    added = str(cwd) not in sys.path
    if added:
        sys.path.insert(0, str(cwd))
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        spec = None
    finally:
        if added:
            sys.path.remove(str(cwd))
    for i in range(1, len(parts)):
        if spec is None or not spec.submodule_search_locations:
            return None, False
        spec = PathFinder.find_spec(".".join(parts[: i + 1]), list(spec.submodule_search_locations))
    if spec is None:
        return None, False
    origin = spec.origin
    return (Path(origin), True) if origin and origin.endswith(".py") else (None, True)


def reward_problems(
    spec: str, format_pattern: str | None = None, extractor: str = "last_number", marker: str = "####",
    cwd: str | Path | None = None,
) -> list[str]:
    """Problems of `reward.function` found before any process starts, each `reward.<key>: ...`.

    A user function's file is found and parsed with `ast` to see that it defines the function;
    nothing of the user's code runs here (it runs when the job starts, with the job's rights).
    Relative paths and modules are looked up from `cwd` (default: the current directory, where
    `trinity run` starts the workers).
    """
    problems: list[str] = []
    if spec in BUILTIN_REWARDS:
        try:
            BUILTIN_REWARDS[spec](extractor, marker, format_pattern)
        except UserError as exc:
            problems.append(str(exc))
        return problems
    spec = current_spec(spec)
    module_name, sep, fn_name = spec.rpartition(":")
    if not sep or not module_name or not fn_name:
        problems.append(
            f"reward.function: {spec!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) "
            "nor 'module.path:function'"
        )
        return problems
    base = Path(cwd) if cwd is not None else Path.cwd()
    if module_name.endswith(".py"):
        path = Path(module_name) if Path(module_name).is_absolute() else base / module_name
        if path.is_dir():
            problems.append(f"reward.function: {module_name} is a directory; name the .py file that defines {fn_name}")
            return problems
        if not path.is_file():
            problems.append(
                f"reward.function: file {module_name} does not exist (relative paths start at {base}, "
                "where trinity runs); fix the path in 'file.py:function'"
            )
            return problems
    else:
        found_path, found = _find_module_file(module_name, base)
        if not found:
            problems.append(
                f"reward.function: module {module_name} not found in {base} or on the Python path; "
                "install it, run trinity from its folder, or write 'path/to/file.py:function'"
            )
            return problems
        if found_path is None:
            return problems  # a compiled or built-in module: nothing to parse
        path = found_path
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as exc:
        problems.append(f"reward.function: {path}:{exc.lineno}: syntax error in the reward module: {exc.msg}")
        return problems
    except (OSError, ValueError) as exc:
        problems.append(f"reward.function: cannot read {path} ({exc})")
        return problems
    names, star = _top_level_names(tree)
    if fn_name not in names and not star:
        defs = sorted(n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        have = f"its top-level functions: {', '.join(defs[:10])}" if defs else "it defines no top-level function"
        problems.append(f"reward.function: {path} does not define {fn_name!r} at top level ({have})")
    return problems


def reward_code_file(spec: str, cwd: str | Path | None = None) -> str | None:
    """The file of user code that `reward.function` runs (None for a built-in); a module's name
    when its file cannot be found."""
    if spec in BUILTIN_REWARDS:
        return None
    module_name, _, _ = current_spec(spec).rpartition(":")
    if module_name.endswith(".py"):
        return module_name
    base = Path(cwd) if cwd is not None else Path.cwd()
    found_path, _ = _find_module_file(module_name, base)
    return str(found_path) if found_path is not None else module_name


def reward_fn_from_config(reward: RewardConfig) -> RewardFn:
    """The reward function of the job's `reward:` section, in this process (no time limit: the job's
    rewards run through `trinity.rewards.process.GuardedReward`)."""
    return load_reward_fn(
        reward.function, extractor=reward.extractor, marker=reward.marker, format_pattern=reward.format_pattern
    )
