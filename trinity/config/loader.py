"""YAML + dotted overrides -> validated JobConfig, with every problem reported at once.

Precedence: field defaults < YAML file < command-line overrides (`a.b.c=value`, value parsed as a
YAML scalar or list). Errors name the key path, and the YAML line when the key came from the file.
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from trinity.config.schema import JobConfig
from trinity.errors import ConfigError, UserError


@dataclass
class LoadedConfig:
    """A validated job config with what validation learned on the way."""

    config: JobConfig
    facts: Any  # trinity.models.facts.ModelFacts | None (None only if the model folder was unreadable)
    warnings: list[str] = field(default_factory=list)
    source: str = ""


def read_yaml(path: str | Path) -> tuple[dict[str, Any], dict[str, int]]:
    """Parse a YAML job file; return the mapping and a `dotted.path -> line` index."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: config file not found")
    text = p.read_text()
    try:
        data = yaml.safe_load(text)
        node = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
        problem = getattr(exc, "problem", None) or str(exc)
        raise UserError(f"{where}: YAML syntax error: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{p}: the top level must be a mapping of sections (algorithm:, model:, ...)")
    lines: dict[str, int] = {}
    _index_lines(node, "", lines)
    return data, lines


def _index_lines(node: Any, prefix: str, out: dict[str, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            out[path] = key_node.start_mark.line + 1
            _index_lines(value_node, path, out)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set `dotted.key=value` pairs in a nested dict (values parsed as YAML)."""
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(f"{item}: an override must look like dotted.key=value")
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    if problems:
        raise ConfigError(problems)
    return data


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The Pydantic model class that owns the field at `loc` (for did-you-mean suggestions)."""
    model: type[BaseModel] | None = JobConfig
    for part in loc:
        if model is None:
            return None
        if isinstance(part, int):
            continue
        info = model.model_fields.get(str(part))
        if info is None:
            return None
        model = _unwrap_model(info.annotation)
    return model


def _unwrap_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _unwrap_model(arg)
        if found is not None:
            return found
    return None


def format_validation_error(exc: ValidationError, lines: dict[str, int], source: str) -> list[str]:
    problems = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        path = ".".join(str(p) for p in loc)
        where = f" ({source}:{lines[path]})" if path in lines else ""
        if err["type"] == "extra_forbidden":
            owner = _model_at(loc[:-1])
            names = list(owner.model_fields) if owner else []
            close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else f"allowed keys: {', '.join(names)}"
            problems.append(f"{path}: unknown key{where}; {hint}")
        elif err["type"] == "missing":
            problems.append(f"{path}: required field is missing{where}; add it to the config")
        else:
            got = err.get("input")
            shown = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
            problems.append(f"{path}: {err['msg']}{shown}{where}")
    return problems


def load_config(
    path: str | Path | None, overrides: list[str] | None = None, *, check_paths: bool = True
) -> LoadedConfig:
    """Load, override and validate a job config; raise ConfigError with every problem found."""
    from trinity.config.rules import check_job  # local: rules import model facts

    data, lines = read_yaml(path) if path is not None else ({}, {})
    source = str(path) if path is not None else "<overrides>"
    data = apply_overrides(data, list(overrides or []))
    try:
        cfg = JobConfig.model_validate(data)
    except ValidationError as exc:
        problems = format_validation_error(exc, lines, source)
        # Report the cross-field problems of the rest of the config too: drop the invalid keys
        # (their defaults stand in) and check what remains.
        pruned = _prune(data, [tuple(e["loc"]) for e in exc.errors()])
        try:
            rest = JobConfig.model_validate(pruned)
        except ValidationError:
            raise ConfigError(problems) from None
        problems += check_job(rest, check_paths=check_paths)[1]
        raise ConfigError(problems) from None
    facts, problems, warnings = check_job(cfg, check_paths=check_paths)
    if problems:
        raise ConfigError(problems)
    return LoadedConfig(config=cfg, facts=facts, warnings=warnings, source=source)


def _prune(data: dict[str, Any], locs: list[tuple[Any, ...]]) -> dict[str, Any]:
    """A deep copy of `data` without the entries at `locs` (a list entry drops the whole list)."""
    import copy

    out = copy.deepcopy(data)
    for loc in locs:
        node: Any = out
        keys = [k for k in loc if isinstance(k, str)]
        for k in keys[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, dict) and keys:
            node.pop(keys[-1], None)
    return out
