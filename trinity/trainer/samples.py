"""RL samples in the log (trainer.log_samples): every step's (prompt, response, reward, answer) rows of
all data-parallel ranks go to <output_dir>/samples/step_N.jsonl (val ones to val_step_N.jsonl), and
the first few are printed on the steps trainer.log_samples_interval says. Users read these more than any
number, so a printed sample is one short line per field of printable text: a model (a random one above
all) writes control characters, invisible ones and bytes that are not UTF-8 (the tokenizer's U+FFFD), which
would be invisible, or worse, move the terminal's cursor; they are printed as Python-style escapes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# One scored response: prompt, response, reward, answer, source (and the step, written with it).
Sample = dict[str, str | float | int | None]


def _gather(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every DP rank's samples, in DP rank order (a collective: every rank calls it)."""
    from megatron.core import parallel_state as ps

    from trinity.distributed import collectives

    return [s for box in collectives.all_gather_object(samples, group=ps.get_data_parallel_group()) for s in box]


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escaped(ch: str) -> str:
    """One character as printed: itself when it is visible text, else an escape (`\\n`, `\\x1b`,
    `\\u200b`; U+FFFD, what the tokenizer made of bytes that are not UTF-8, as `\\ufffd`)."""
    if ch == " " or (ch.isprintable() and ch != "\ufffd"):
        return ch
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def shown(text: Any, limit: int, tail: bool = False) -> str:
    """`text` escaped and cut to at most `limit` printed characters plus `...` where it was cut: its
    start, or its end with `tail` (a prompt's end is the question). An escape is never cut in two."""
    pieces = [escaped(ch) for ch in str(text)]
    if tail:
        pieces.reverse()
    kept, size = [], 0
    for piece in pieces:
        if size + len(piece) > limit:
            break
        kept.append(piece)
        size += len(piece)
    cut = len(kept) < len(pieces)
    if tail:
        return ("..." if cut else "") + "".join(reversed(kept))
    return "".join(kept) + ("..." if cut else "")


class SampleLog:
    def __init__(self, output_dir: Path, n_print: int, is_rank0: bool):
        self.dir, self.n_print, self.is_rank0 = output_dir / "samples", n_print, is_rank0

    def write(self, step: int, samples: list[Sample] | None, printer: Any, name: str = "step",
              show: bool = True) -> None:
        """Gather `samples` (this rank's) over DP, write them to samples/<name>_<step>.jsonl and, when
        `show` (trainer.log_samples_interval's steps; evaluations always), print the first n_print with
        `printer.print` (rank 0). Off when trainer.log_samples is 0."""
        if not self.n_print or samples is None:
            return
        rows = _gather(samples)
        if not self.is_rank0:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{name}_{step}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}, ensure_ascii=False) + "\n")
        for i, row in enumerate(rows[: self.n_print] if show else []):
            printer.print(sample_text(row, i, len(rows), step, val=name.startswith("val")))


def sample_text(row: dict[str, Any], i: int, n: int, step: int, val: bool = False) -> str:
    """The printed form of sample `i` of `n` of a step (or an evaluation, `val`): three lines."""
    label = "val sample" if val else "sample"
    return (f"  {label} {i + 1}/{n} of step {step} | reward {float(row['reward']):.3f} | answer {shown(row['answer'], 40)}\n"
            f"    prompt:   {shown(row['prompt'], 160, tail=True)}\n"
            f"    response: {shown(row['response'], 240)}")
