"""Training steps under torch.profiler: `trainer.profile_step` (one step, every rank) or verl's blocks
`actor_rollout_ref.actor.profile` (steps [step_start, step_end) counted from 0, on profile_ranks, into
save_path) and `actor_rollout_ref.actor.profiler` (trainer.profile_step on `ranks` / `all_ranks`).

Each profiled rank writes, per profiled step, a Chrome trace (open it in chrome://tracing or
https://ui.perfetto.dev) to `<folder>/step_<N>.rank_<R>.json.gz` (folder: save_path, default
`<output_dir>/profile`; N is trinity's 1-based step) and, beside it (`.txt`), where its GPU time went by
kind of kernel (GEMM, attention, optimizer, compiled, ...) against the step's wall time; the logging
rank also prints its own when it profiles. Ranks of different pipeline stages or roles differ: compare
their files. The summary is the one `benchmarks/train_step.py --profile` prints, so a job and a
benchmark of it compare directly. Profiling costs host time during those steps only; their metrics
lines are marked `profiled`.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

# Kernel-name patterns of each kind of GPU work, first match wins.
KERNEL_KINDS = (
    ("attention", ("flash", "fmha", "cudnn", "attention", "flex")),
    ("optimizer", ("multi_tensor", "adam")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_")),
    ("compiled (triton)", ("triton",)),
    ("norm", ("rms_norm", "rmsnorm", "layer_norm", "layernorm")),
    ("copy / cat", ("copy", "cat", "transpose")),
    ("reduce", ("reduce",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def kernel_kind_totals(events: Any) -> dict[str, list[float]]:
    """{kind: [GPU ms, kernels]} over profiler `key_averages()` rows. Only device rows count, and not
    the user annotations that the profiler also puts on the GPU timeline (`Optimizer.step#AdamW.step`
    spans the optimizer's kernels: counting it too doubled the optimizer's time)."""
    totals: dict[str, list[float]] = {}
    for evt in events:
        if not str(getattr(evt, "device_type", "")).endswith("CUDA"):
            continue
        if getattr(evt, "is_user_annotation", False) or evt.key.startswith(("Optimizer.", "ProfilerStep")):
            continue
        us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
        entry = totals.setdefault(kernel_kind(evt.key), [0.0, 0])
        entry[0] += us / 1e3
        entry[1] += evt.count
    return totals


def kernel_kind_table(totals: dict[str, list[float]], wall_s: float) -> list[str]:
    """Lines of a table of GPU time per kind of kernel against the profiled step's wall time."""
    busy = sum(ms for ms, _ in totals.values())
    lines = [f"GPU busy {busy:.1f} ms of a {wall_s * 1e3:.1f} ms profiled step", "kind | ms | kernels | share of busy"]
    for kind, (ms, n) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{kind} | {ms:.1f} | {n} | {100 * ms / max(busy, 1e-9):.1f}%")
    return lines


def trace_path(output_dir: Path, step: int, rank: int, folder: Path | None = None) -> Path:
    """The trace of `step` on `rank`: in `folder`, or `<output_dir>/profile` by default."""
    return (folder or output_dir / "profile") / f"step_{step}.rank_{rank}.json.gz"


def summary_path(output_dir: Path, step: int, rank: int, folder: Path | None = None) -> Path:
    return (folder or output_dir / "profile") / f"step_{step}.rank_{rank}.txt"


class StepProfiler:
    """Profiles the steps in `steps` of a training loop on this rank (nothing when the rank is not among
    `ranks`; None: every rank); `summary` holds the lines of the last profiled step.

    `StepProfiler(profile_step, output_dir, rank, device)` is `trainer.profile_step` on every rank;
    `from_config` reads every profiling option of a job."""

    def __init__(
        self,
        profile_step: int | None,
        output_dir: Path,
        rank: int,
        device: torch.device,
        *,
        steps: Iterable[int] = (),
        ranks: Iterable[int] | None = None,
        folder: Path | str | None = None,
    ):
        self.steps = frozenset(steps) | ({profile_step} if profile_step is not None else frozenset())
        if ranks is not None and rank not in set(ranks):
            self.steps = frozenset()
        self.profile_step = profile_step
        self.output_dir = output_dir
        self.folder = Path(folder) if folder is not None else None
        self.rank = rank
        self.device = device
        self.summary: list[str] = []
        self.profiled = False  # whether the last step() was a profiled one

    @classmethod
    def from_config(cls, cfg: Any, output_dir: Path, rank: int, device: torch.device) -> StepProfiler:
        """The profiler a job's config asks for (a validated JobConfig; the rules allow one of the three
        forms at a time): verl's `actor.profile` step range, verl's `actor.profiler` ranks for
        `trainer.profile_step`, or `trainer.profile_step` alone on every rank."""
        step = cfg.trainer.profile_step
        old = cfg.actor_rollout_ref.actor.profile
        new = cfg.actor_rollout_ref.actor.profiler
        if old.use_profile:
            # verl counts optimizer steps from 0; trinity's steps count from 1.
            return cls(None, output_dir, rank, device, steps=range(old.step_start + 1, old.step_end + 1),
                       ranks=old.profile_ranks if old.profile_ranks is not None else [0], folder=old.save_path)
        if new.enable:
            return cls(step, output_dir, rank, device, ranks=None if new.all_ranks else new.ranks, folder=new.save_path)
        return cls(step, output_dir, rank, device)

    def log(self, metrics: Any, row: dict[str, Any]) -> None:
        """`metrics.log(row)` for the step just run, marked `profiled` (and followed by the summary) when
        it was the profiled one."""
        metrics.log({**row, "profiled": 1} if self.profiled else row)
        for line in self.summary if self.profiled else ():
            metrics.print(line)

    @contextlib.contextmanager
    def step(self, step: int, extra: Callable[[], list[str]] = list) -> Iterator[bool]:
        """Runs the body under the profiler when `step` is the profiled one; yields whether it is. `extra()`
        gives lines the summary ends with (`Recipe.profile_lines`: an RL step's rollout per batch bucket)."""
        self.profiled = step in self.steps
        if not self.profiled:
            yield False
            return
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            yield True
            if cuda:
                torch.cuda.synchronize(self.device)
            wall = time.perf_counter() - t0
        path = trace_path(self.output_dir, step, self.rank, self.folder)
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        if cuda:
            self.summary = kernel_kind_table(kernel_kind_totals(prof.key_averages()), wall)
        else:  # no GPU rows: the host ops that took the most time
            rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]
            self.summary = [f"host time of a {wall * 1e3:.1f} ms profiled step, top ops", "op | ms | calls"]
            self.summary += [f"{e.key} | {e.self_cpu_time_total / 1e3:.1f} | {e.count}" for e in rows]
        self.summary.insert(0, f"profiled step {step}: trace {path}")
        self.summary += extra()
        summary_path(self.output_dir, step, self.rank, self.folder).write_text("\n".join(self.summary) + "\n")


__all__ = ["KERNEL_KINDS", "StepProfiler", "kernel_kind", "kernel_kind_table", "kernel_kind_totals", "summary_path",
           "trace_path"]
