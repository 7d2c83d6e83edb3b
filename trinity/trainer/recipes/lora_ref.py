"""What the RL and DPO recipes do differently with LoRA (actor.lora.rank >= 1).

- The reference policy is the actor's own engine with its adapters switched off (`AdaptersOff`): the base
  weights are frozen, so "adapters off" IS the initial policy, bit for bit, and no second model (no
  Role.ref engine, no second copy of the weights) is built.
- The rollout decoders' lean path reads the base weights directly (trinity.rollout.decode), not through the
  adapters' forward hooks: by default around a rollout every adapted weight holds W + alpha/rank * B A
  (`rollout_weights`), and gets its original bits back afterwards (trinity.models.lora.adapters_merged);
  with actor.lora.rollout_weights `adapters` nothing is merged and the decoders add each active adapter's
  x A^T B^T beside the base GEMM (trinity.models.lora.linear / addmm).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterator, Sequence, TypeVar

import torch

from trinity.trainer.engine import MicroBatch, RoleEngine

if TYPE_CHECKING:
    from trinity.config.schema import JobConfig

M = TypeVar("M", bound=MicroBatch)


def uses_lora(cfg: JobConfig) -> bool:
    """Whether the job trains LoRA adapters on the actor (a JobConfig)."""
    return cfg.actor_rollout_ref.actor.lora.rank > 0


class AdaptersOff:
    """The reference policy of a LoRA job: `infer_batch` runs the actor's engine with every adapter off.

    It owns no memory: `need` does nothing (the actor's own phases decide where its parameters are; the
    reference phase asks for the actor's parameters)."""

    def __init__(self, actor: RoleEngine):
        self.actor = actor

    def infer_batch(self, micro_batches: Sequence[M], reduce_fn: Callable[[torch.Tensor, M], torch.Tensor],
                    result_shape: tuple[int, ...]) -> torch.Tensor:
        from trinity.models.lora import adapters_disabled

        with adapters_disabled(self.actor.model):
            return self.actor.infer_batch(micro_batches, reduce_fn, result_shape)

    def need(self, *, params: bool, grads: bool = False, optim: bool = False) -> None:
        return None


# Keep the original weights on the GPU during a rollout only while this share of the device's memory stays
# free besides them (the rollout's KV cache and logits need room); otherwise they wait in host memory.
DEVICE_KEEP_FREE = 0.25


@contextlib.contextmanager
def rollout_weights(actor: RoleEngine | Sequence[torch.nn.Module], keep: str = "auto") -> Iterator[None]:
    """Around a rollout: the adapters merged into the actor's base weights (W + alpha/rank * B A, rounded to
    the weight's dtype), restored bit-exactly on exit; nothing for a model without adapters. `actor`: a
    RoleEngine or model chunks.

    Where the original bits wait decides the cost (benchmarks/lora_merge.py, one H100, 7B shape, rank 16 on
    every linear, 12.2 GiB of adapted weights): in host memory (trinity.models.lora.adapters_merged) the
    copies out and back took 9.1 + 2.1 s against a 2.6 s rollout of 64 x 256 tokens; a copy on the GPU takes
    milliseconds. `keep` (actor.lora.rollout_weights): "device" (a GPU copy), "host" (adapters_merged), "auto"
    (the GPU copy while at least DEVICE_KEEP_FREE of the device's memory stays free besides it, else the
    host), "adapters" (no merge: the decoders compute the adapters beside the base weights)."""
    from trinity.models.lora import adapters_merged, lora_modules

    chunks = actor.modules if isinstance(actor, RoleEngine) else actor
    if keep not in ("auto", "device", "host", "adapters"):
        raise ValueError(f"rollout_weights: keep must be auto, device, host or adapters, got {keep!r}")
    entries = [(m, a) for _, m, a in lora_modules(chunks)]
    if not entries or keep == "adapters":
        yield
        return
    weight = entries[0][0].weight
    if keep == "auto":
        keep = "host"
        if weight.is_cuda:
            need = sum(m.weight.numel() * m.weight.element_size() for m, _ in entries)
            free, total = torch.cuda.mem_get_info(weight.device)
            keep = "device" if free - need >= DEVICE_KEEP_FREE * total else "host"
    with adapters_merged(chunks, keep=keep):
        yield
