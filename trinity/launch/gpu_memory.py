"""This machine's GPU memory against the job's memory estimate: `trinity validate` and `trinity run` warn
when the estimated peak per GPU (trinity.config.plan) leaves less than a tenth of a GPU free, before a job
loads its weights for minutes and runs out of memory at its first update.

The memory is read with `nvidia-smi` (as a user would), not through torch: a CUDA context in the CLI's
process would hold ~0.5 GiB of GPU 0 for the whole job.
"""

from __future__ import annotations

import os
import subprocess

from trinity.config.plan import human_bytes

HEADROOM = 0.9  # the estimate leaves out the CUDA context, NCCL buffers and the allocator's fragmentation


def visible_gpu_memory() -> int | None:
    """Bytes of the smallest GPU this process may use (CUDA_VISIBLE_DEVICES by index or UUID); None where
    nvidia-smi is missing, fails, or lists none of them."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    gpus = {}
    for line in proc.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[2].isdigit():
            gpus[(parts[0], parts[1])] = int(parts[2]) * 2**20
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        wanted = {v.strip() for v in visible.split(",") if v.strip()}
        gpus = {k: v for k, v in gpus.items() if k[0] in wanted or k[1] in wanted}
    return min(gpus.values()) if gpus else None


def memory_warning(peak_per_gpu: int, gpu_bytes: int | None) -> str | None:
    """The warning `trinity validate` / `trinity run` print, or None when the estimate fits (or no GPU was read)."""
    if gpu_bytes is None or peak_per_gpu <= HEADROOM * gpu_bytes:
        return None
    return (f"the estimated peak per GPU, {human_bytes(peak_per_gpu)}, is more than {HEADROOM:.0%} of this machine's "
            f"GPUs ({human_bytes(gpu_bytes)} each, nvidia-smi): the job may run out of GPU memory. Lower what the "
            "busiest role holds (RL: actor.ppo_max_token_len_per_gpu or ref.log_prob_max_token_len_per_gpu; "
            "trainer.micro_batch_size), turn on recompute (megatron.override_transformer_config.recompute_granularity) "
            "or offload, or spread the model over more GPUs (docs/memory-estimate.md)")
