"""The continuous-batching engine's KV-cache budget: how many sequences (slots) its pool holds.

`slots = min(max_num_seqs, rows, budget // bytes per slot)`, the same on every rank of a model-parallel
group (the minimum over it); the budget is `kv_cache_memory_gib`, else `gpu_memory_utilization` x the
memory free when the rollout starts (host memory on CPU). A slot is `cache_len` tokens of keys and
values in every layer of this rank's pipeline stage (all its model chunks under VPP).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from trinity.distributed import collectives
from trinity.errors import UserError
from trinity.rollout import decode_mla

DEFAULT_GPU_MEMORY_UTILIZATION = 0.8


@dataclass(frozen=True)
class KVBudget:
    """How many sequences the engine decodes at once (`actor_rollout_ref.rollout`'s fields of the same
    names). kv_cache_memory_gib wins over gpu_memory_utilization (the config refuses both set)."""

    max_num_seqs: int = 1024
    gpu_memory_utilization: float | None = None
    kv_cache_memory_gib: float | None = None

    @classmethod
    def from_config(cls, rollout: Any) -> "KVBudget":
        """From `actor_rollout_ref.rollout` (a RolloutConfig)."""
        return cls(rollout.max_num_seqs, rollout.gpu_memory_utilization, rollout.kv_cache_memory_gib)

    def budget_bytes(self, device: torch.device) -> tuple[int, str]:
        if self.kv_cache_memory_gib is not None:
            return int(self.kv_cache_memory_gib * 2**30), "kv_cache_memory_gib"
        util = DEFAULT_GPU_MEMORY_UTILIZATION if self.gpu_memory_utilization is None else self.gpu_memory_utilization
        return int(util * free_memory(device)), "gpu_memory_utilization"


def free_memory(device: torch.device) -> int:
    """Bytes the KV cache could take now: free device memory plus what torch's allocator holds unused
    (CUDA); available host memory (CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def model_parallel_all_reduce(t: torch.Tensor, op: collectives.Op = "sum") -> tuple[torch.Tensor, int]:
    """`t` reduced over this rank's model-parallel group (TP x PP), whose ranks must make the same
    scheduling decisions, and the group's size (1 without one)."""
    from megatron.core import parallel_state as ps

    if not collectives.active() or ps.get_model_parallel_group() is None:
        return t, 1
    group = ps.get_model_parallel_group()
    return collectives.all_reduce(t, op, group=group), collectives.size(group)


def _model_parallel_min(value: int) -> int:
    """The smallest `value` over this rank's model-parallel group: its ranks must agree."""
    t, _ = model_parallel_all_reduce(torch.tensor([value], dtype=torch.long), "min")
    return int(t.item())


def kv_bytes_per_token(gpt: Any) -> int:
    """Bytes of keys and values one token takes in this stage's layers (this TP rank's heads); `gpt` may
    be the rank's list of model chunks (VPP)."""
    if isinstance(gpt, (list, tuple)):
        return sum(kv_bytes_per_token(g) for g in gpt)
    first = gpt.decoder.layers[0].self_attention
    elem = next(gpt.parameters()).element_size()
    if decode_mla.is_mla(gpt):  # per-head keys and values expanded from the latent (decode_mla)
        return len(gpt.decoder.layers) * first.num_attention_heads_per_partition * sum(decode_mla.head_dims(first)) * elem
    return len(gpt.decoder.layers) * 2 * first.num_query_groups_per_partition * first.hidden_size_per_attention_head * elem


def plan_slots(gpt: Any, budget: KVBudget, rows: int, cache_len: int, device: torch.device) -> int:
    """Slots of the pool: max_num_seqs, the rows there are and what the KV budget holds, the same on
    every rank of the model-parallel group; a budget below one sequence is a UserError naming the key."""
    per_slot = kv_bytes_per_token(gpt) * cache_len
    nbytes, key = budget.budget_bytes(device)
    slots = _model_parallel_min(min(budget.max_num_seqs, rows, nbytes // per_slot))
    if slots < 1:
        raise UserError(
            f"actor_rollout_ref.rollout.{key}: the KV cache budget ({nbytes / 2**30:.3g} GiB) holds no sequence: one "
            f"sequence of {cache_len} tokens (longest prompt + response_length) needs {per_slot / 2**30:.3g} GiB; "
            f"raise {key} or lower data.max_prompt_length / actor_rollout_ref.rollout.response_length")
    return slots
