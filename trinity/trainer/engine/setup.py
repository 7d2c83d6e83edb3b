"""Training set-up shared by the SFT and RL loops: DDP wrapping, optimizer, LR schedule.

Everything here is megatron-core's own machinery (DDP with contiguous grad buffers, the
(distributed) mixed-precision optimizer, OptimizerParamScheduler) configured from a role's
`megatron:` and `optim:` blocks, so the loops only see `TrainState`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trinity.config.megatron import MegatronConfig
from trinity.config.schema import OptimConfig

# dtype names of model.dtype; `auto` is resolved by `training_dtype`.
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def training_dtype(model_dtype: str, device: str) -> torch.dtype:
    """bf16 on cuda, fp32 on cpu, unless model.dtype names one."""
    if model_dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return DTYPES[model_dtype]


@dataclass
class TrainState:
    """A trained role: DDP-wrapped chunks, their optimizer and LR schedule."""

    model: list[Any]  # megatron DistributedDataParallel, one per VPP chunk
    optimizer: Any  # megatron MegatronOptimizer
    scheduler: Any  # megatron OptimizerParamScheduler
    host: Any = None  # HostOptimizer when the optimizer lives and steps in host memory (SFT optimizer_offload)

    @property
    def config(self) -> Any:
        """The chunks' TransformerConfig (the schedules read their hooks from it)."""
        from megatron.core.utils import get_model_config

        return get_model_config(self.model[0])

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])


def wrap_ddp(chunks: list[Any], megatron: MegatronConfig) -> list[Any]:
    """Wrap model chunks in megatron-core DDP (fp32 grad buffers; bucketing only on the first chunk,
    as megatron's training loop does, so VPP chunks after the first reduce in one bucket each). Eager
    CUDA layers then accumulate weight gradients straight into the fp32 buffers
    (`trinity.trainer.engine.grad_fusion`; compiled layers keep DDP's hook)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.utils import get_model_config

    from trinity.models.build import compile_scope
    from trinity.trainer.engine import grad_fusion

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=megatron.overlap_grad_reduce,
        use_distributed_optimizer=megatron.use_distributed_optimizer,
    )
    wrapped = [
        DistributedDataParallel(
            config=get_model_config(chunk), ddp_config=ddp_config, module=chunk, disable_bucketing=(i > 0)
        )
        for i, chunk in enumerate(chunks)
    ]
    if compile_scope(megatron) == "none":
        grad_fusion.enable(wrapped)
    return wrapped


def build_optimizer(model: list[Any], optim: OptimConfig, megatron: MegatronConfig, dtype: torch.dtype) -> Any:
    """megatron-core Adam(W) over the DDP chunks: fp32 master weights when params are bf16/fp16; on
    torch's fused kernels where TE / apex are absent (`trinity.compat.fused_optimizer`)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from trinity.compat import cpu_compat
    from trinity.compat import fused_optimizer, lazy_dynamo

    if cpu_compat.is_enabled():  # CPU mode: torch.optim's first call is all that would import torch._dynamo
        lazy_dynamo.skip_dynamo_import()
    config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=megatron.use_distributed_optimizer,
    )
    fused_optimizer.install()
    optimizer = get_megatron_optimizer(config, model)
    fused_optimizer.use_fused_adamw(optimizer)
    return optimizer


def build_scheduler(optimizer: Any, optim: OptimConfig, total_steps: int) -> Any:
    """Linear warm-up from 0 to lr, then cosine to min_lr at total_steps (or constant lr)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup = optim.warmup_within(total_steps)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=optim.lr,
        min_lr=min(optim.min_lr, optim.lr),
        lr_warmup_steps=warmup,
        lr_decay_steps=max(total_steps, warmup + 1),
        lr_decay_style=optim.lr_scheduler,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
        # On resume the checkpoint's schedule wins only where the config did not change it.
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def install_schedule_hooks(state: TrainState, megatron: MegatronConfig) -> None:
    """Hooks the pipeline schedules call: loss scaling, grad finalisation, overlapped reduction."""
    from megatron.core.distributed import finalize_model_grads

    config = state.config
    config.grad_scale_func = state.optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if megatron.overlap_grad_reduce:
        no_sync = [chunk.no_sync for chunk in state.model]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync


def build_train_state(
    chunks: list[Any], megatron: MegatronConfig, optim: OptimConfig, *, dtype: torch.dtype, total_steps: int,
    host_optimizer: bool = False,
) -> TrainState:
    model = wrap_ddp(chunks, megatron)
    host = None
    if host_optimizer:  # trinity.trainer.engine.host_optimizer: masters and Adam states never stay on the GPU
        from trinity.trainer.engine.host_optimizer import HostOptimizer, grad_buffers_released

        with grad_buffers_released(model):
            optimizer = build_optimizer(model, optim, megatron, dtype)
            host = HostOptimizer(optimizer)
    else:
        optimizer = build_optimizer(model, optim, megatron, dtype)
    state = TrainState(model=model, optimizer=optimizer, scheduler=build_scheduler(optimizer, optim, total_steps), host=host)
    install_schedule_hooks(state, megatron)
    return state
