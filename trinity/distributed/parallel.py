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

import torch
import torch.distributed as dist

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
        store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timeout)
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)
    _we_created_process_group = True


def init_parallel(*, device: str, layout: ParallelLayout, seed: int, timeout_s: int = 600) -> None:
    """Initialise torch.distributed, megatron-core parallel state (TP, PP, VPP, CP, EP, ETP) and the
    per-rank RNG streams. On `cpu`, cpu_compat.enable() runs first."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if device not in _BACKENDS:
        raise UserError(f"cluster.device: {device!r} is not one of {sorted(_BACKENDS)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("cluster.device: 'cuda' but no CUDA device is visible; use 'cpu'")
    if device == "cpu":
        from trinity.distributed import cpu_compat

        cpu_compat.enable()
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
