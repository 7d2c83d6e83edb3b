"""What a conversion reports: bytes, time, phases and, with --verify, the largest difference found."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ConvertReport:
    direction: str
    output: str
    bytes_written: int
    seconds: float
    tensors: int = 0
    max_abs_diff: float | None = None
    mean_abs_diff: float | None = None
    verified: str | None = None  # what was compared, when --verify
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase (rank 0), in order

    @property
    def gb_per_s(self) -> float:
        return self.bytes_written / 1e9 / self.seconds if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        line = (
            f"{self.direction}: wrote {_num(self.bytes_written / 1e9)} GB to {self.output} in {self.seconds:.2f} s "
            f"({_num(self.gb_per_s)} GB/s)"
        )
        if self.phases:
            line += " [" + ", ".join(f"{k} {v:.2f} s" for k, v in self.phases.items()) + "]"
        if self.verified:
            line += f"; verified {self.verified}: max |Δ| {self.max_abs_diff:.3e}, mean |Δ| {self.mean_abs_diff:.3e}"
        return line


def _num(x: float) -> str:
    """Three significant digits, never scientific notation: 15.2, 0.153, 0.000412 (tiny models too)."""
    if x == 0:
        return "0"
    digits = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:.{digits}f}"


def dir_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def report_to_json(report: ConvertReport) -> dict[str, Any]:
    return asdict(report)
