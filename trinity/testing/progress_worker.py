"""A stand-in for a training worker in the tests of what `trinity run` shows (trinity.trainer.progress):
rank 0's metrics logger over 4 steps (lines at steps 1, 3 and 4), a sample whose response holds an escape
sequence and bytes that are not UTF-8, and the closing summary, without a model.

    python -m trinity.testing.progress_worker OUT_DIR GO_FILE

With the bar on, after step 2 (a step without a line: its frame is an unfinished line) it waits for
GO_FILE, which the test writes once the terminal shows that frame: a relay that passed on only whole lines
would never show it (exit 3 after 60 s)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

TOTAL, INTERVAL = 4, 3


def row(step: int) -> dict:
    return {"step": step, "loss": 4.0 / step, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0,
            "step_time_s": 0.1, "mem_peak_gib": 0.25}


def main(argv: list[str]) -> int:
    from trinity.trainer.metrics import MetricsLogger
    from trinity.trainer.samples import sample_text
    from trinity.trainer.summary import read_metrics, summary_lines

    out, go = Path(argv[0]), Path(argv[1])
    logger = MetricsLogger(out, enabled=True, total_steps=TOTAL, start_step=0, log_interval=INTERVAL, tensorboard=False)
    for step in range(1, TOTAL + 1):
        time.sleep(0.1)
        logger.log(row(step))
        if step == 2 and logger.live:
            deadline = time.monotonic() + 60
            while not go.exists():
                if time.monotonic() > deadline:
                    return 3
                time.sleep(0.05)
    sample = {"prompt": "What is 2+2?\nAnswer:", "response": "4\x1b[2J\ufffd", "reward": 1.0, "answer": "4"}
    logger.print(sample_text(sample, 0, 8, TOTAL))
    logger.close()
    print("\n".join(summary_lines(out, read_metrics(out / "metrics.jsonl"))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
