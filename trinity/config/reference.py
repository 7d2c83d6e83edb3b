"""Generate docs/configuration.md from the config models (a test fails when the file is stale).

Regenerate with: python -m trinity.config.reference > docs/configuration.md
"""

from __future__ import annotations

import enum
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from trinity.config.schema import JobConfig

HEADER = """# Configuration reference

Generated from the Pydantic models in `trinity/config/` by `python -m trinity.config.reference`;
do not edit by hand. Every key is checked by `trinity validate`; unknown keys are errors with a
did-you-mean suggestion. Any key can be set on the command line as `dotted.key=value`.
"""


def _type_name(annotation: typing.Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a).replace("'", "`") for a in args)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if args:
        inner = [_type_name(a) for a in args if a is not type(None)]
        text = " \\| ".join(inner)
        if origin in (list, typing.List):
            text = f"list of {text}"
        if type(None) in args:
            text += " or null"
        return text
    return getattr(annotation, "__name__", str(annotation))


def _default(info) -> str:
    if info.default_factory is not None:
        value = info.default_factory()
        if isinstance(value, BaseModel):
            return ""
        return f"`{value!r}`"
    if info.default is PydanticUndefined:
        return "**required**"
    value = info.default.value if isinstance(info.default, enum.Enum) else info.default
    return f"`{value!r}`" if value is not None else "`null`"


def _section(model: type[BaseModel], path: str, out: list[str], seen: dict[type, str]) -> None:
    out.append(f"\n## `{path}`\n")
    if model in seen:
        out.append(f"Same keys as [`{seen[model]}`](#{seen[model].replace('.', '')}).")
        return
    seen[model] = path
    if model.__doc__:
        out.append(model.__doc__.strip().splitlines()[0] + "\n")
    out.append("| key | type | default | meaning |")
    out.append("|---|---|---|---|")
    subs = []
    for name, info in model.model_fields.items():
        desc = (info.description or "").replace("\n", " ").replace("|", "\\|")
        out.append(f"| `{name}` | {_type_name(info.annotation)} | {_default(info)} | {desc} |")
        for arg in (info.annotation, *typing.get_args(info.annotation)):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                subs.append((arg, f"{path}.{name}"))
    if model.model_config.get("extra") == "allow":
        out.append("| *any other key* | | | passed through as it is (checked against megatron-core's field names) |")
    for sub, sub_path in subs:
        _section(sub, sub_path, out, seen)


def generate() -> str:
    out = [HEADER]
    seen: dict[type, str] = {}
    for name, info in JobConfig.model_fields.items():
        model = next(a for a in (info.annotation, *typing.get_args(info.annotation)) if isinstance(a, type) and issubclass(a, BaseModel))
        _section(model, name, out, seen)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(generate(), end="")
