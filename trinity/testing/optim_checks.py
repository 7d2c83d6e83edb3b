"""Training steps through the trainer's optimizer, shared by the CPU and GPU tests of
`trinity.compat.fused_optimizer`."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from trinity.config.megatron import MegatronConfig
from trinity.config.schema import OptimConfig
from trinity.compat import fused_optimizer
from trinity.trainer.engine import grad_fusion

TOKENS = [[3, 9, 27, 81, 4, 12, 36, 8], [5, 25, 7, 49, 11, 13, 17, 19]]


@contextmanager
def megatron_stock() -> Iterator[None]:
    """Build the trainer's DDP and optimizer as megatron-core ships them without TE/apex (local
    fallbacks, foreach AdamW, bf16 weight gradients added by DDP's hook)."""
    install, use = fused_optimizer.install, fused_optimizer.use_fused_adamw
    fused_optimizer.uninstall()
    fused_optimizer.install, fused_optimizer.use_fused_adamw = (lambda: False), (lambda optimizer: 0)
    try:
        with no_grad_fusion():
            yield
    finally:
        fused_optimizer.install, fused_optimizer.use_fused_adamw = install, use


@contextmanager
def no_grad_fusion() -> Iterator[None]:
    """Build the trainer's DDP with bf16 weight gradients added by DDP's hook (megatron-core's path
    without apex), everything else as the trainer has it."""
    fuse = grad_fusion.enable
    grad_fusion.enable = lambda chunks: 0
    try:
        yield
    finally:
        grad_fusion.enable = fuse


def trainer_steps(facts: Any, path: Path, *, device: str, dtype: torch.dtype, distributed: bool,
                  steps: int = 3
                  ) -> tuple[list[torch.optim.Optimizer], list[float], list[torch.Tensor], list[torch.Tensor]]:
    """`steps` steps of the trainer's DDP + megatron optimizer over the HF weights at `path`, with
    gradient clipping active (clip_grad far below the tiny model's gradient norm). Returns (the torch
    Adams inside, the grad norms, the parameters before, the parameters after)."""
    from trinity.convert.builtin import load_hf_weights
    from trinity.models.build import build_model
    from trinity.trainer.engine.setup import build_train_state

    m = MegatronConfig(use_distributed_optimizer=distributed)
    chunks = build_model(facts, m, device=device, dtype=dtype)
    load_hf_weights(chunks, path, facts)
    start = [p.detach().clone() for p in chunks[0].parameters()]
    state = build_train_state(chunks, m, OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=1e-3), dtype=dtype,
                              total_steps=10)
    tokens = torch.tensor(TOKENS, device=device)
    positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
    norms = []
    for _ in range(steps):
        for chunk in state.model:
            chunk.zero_grad_buffer()
        state.optimizer.zero_grad()
        state.model[0](tokens, positions, None).float().log_softmax(-1)[..., 1].mean().neg().backward()
        for chunk in state.model:
            chunk.finish_grad_sync()
        ok, norm, _ = state.optimizer.step()
        assert ok
        norms.append(norm)
    after = [p.detach().clone() for p in state.model[0].parameters()]
    return fused_optimizer.torch_adams(state.optimizer), norms, start, after
