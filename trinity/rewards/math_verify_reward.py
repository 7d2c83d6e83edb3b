"""`reward.function: math_verify`: mathematical equivalence of the final answer, on the `math-verify` package.

`math_exact_match` compares normalised numbers ("1.5" == "3/2"); `math_verify` compares what the
answers *mean*: `\\frac{1}{2}` == `0.5` == `2/4`, `(x+1)^2` == `x^2+2x+1`, `\\sqrt{8}` == `2\\sqrt{2}`,
`1,000` == `1000`. Both sides are parsed into sympy expressions by math-verify (LaTeX and plain
expressions) and compared by `math_verify.verify`.

Which part of the response is the answer (`reward.extractor`):
  last_number (default)  the last `\\boxed{...}` if the response has one, else its last number
                         ("... so 7 + 5 = 12" -> 12; "3/2" and "-0.5" are numbers)
  boxed                  the last `\\boxed{...}` only (nested braces allowed); none -> 0.0
  after_marker           the first non-empty line after the last `reward.marker` (GSM8K "####")
The reference answer (`data.answer_key`) is parsed whole, or, when it contains the marker (a full
GSM8K solution), what follows the marker. A response without an answer scores 0.0; so does one
math-verify cannot parse or that takes longer than its 5-second limit to compare.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from trinity.errors import UserError
from trinity.rewards.extract import extractor, extract_after_marker, extract_boxed, extract_last_number

TIMEOUT_S = 5


def _import() -> tuple[Any, Any]:
    try:
        from math_verify import parse, verify
    except ImportError:
        raise UserError("reward.function: math_verify needs the math-verify package; install it with: pip install math-verify") from None
    return parse, verify


def _as_latex(text: str) -> str:
    """math-verify parses LaTeX inside `$...$` best (bare `x^2+1` or `\\sqrt{2}` find nothing)."""
    text = text.strip()
    return text if "$" in text or "\\boxed" in text else f"${text}$"


def extract_answer(response: str, extractor: str, marker: str) -> str | None:
    """The answer part of a response (see the module doc), or None."""
    if extractor == "last_number":
        boxed = extract_boxed(response)
        return boxed if boxed is not None else extract_last_number(response)
    if extractor == "boxed":
        return extract_boxed(response)
    return extract_after_marker(response, marker)


@dataclass(frozen=True)
class MathVerifyReward:
    extractor: str = "last_number"
    marker: str = "####"

    def __post_init__(self) -> None:
        extractor(self.extractor)
        _import()  # a missing package fails when the job starts, not at the first reward

    def __call__(self, prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]:
        parse, verify = _import()
        # math-verify's time limit uses SIGALRM, which only the main thread may set.
        limit = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
        scores = []
        for i, (response, answer) in enumerate(zip(responses, answers, strict=True)):
            if answer is None:
                raise UserError(f"reward math_verify: sample {i} has no reference answer (data.answer_key)")
            reference = extract_after_marker(answer, self.marker) if self.marker and self.marker in answer else answer
            got = extract_answer(response, self.extractor, self.marker)
            if got is None or not got.strip() or not reference:
                scores.append(0.0)
                continue
            gold = parse(_as_latex(reference), parsing_timeout=limit)
            pred = parse(_as_latex(got), parsing_timeout=limit)
            ok = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=limit)
            scores.append(1.0 if ok else 0.0)
        return scores


def build(extractor: str, marker: str, format_pattern: str | None) -> MathVerifyReward:
    """The `math_verify` entry of trinity.rewards.loader.BUILTIN_REWARDS."""
    return MathVerifyReward(extractor, marker)
