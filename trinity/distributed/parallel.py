"""torch.distributed + megatron-core parallel state for one rank.

Workers run under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Without those,
a single process (tests, notebooks, `trinity convert`) gets a world of one over a local TCP store on a
free port, so the same code path serves both.
"""

from __future__ import annotations

import datetime
import os
import random
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from trinity.distributed import collectives
from trinity.distributed.layout import ParallelLayout
from trinity.errors import UserError

# Backend per device: NCCL for GPUs; gloo is the only CPU backend megatron-core's collectives work on.
_BACKENDS = {"cuda": "nccl", "cpu": "gloo"}

_we_created_process_group = False


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_threads_per_rank(local_ranks: int, cores: int | None = None) -> int:
    """Intra-op threads for each of `local_ranks` CPU worker processes on one host: the cores this
    process may run on (its affinity mask, which taskset/cgroup cpusets narrow), shared evenly, at least 1.
    More threads than cores only adds contention: ranks >= cores gives 1 thread each."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_ranks))


def _omp_threads_from_user() -> bool:
    """Whether OMP_NUM_THREADS was chosen by the user rather than by torchrun.

    torchrun sets OMP_NUM_THREADS=1 in its own environment when it starts several local ranks and the
    variable is unset; its workers cannot tell that from a user's 1 by the value. The variable was the
    user's when it is already in the environment torchrun (our parent) was started with.
    """
    if "OMP_NUM_THREADS" not in os.environ:
        return False
    if "TORCHELASTIC_RUN_ID" not in os.environ or int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= 1:
        return True
    try:
        parent_env = Path(f"/proc/{os.getppid()}/environ").read_bytes().split(b"\0")
    except OSError:  # not Linux, or not readable: take the value as the user's
        return True
    return any(entry.startswith(b"OMP_NUM_THREADS=") for entry in parent_env)


def set_cpu_threads() -> int:
    """Give this rank its share of the host's cores as torch intra-op threads; returns the count.

    torch's default is one thread per core in every process, so N ranks on one host would run N x cores
    threads and slow each other down; torchrun's own default for several ranks (1 thread each) leaves
    cores idle on a large host. An OMP_NUM_THREADS the user set is kept as it is.
    """
    if _omp_threads_from_user():
        return torch.get_num_threads()
    threads = cpu_threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(threads)
    return threads


def _init_process_group(device: str, timeout_s: int) -> None:
    global _we_created_process_group
    if dist.is_initialized():
        return
    backend = _BACKENDS[device]
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        # torchrun: env:// rendezvous from MASTER_ADDR/MASTER_PORT.
        kwargs = {}
        if device == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank)
            kwargs["device_id"] = torch.device("cuda", local_rank)
        dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    else:
        # port 0: the OS picks a free port as the store binds it (a port picked first and bound later
        # can be taken in between by another job starting on the same host)
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)
    _we_created_process_group = True


def init_parallel(*, device: str, layout: ParallelLayout, seed: int, timeout_s: int = 600) -> None:
    """Initialise torch.distributed, megatron-core parallel state (TP, PP, VPP, CP, EP, ETP) and the
    per-rank RNG streams. Every rank takes its share of the host's cores as threads (`set_cpu_threads`);
    on `cpu`, cpu_compat.enable() runs first."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if device not in _BACKENDS:
        raise UserError(f"cluster.device: {device!r} is not one of {sorted(_BACKENDS)}")
    if collectives.strict_requested():
        collectives.install_strict_guard()
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("cluster.device: 'cuda' but no CUDA device is visible; use 'cpu'")
    if device == "cpu":
        from trinity.compat import cpu_compat

        cpu_compat.enable()
    # On GPUs too: torchrun leaves each of several local ranks one intra-op thread, and the host
    # optimizer (`optimizer_offload` in SFT) steps AdamW on the CPU with torch's threads.
    set_cpu_threads()
    _init_process_group(device, timeout_s)
    world = dist.get_world_size()
    try:
        layout.dp(world)
        layout.expert_dp(world)
    except ValueError as exc:
        raise UserError(f"megatron parallel sizes do not fit {world} ranks: {exc}") from None
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        distributed_timeout_minutes=max(1, timeout_s // 60),
    )
    # As Megatron-LM's _set_random_seed: pipeline stages get distinct streams (seed + 100 * PP rank),
    # data-parallel replicas share them; megatron derives the TP and expert streams from that.
    rank_seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(rank_seed)
    torch.manual_seed(rank_seed)
    if device == "cpu":
        cpu_compat.model_parallel_seed(rank_seed)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(rank_seed)


def destroy() -> None:
    """Tear down megatron parallel state and the process group this module created."""
    global _we_created_process_group
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized() and _we_created_process_group:
        dist.destroy_process_group()
        _we_created_process_group = False
