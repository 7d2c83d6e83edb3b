"""Batch buckets of the continuous engine's decode steps: the row counts a step runs at (one CUDA graph each).

The ladder: powers of two up to 64, then multiples of 64 up to the slot count (few graphs, under 2x
padding). A step runs the smallest bucket that holds its highest live slot.

Why the ladder is tuned on CUDA: cuBLAS's heuristics give some row counts a slow kernel. On an H100
(torch 2.11+cu130) the 7B gate/up projection took 358 us at 448 rows against 217 us at 512,
and a 448-row decode step 18.9 ms against 15.2 ms at 512 (docs/performance.md, "Per batch bucket"). So
`decode_buckets` times the GEMMs of one decode step of this rank's layers at each bucket from 64 rows up
and leaves a bucket out when a larger one takes less than (1 - MARGIN) of its time: its steps then run
in that larger bucket, whose padding rows cost less than the slow kernel. The margin keeps timing noise
(a few percent) from changing the ladder from one run to the next (the engine's timing put the 512-row
GEMMs at 0.64x of the 448-row ones). The ranks of a model-parallel group add up their times, so that all of them pick the same
ladder (their steps exchange hidden states and all-reduce at the same shapes). Measured once per process
and slot count (an RL job's later rollouts reuse it). `DecodeKernels(tuned_buckets=False)` keeps the
plain ladder (a comparison).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from trinity.rollout.decode import capture_graph
from trinity.rollout.kv_budget import model_parallel_all_reduce

SMALL = 64  # below this, powers of two; the buckets tuned start here
MARGIN = 0.15  # a bucket is left out when a larger one takes less than (1 - MARGIN) of its time
REPS = 3  # timed replays per bucket (the fastest counts)


def plain_bucket(n: int, cap: int) -> int:
    """The plain ladder's bucket for n rows: powers of two up to 64, then multiples of 64, at most cap."""
    b = 1
    while b < n and b < SMALL:
        b *= 2
    if b < n:
        b = -(-n // SMALL) * SMALL
    return min(b, cap)


@dataclass(frozen=True)
class Buckets:
    """The buckets of a rollout (ascending, the last the slot count) and, for the log, the buckets left
    out: (bucket, the larger one its steps run in, that one's GEMM time / the bucket's)."""

    sizes: tuple[int, ...]
    dropped: tuple[tuple[int, int, float], ...] = ()

    @classmethod
    def plain(cls, cap: int) -> "Buckets":
        return cls(tuple(sorted({plain_bucket(n, cap) for n in range(1, cap + 1)})))

    def __call__(self, n: int) -> int:
        """The bucket a step with n rows (1 <= n <= the slot count) runs at."""
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    @property
    def note(self) -> str:
        """'' for the plain ladder; else e.g. '448 rows run as 512 (0.74x the GEMM time)'."""
        return "; ".join(f"{b} rows run as {to} ({r:.2f}x the GEMM time)" for b, to, r in self.dropped)


def choose(candidates: Sequence[int], times: Sequence[float], margin: float = MARGIN) -> tuple[list[int], list[tuple[int, int, float]]]:
    """Which of the ascending `candidates` (times: their GEMM times) to keep: every one for which no larger
    candidate takes less than (1 - margin) of its time (the largest is always kept). Returns the kept ones
    and, per dropped one, (it, the smallest kept one above it, that one's time / its time)."""
    keep = [b for i, b in enumerate(candidates) if all(t >= (1 - margin) * times[i] for t in times[i + 1:])]
    time_of = dict(zip(candidates, times))
    dropped = []
    for b in candidates:
        if b not in keep:
            to = next(k for k in keep if k > b)
            dropped.append((b, to, time_of[to] / time_of[b]))
    return keep, dropped


_TUNED: dict[tuple, Buckets] = {}


def decode_buckets(gpts: Sequence[Any], cap: int, device: torch.device, *, tuned: bool = True) -> Buckets:
    """The buckets for `cap` slots (module doc): the plain ladder with tuned=False, on CPU, below 2 buckets of 64+ rows, or where a rank of the model-parallel group has layers that are not a dense
    GPT's; else tuned by timing. Every rank of the group calls it with the same `cap` (as `plan_slots`)."""
    plain = Buckets.plain(cap)
    candidates = [b for b in plain.sizes if b >= SMALL]
    if not tuned or device.type != "cuda" or len(candidates) < 2:
        return plain
    gemms = step_gemms(gpts, device)
    key = (str(device), cap, None if gemms is None else
           tuple((kind, tuple(w.shape), b is not None, w.dtype) for kind, w, b in gemms))
    if key not in _TUNED:
        _TUNED[key] = agree(None if gemms is None else [gemm_ms(gemms, m) for m in candidates], plain)
    return _TUNED[key]


def agree(times: list[float] | None, plain: Buckets) -> Buckets:
    """The ladder of the model-parallel group from each rank's GEMM times at the plain ladder's buckets of
    SMALL rows and more (None: this rank's layers cannot be timed). One collective, made by every rank:
    the count of ranks that timed and their summed times; the plain ladder unless all of them timed."""
    candidates = [b for b in plain.sizes if b >= SMALL]
    t, ranks = model_parallel_all_reduce(
        torch.tensor([float(times is not None), *(times or [0.0] * len(candidates))], dtype=torch.float64))
    if t[0].item() < ranks:
        return plain
    keep, dropped = choose(candidates, t[1:].tolist())
    return Buckets(tuple(b for b in plain.sizes if b < SMALL) + tuple(keep), tuple(dropped))


def step_gemms(gpts: Sequence[Any], device: torch.device) -> list[tuple[str, torch.Tensor, torch.Tensor | None]] | None:
    """The GEMMs of one decode step of these model chunks, as the lean decode path calls them
    (`trinity.rollout.decode.StageDecoder._lean_layer`): per layer QKV (F.linear with its bias), the output
    projection (`addmm_` into the residual), gate/up (F.linear) and down (`addmm_`); the LM head on the last
    stage. None when a layer has no such linears (no tuning) or a weight is not on `device`."""
    out: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []
    for g in gpts:
        for layer in g.decoder.layers:
            attn, mlp = getattr(layer, "self_attention", None), getattr(layer, "mlp", None)
            mods = [getattr(attn, "linear_qkv", None), getattr(attn, "linear_proj", None),
                    getattr(mlp, "linear_fc1", None), getattr(mlp, "linear_fc2", None)]
            if any(getattr(m, "weight", None) is None for m in mods):
                return None
            qkv, proj, fc1, fc2 = mods
            out += [("linear", qkv.weight, qkv.bias), ("addmm", proj.weight, None), ("linear", fc1.weight, None),
                    ("addmm", fc2.weight, None)]
        if getattr(g, "post_process", False):
            w = g.shared_embedding_or_output_weight() if g.share_embeddings_and_output_weights else g.output_layer.weight
            if w is None:
                return None
            out.append(("linear", w, None))
    if not out or any(not _on(w, device) or w.dim() != 2 for _, w, _ in out):
        return None
    return out


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """t is on `device` ("cuda" meaning the current CUDA device)."""
    if t.device.type != device.type:
        return False
    if device.type == "cuda" and device.index is None:
        return t.device.index == torch.cuda.current_device()
    return device.index is None or t.device.index == device.index


def gemm_ms(gemms: list[tuple[str, torch.Tensor, torch.Tensor | None]], m: int) -> float:
    """Milliseconds of `gemms` at m rows, captured as one CUDA graph (as a decode step runs them), the
    fastest of REPS replays."""
    w0 = gemms[0][1]
    xs: dict[int, torch.Tensor] = {}
    ys: dict[int, torch.Tensor] = {}
    for kind, w, _ in gemms:
        xs.setdefault(w.shape[1], torch.randn(m, w.shape[1], device=w0.device, dtype=w0.dtype))
        if kind == "addmm":
            ys.setdefault(w.shape[0], torch.zeros(m, w.shape[0], device=w0.device, dtype=w0.dtype))

    def run() -> None:
        for kind, w, bias in gemms:
            x = xs[w.shape[1]]
            if kind == "addmm":
                ys[w.shape[0]].addmm_(x, w.t())
            else:
                torch.nn.functional.linear(x, w, bias)

    with torch.no_grad():
        # as the decode steps are captured: on the capture stream, after a run there (cuBLAS's heuristics)
        graph, _ = capture_graph(run, warm=run)
        best = float("inf")
        for _ in range(REPS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end))
        del graph
    return best
