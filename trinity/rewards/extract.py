"""Where a response's final answer is (`EXTRACTORS`, named by `reward.extractor`) and how answers compare as
numbers (`normalize_answer`): shared by the built-in rewards and the shipped example rewards."""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|[-+]?\.\d+")
_BOXED = "\\boxed{"


def extract_last_number(text: str, marker: str = "####") -> str | None:
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def extract_boxed(text: str, marker: str = "####") -> str | None:
    """Content of the last \\boxed{...}, with balanced inner braces; None if absent or unclosed."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, pos = 1, start + len(_BOXED)
    for i in range(pos, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[pos:i]
    return None


def extract_after_marker(text: str, marker: str = "####") -> str | None:
    """First non-empty line after the last `marker`."""
    idx = text.rfind(marker)
    if idx < 0:
        return None
    for line in text[idx + len(marker) :].splitlines():
        if line.strip():
            return line.strip()
    return None


EXTRACTORS: dict[str, Callable[[str, str], str | None]] = {
    "last_number": extract_last_number,
    "boxed": extract_boxed,
    "after_marker": extract_after_marker,
}


def extractor(name: str) -> Callable[[str, str], str | None]:
    """`reward.extractor`'s function; an unknown name is the user's error, naming the key and the choices."""
    from trinity.errors import UserError

    if name not in EXTRACTORS:
        raise UserError(f"reward.extractor: unknown extractor {name!r}; known: {', '.join(EXTRACTORS)}")
    return EXTRACTORS[name]


def normalize_answer(text: str) -> str:
    """Canonical form for comparison: numbers as reduced fractions ("19.0" -> "19", "1.5" -> "3/2"),
    anything else with whitespace collapsed. Currency, thousands commas, a trailing period and
    surrounding `$...$` are dropped."""
    s = " ".join(text.split()).strip()
    s = s.strip("$").strip()
    s = s.rstrip(".").strip()
    candidate = s.replace(",", "").replace(" ", "")
    if candidate.startswith("\\$"):
        candidate = candidate[2:]
    try:
        value = Fraction(candidate)
    except (ValueError, ZeroDivisionError):
        return s
    return str(value)
