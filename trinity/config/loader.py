"""YAML + dotted overrides -> validated JobConfig, with every problem reported at once.

Precedence: field defaults < YAML file < command-line overrides (`a.b.c=value`, value parsed as a
YAML scalar or list). Errors name the key path, and the YAML line when the key came from the file.
"""

from __future__ import annotations

import difflib
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from trinity.config import renames
from trinity.config.schema import JobConfig
from trinity.errors import ConfigError, UserError


@dataclass
class LoadedConfig:
    """A validated job config with what validation learned on the way."""

    config: JobConfig
    facts: Any  # trinity.models.facts.ModelFacts | None (None only if the model folder was unreadable)
    warnings: list[str] = field(default_factory=list)
    source: str = ""


class DuplicateKeyError(yaml.YAMLError):
    """A mapping names the same key twice; YAML's loaders would silently keep the last value."""

    def __init__(self, key: str, first_line: int, second_line: int):
        super().__init__(f"key {key!r} appears twice in one mapping (lines {first_line} and {second_line})")
        self.key, self.first_line, self.second_line = key, first_line, second_line


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses duplicate keys: a job file where `lr:` appears twice must not
    train with whichever came last."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may repeat keys on purpose
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise DuplicateKeyError(str(key), seen[key], line)
                seen[key] = line
            except TypeError:  # an unhashable key: SafeLoader reports it below
                continue
        return super().construct_mapping(node, deep=deep)


# The job's config as it ran: beside the outputs and in every checkpoint, read back by resume and export.
RESOLVED_CONFIG_FILE = "resolved_config.yaml"
# A job config nests a few levels (section, role, megatron, ...); far deeper is a broken file.
MAX_DEPTH = 64


class TooDeepError(yaml.YAMLError):
    """Mappings and lists nested deeper than any job config: PyYAML's composer would recurse until
    Python's recursion limit and fail without naming the file."""

    def __init__(self, line: int):
        super().__init__(f"mappings and lists nest more than {MAX_DEPTH} levels deep")
        self.line = line


def _check_depth(text: str) -> None:
    """TooDeepError at the first collection nested deeper than MAX_DEPTH, found from the parser's
    event stream, which (unlike the composer) does not recurse."""
    depth = 0
    for event in yaml.parse(text, Loader=_StrictLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise TooDeepError(event.start_mark.line + 1)
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def parse_yaml(text: str) -> Any:
    """yaml.safe_load that refuses duplicate keys (DuplicateKeyError) and absurd nesting (TooDeepError)."""
    _check_depth(text)
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


def read_yaml(path: str | Path) -> tuple[dict[str, Any], dict[str, int]]:
    """Parse a YAML job file; return the mapping and a `dotted.path -> line` index."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"--config: {p} is a folder, not a config file; pass the job's YAML file{_yaml_files_in(p)}")
    if not p.is_file():
        raise UserError(f"{p}: config file not found")
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise UserError(f"{p}: cannot read the config file: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise UserError(
            f"{p}:{line}: the config file is not UTF-8 text (byte 0x{raw[exc.start]:02x}); save it as UTF-8"
        ) from None
    try:
        data = parse_yaml(text)
        node = yaml.compose(text, Loader=_StrictLoader)
    except DuplicateKeyError as exc:
        raise UserError(
            f"{p}:{exc.second_line}: key {exc.key!r} appears twice in one mapping (lines {exc.first_line} and "
            f"{exc.second_line}); keep one"
        ) from None
    except TooDeepError as exc:
        raise UserError(f"{p}:{exc.line}: {exc}; a job config is a few levels deep: look for unclosed brackets") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
        problem = getattr(exc, "problem", None) or str(exc)
        raise UserError(f"{where}: YAML syntax error: {problem}") from None
    if data is None:
        raise UserError(f"{p}: the config file is empty; write the job's sections (model:, data:, trainer:, ...), "
                        "e.g. starting from configs/quickstart.yaml")
    if not isinstance(data, dict):
        raise UserError(f"{p}: the top level must be a mapping of sections (algorithm:, model:, ...)")
    lines: dict[str, int] = {}
    _index_lines(node, "", lines)
    return data, lines


def _yaml_files_in(folder: Path) -> str:
    """` (it holds a.yaml, b.yaml)` naming a few of the YAML files in `folder`, or nothing."""
    try:
        names = sorted(f.name for f in folder.iterdir() if f.suffix in (".yaml", ".yml"))
    except OSError:
        return ""
    if not names:
        return ""
    return f" (it holds {', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"


def _index_lines(node: Any, prefix: str, out: dict[str, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            out[path] = key_node.start_mark.line + 1
            _index_lines(value_node, path, out)


def apply_overrides(data: dict[str, Any], overrides: list[str], origins: dict[str, int] | None = None) -> dict[str, Any]:
    """Set `dotted.key=value` pairs in a nested dict (values parsed as YAML).

    `origins` receives `dotted.key -> n` (1-based position on the command line) so that a problem with
    a value an override set is blamed on `<override n>`, not on the YAML line it replaced."""
    problems = []
    origins = {} if origins is None else origins
    for n, item in enumerate(overrides, start=1):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(f"override {item!r}: must look like dotted.key=value")
            continue
        try:
            value = parse_yaml(raw) if raw.strip() else None
        except DuplicateKeyError as exc:
            problems.append(f"{key}: {exc}; keep one (<override {n}>: {item})")
            continue
        except TooDeepError as exc:
            problems.append(f"override {item!r}: {exc}; give a plain value")
            continue
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
        origins[key] = n
    if problems:
        raise ConfigError(problems)
    return data


def _override_of(path: str, origins: dict[str, int]) -> int | None:
    """The override that set `path`, one of its parents (the last one wins, as when applied) or,
    failing those, a key under it: `a.b.c=1` turns a scalar `a.b` of the YAML into a mapping, and the
    problem with `a.b` is then the override's, not the YAML line's."""
    found = None
    for key, n in origins.items():
        if path == key or path.startswith(key + "."):
            found = n if found is None else max(found, n)
    if found is None:
        under = [n for key, n in origins.items() if key.startswith(path + ".")]
        found = max(under) if under else None
    return found


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


def _finite_fix(loc: tuple[Any, ...]) -> str:
    """The fix of an inf / nan value: a finite number, the field's default when it has one."""
    owner = _model_at(loc[:-1])
    info = owner.model_fields.get(str(loc[-1])) if owner is not None else None
    default = None if info is None or info.is_required() else info.get_default(call_default_factory=True)
    return f"write a finite number (the default is {default})" if isinstance(default, (int, float)) else "write a finite number"


def format_validation_error(
    exc: ValidationError, lines: dict[str, int], source: str, origins: dict[str, int] | None = None,
    overrides: list[str] | None = None,
) -> list[str]:
    """One line per problem, keyed by its dotted path, ending with where the value came from: the
    YAML line, or the command-line override that set it (`(<override 2>: trainer.total_steps=0)`)."""
    problems = []
    origins = origins or {}
    overrides = overrides or []

    def where_of(path: str) -> str:
        # A value an override set is blamed on the override, not on the YAML line it replaced.
        n = _override_of(path, origins)
        if n is not None:
            return f" (<override {n}>: {overrides[n - 1]})"
        return f" ({source}:{lines[path]})" if path in lines else ""

    for err in exc.errors():
        loc = tuple(err["loc"])
        path = ".".join(str(p) for p in loc)
        where = where_of(path)
        hints, others = renames.hints_at(path, err.get("input")) if err["type"] == "extra_forbidden" else ([], [])
        if hints:
            problems += [h.problem(where_of(h.old)) for h in hints]
            problems += [f"{key}: unknown key{where_of(key)}; remove it (docs/migrating.md maps the keys of verl, "
                         "Trinity-RFT and ROLL that have an equivalent)" for key in others]
        elif err["type"] == "extra_forbidden":
            owner = _model_at(loc[:-1])
            names = list(owner.model_fields) if owner else []
            close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else f"allowed keys: {', '.join(names)}"
            problems.append(f"{path}: unknown key{where}; {hint}")
        elif err["type"] == "missing":
            problems.append(f"{path}: required field is missing{where}; add it to the config")
        elif err["type"] == "finite_number":
            problems.append(f"{path}: {err.get('input')!r} is not a finite number{where}; {_finite_fix(loc)}")
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
    origins: dict[str, int] = {}
    overrides = list(overrides or [])
    data = apply_overrides(data, overrides, origins)
    try:
        cfg = JobConfig.model_validate(data)
    except ValidationError as exc:
        problems = format_validation_error(exc, lines, source, origins, overrides)
        # Report the cross-field problems of the rest of the config too: drop the invalid keys
        # (their defaults stand in) and check what remains.
        pruned = _prune(data, [tuple(e["loc"]) for e in exc.errors()])
        try:
            rest = JobConfig.model_validate(pruned)
        except ValidationError:
            raise ConfigError(problems) from None
        problems += check_job(rest, check_paths=check_paths)[1]
        if check_paths:
            problems += check_output_dir(rest.trainer.output_dir)
        raise ConfigError(problems) from None
    facts, problems, warnings = check_job(cfg, check_paths=check_paths)
    if check_paths:
        problems += check_output_dir(cfg.trainer.output_dir)
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


def check_output_dir(output_dir: str | Path, key: str = "trainer.output_dir") -> list[str]:
    """Whether `output_dir` is, or can be created as, a folder this process can write into; a problem
    naming `key` otherwise. Nothing is created: `trinity validate` stays read-only."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        return [f"{key}: {out} is a file, not a folder; choose a folder path"]
    probe = out
    while not probe.exists():  # the nearest existing ancestor is where a folder would be created
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return [f"{key}: cannot create {out}: {probe} is a file, not a folder; choose another path"]
    if not os.access(probe, os.W_OK | os.X_OK):
        if _read_only(probe):
            return [f"{key}: {probe} is on a read-only file system; choose a folder on a writable disk"]
        return [f"{key}: {probe} is not writable by this user; choose a folder you can write to"]
    return []


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False
