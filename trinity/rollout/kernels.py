"""Which kernels the continuous engine's decode steps may take: `DecodeKernels`, an argument of
`trinity.rollout.continuous.generate_continuous` (default: every fast path where it runs).

Each fast path still runs only where it works: Triton on CUDA, a supported head size, and a first-use
check in the process that compares it with the torch ops (a failed check gives a warning and the torch
ops). Switching one off here is for comparisons (benchmarks/generate.py --attention, --sampler,
--ladder, --full-grid) and for tests that need the torch path on a device where the kernel runs.
"""

from __future__ import annotations

from dataclasses import dataclass

# rows x groups from which each (row, group) is one program, no splits and no merge kernel: ~one program per
# SM of an H100 (132). Per layer that was 5-25% faster than splitting from 128 programs up; the rollouts
# of 0.5B and 1.5B RL steps took 4.5-5% less than with 512 (docs/performance.md, "Decode kernels")
FULL_GRID = 128


@dataclass(frozen=True)
class DecodeKernels:
    split_kv: bool = True
    """The split-KV Triton decode attention (`trinity.rollout.decode_attention`); False: SDPA."""
    fused: bool = True
    """RoPE + cache store and SwiGLU in Triton kernels on lean layers (`trinity.rollout.decode_fused`)."""
    shared_prompt_keys: bool = True
    """A prompt's samples read one copy of its keys (split-KV only); False: each its own copy."""
    fused_sampler: bool = True
    """The one-pass sampler over the logits (`trinity.rollout.sampler`); False: the torch ops."""
    tuned_buckets: bool = True
    """Leave out batch buckets whose GEMMs time slower than a larger one's (`trinity.rollout.buckets`);
    False: the plain ladder."""
    full_grid: int = FULL_GRID
    """Rows x query groups from which the split-KV kernel runs one program per (row, group), unsplit."""
