"""What a config block sets: the fields whose value differs from the schema default."""

from __future__ import annotations

from typing import Any


def non_default(block: Any, fields: Any) -> list[str]:
    """Fields of `block` whose value differs from the schema default. (Not `model_fields_set`: the
    workers read the resolved config, which spells every field out.)"""
    out = []
    for name in fields if fields is not None else type(block).model_fields:
        info = type(block).model_fields[name]
        default = info.default_factory() if info.default_factory is not None else info.default
        if getattr(block, name) != default:
            out.append(name)
    return sorted(out)
