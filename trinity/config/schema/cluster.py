"""The `cluster:` block: devices, nodes and processes (torchrun's options)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trinity.config.megatron import StrictModel


class ClusterConfig(StrictModel):
    """Where the job runs; matches torchrun's options."""

    device: Literal["cuda", "cpu"] = "cuda"
    """`cuda` (NCCL, bf16) or `cpu` (gloo, fp32; for tiny jobs and debugging configs)."""
    nnodes: int = Field(default=1, ge=1)
    """Number of nodes (one `trinity run` per node)."""
    nproc_per_node: int = Field(default=1, ge=1)
    """Processes per node: one per GPU on cuda."""
    node_rank: int = Field(default=0, ge=0)
    """This node's rank in [0, nnodes)."""
    master_addr: str = "127.0.0.1"
    """Address of node 0 (multi-node)."""
    master_port: int = Field(default=29500, ge=1, le=65535)
    """Port on node 0 for the rendezvous."""
    rdzv_endpoint: str | None = None
    """Optional `host:port` of a c10d rendezvous (elastic); replaces master_addr/master_port."""
    max_restarts: int = Field(default=0, ge=0)
    """Times torchrun restarts the workers after a failure."""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node
