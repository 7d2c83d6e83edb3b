"""Model-parallel hand-overs during generation: TP rank 0's samples to its group, and hidden states between
pipeline stages (with virtual pipeline stages, around the ring of stages); both generators use them."""

from __future__ import annotations

from typing import Any

import torch

from trinity.distributed import collectives


def tp_broadcast(tokens: torch.Tensor) -> torch.Tensor:
    """TP rank 0's `tokens` on every rank of its tensor-parallel group (in place)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() > 1:
        collectives.broadcast_(tokens, src=ps.get_tensor_model_parallel_src_rank(), group=ps.get_tensor_model_parallel_group())
    return tokens


class Pipeline:
    """Hand-over between pipeline stages during generation (a no-op at PP=1): hidden states go from each
    stage to the next, the last stage's samples go back to every stage (trinity.rollout.reference, module doc).

    With virtual pipeline stages (VPP) every rank holds `chunks` model chunks and a token visits
    stage0.chunk0 -> ... -> stage(p-1).chunk0 -> stage0.chunk1 -> ... -> stage(p-1).chunk(V-1): megatron's
    previous / next pipeline ranks wrap around, so the hand-over of chunk v's output from the last stage
    to stage 0's chunk v+1 is the same send/recv. Only stage 0's chunk 0 embeds (receives nothing) and
    only the last stage's chunk V-1 computes logits (sends nothing)."""

    def __init__(self, gpt: Any, device: torch.device, dtype: torch.dtype) -> None:
        from megatron.core import parallel_state as ps

        gpts = list(gpt) if isinstance(gpt, (list, tuple)) else [gpt]
        self.chunks = len(gpts)
        self.size = ps.get_pipeline_model_parallel_world_size()
        self.first, self.last = (True, True) if self.size == 1 else (gpts[0].pre_process, gpts[-1].post_process)
        self.device, self.dtype, self.hidden_size = device, dtype, gpts[0].config.hidden_size
        if self.size > 1:
            self.group = ps.get_pipeline_model_parallel_group()
            self.src = ps.get_pipeline_model_parallel_last_rank()
            self.prev = ps.get_pipeline_model_parallel_prev_rank()
            self.next = ps.get_pipeline_model_parallel_next_rank()

    def recv(self, seq: int, batch: int, chunk: int = 0) -> torch.Tensor | None:
        """Model chunk `chunk`'s input [seq, batch, h] from the previous rank of the ring (None on the
        first stage's chunk 0, which embeds)."""
        if self.size == 1 or (self.first and chunk == 0):
            return None
        buf = torch.empty(seq, batch, self.hidden_size, dtype=self.dtype, device=self.device)
        return collectives.recv(buf, src=self.prev, group=self.group)

    def send(self, hidden: torch.Tensor, chunk: int | None = None) -> None:
        """Model chunk `chunk`'s output (default: the last chunk) to the next rank of the ring (nothing on
        the last stage's last chunk, which samples)."""
        chunk = self.chunks - 1 if chunk is None else chunk
        if self.size == 1 or (self.last and chunk == self.chunks - 1):
            return
        collectives.send(hidden.to(self.dtype), dst=self.next, group=self.group)

    def from_last(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as the last stage holds it, on every stage."""
        return collectives.broadcast_(t, src=self.src, group=self.group) if self.size > 1 else t
