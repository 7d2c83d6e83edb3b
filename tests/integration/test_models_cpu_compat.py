"""cpu_compat in use: megatron-core's DDP, optimizers, grad clipping and schedule on CPU (world 1)."""

from __future__ import annotations

import pytest
import torch

from trinity.config.megatron import MegatronConfig
from trinity.distributed.layout import ParallelLayout
from trinity.models.facts import ModelFacts
from trinity.testing.tiny_models import make_tiny_hf_model

SEED = 4


@pytest.fixture(scope="module")
def tp1():
    from trinity.distributed.parallel import destroy, init_parallel

    init_parallel(device="cpu", layout=ParallelLayout(), seed=SEED)
    yield
    destroy()


def train_steps(model_dir, *, distributed_optimizer: bool, steps: int = 3) -> list[tuple[float, float]]:
    """(loss, grad norm) per optimizer step through get_forward_backward_func and a megatron optimizer
    with grad clipping."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from trinity.compat import cpu_compat
    from trinity.models.build import build_model, causal_mask

    torch.manual_seed(SEED)
    cpu_compat.model_parallel_seed(SEED)
    chunks = build_model(ModelFacts.from_hf_dir(model_dir), MegatronConfig(), device="cpu", dtype=torch.float32)
    config = chunks[0].config
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer, overlap_grad_reduce=distributed_optimizer,
        grad_reduce_in_fp32=True,
    )
    models = [DistributedDataParallel(config, ddp_config, c) for c in chunks]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0, use_distributed_optimizer=distributed_optimizer),
        models,
    )
    config.finalize_model_grads_func = finalize_model_grads
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16).expand(2, 16)

    def forward_step(data_iterator, model):
        out = model(ids, pos, causal_mask(16), labels=ids)
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

    history = []
    for _ in range(steps):
        for m in models:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=None, model=models, num_microbatches=2,
            seq_length=16, micro_batch_size=2, forward_only=False,
        )
        ok, grad_norm, _ = optimizer.step()
        assert ok
        history.append((losses[0]["loss"].item(), float(grad_norm)))
    return history


def test_megatron_optimizers_step_on_cpu_and_agree(tp1, tmp_path):
    model_dir = make_tiny_hf_model("qwen2", tmp_path / "qwen2")
    plain = train_steps(model_dir, distributed_optimizer=False)
    sharded = train_steps(model_dir, distributed_optimizer=True)
    flat = [x for step in plain for x in step]
    assert flat == pytest.approx([x for step in sharded for x in step], abs=1e-5)
    losses = [loss for loss, _ in plain]
    assert losses[2] < losses[1] < losses[0], plain  # Adam on one fixed batch
    assert all(0.0 < norm < 100.0 for _, norm in plain), plain
