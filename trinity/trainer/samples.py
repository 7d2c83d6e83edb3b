"""RL samples in the log (trainer.log_samples): every step's (prompt, response, reward, answer) rows of
all data-parallel ranks go to <output_dir>/samples/step_N.jsonl (val ones to val_step_N.jsonl), and
the first few are printed after the step's line (on the steps trainer.log_interval prints). Users read these more than any number."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _gather(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every DP rank's samples, in DP rank order (a collective: every rank calls it)."""
    from megatron.core import parallel_state as ps

    from trinity.distributed import collectives

    return [s for box in collectives.all_gather_object(samples, group=ps.get_data_parallel_group()) for s in box]


def _short(text: str, limit: int, tail: bool = False) -> str:
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    return "..." + text[-limit:] if tail else text[:limit] + "..."


class SampleLog:
    def __init__(self, output_dir: Path, n_print: int, is_rank0: bool):
        self.dir, self.n_print, self.is_rank0 = output_dir / "samples", n_print, is_rank0

    def write(self, step: int, samples: list[dict[str, Any]] | None, printer: Any, name: str = "step",
              show: bool = True) -> None:
        """Gather `samples` (this rank's) over DP, write them to samples/<name>_<step>.jsonl and, when
        `show` (the step's line was printed), print the first n_print with `printer.print` (rank 0). Off
        when trainer.log_samples is 0."""
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
        label = "val sample" if name.startswith("val") else "sample"
        for i, row in enumerate(rows[: self.n_print] if show else []):
            printer.print(f"  {label} {i + 1}/{len(rows)} | reward {float(row['reward']):.3f} | answer {_short(row['answer'], 40)}\n"
                          f"    prompt:   {_short(row['prompt'], 160, tail=True)}\n"
                          f"    response: {_short(row['response'], 240)}")
