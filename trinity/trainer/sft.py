"""The SFT loop: packed rows -> megatron-core pipeline schedules -> optimizer step, with metrics,
checkpoints and resume.

Loss normalisation: the loss of a step is the sum of the per-token cross-entropy over the trained
(response) tokens of the whole global batch, divided by their number. Each micro batch's loss is
scaled so that megatron's own divisions (by the number of micro batches, and DDP's average over
data-parallel ranks) cancel, which makes every TP/PP/DP layout compute the same loss and gradients.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import torch

from trinity.errors import UserError
from trinity.trainer.checkpoint import CheckpointManager
from trinity.trainer.metrics import MetricsLogger, peak_memory_gib
from trinity.trainer.profiling import StepProfiler
from trinity.trainer.registry import WorkerContext
from trinity.trainer.setup import TrainState, build_train_state


def build_data(ctx: WorkerContext) -> Any:
    from megatron.core import parallel_state as ps

    from trinity.data.loader import build_sft_data

    cfg = ctx.config
    if not cfg.data.train_files:
        raise UserError("data.train_files: SFT needs at least one training file")
    return build_sft_data(
        cfg.data.train_files,
        cfg.model.tokenizer_path or cfg.model.path,
        seq_len=cfg.data.seq_length,
        packing=cfg.data.packing,
        global_batch_size=cfg.trainer.global_batch_size,
        micro_batch_size=cfg.trainer.micro_batch_size,
        seed=cfg.trainer.seed,
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        shuffle=cfg.data.shuffle,
        prompt_key=cfg.data.prompt_key,
        response_key=cfg.data.response_key,
        messages_key=cfg.data.messages_key,
    )


def total_steps(ctx: WorkerContext, data: Any) -> int:
    t = ctx.config.trainer
    return t.total_steps if t.total_steps is not None else t.total_epochs * data.steps_per_epoch


def _loss_func(labels: torch.Tensor, loss_mask: torch.Tensor, scale: float, vocab_size: int, logits: torch.Tensor):
    """Masked token-sum cross-entropy, pre-scaled for megatron's / num_microbatches and DDP's DP average.

    Computed from the vocab-parallel logits with the padded vocabulary columns (the model's vocab is
    padded to a multiple of 128 * TP) left out of the softmax, as in the HF model: megatron's own
    loss would include them and give a different loss under each TP size.
    """
    from megatron.core import parallel_state as ps

    from trinity.algorithms.logprob import vocab_parallel_log_probs

    logp = vocab_parallel_log_probs(
        logits, labels, group=ps.get_tensor_model_parallel_group(), vocab_size=vocab_size
    )
    token_sum = -(logp * loss_mask).sum()
    return token_sum * scale, {"loss_sum": token_sum.detach()}


def _forward_step(device: torch.device, scale: float, vocab_size: int, data_iterator, model):
    from trinity.models.build import packed_attention
    from trinity.models.logprobs import stage_output

    batch = next(data_iterator)
    tokens = batch["tokens"].to(device, non_blocking=True)
    position_ids = batch["position_ids"].to(device, non_blocking=True)
    # the last stage's logits come as [s, b, vocab / tp] (hidden states elsewhere): labels follow them
    labels = batch["labels"].to(device, non_blocking=True).t()
    loss_mask = batch["loss_mask"].to(device, non_blocking=True).t()
    output = stage_output(model, tokens, position_ids, **packed_attention(model, batch["doc_ids"], device))
    return output, partial(_loss_func, labels, loss_mask, scale, vocab_size)


def train_step(
    state: TrainState,
    micro_batches: list[dict[str, Any]],
    *,
    loss_tokens: int,
    seq_len: int,
    device: torch.device,
    vocab_size: int,
) -> tuple[float, float]:
    """One optimizer step over this rank's micro batches; returns (global loss, grad norm) on every rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    num_micro = len(micro_batches)
    dp = ps.get_data_parallel_world_size()
    scale = num_micro * dp / max(loss_tokens, 1)
    for chunk in state.model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    # One iterator per VPP chunk: the interleaved schedule runs every micro batch through each chunk.
    iterators = [iter(micro_batches) for _ in state.model]
    outputs = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, device, scale, vocab_size),
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=state.model if len(state.model) > 1 else state.model[0],
        num_microbatches=num_micro,
        seq_length=seq_len,
        micro_batch_size=micro_batches[0]["tokens"].shape[0],
        forward_only=False,
    )
    state.scheduler.step(increment=1)  # step k trains with the schedule's lr at k (warm-up starts above 0)
    ok, grad_norm, _ = state.optimizer.step()
    if not ok:
        raise RuntimeError("optimizer step skipped (non-finite gradients)")
    # The loss exists on the last pipeline stage; count each DP replica once (TP rank 0).
    local = torch.zeros(1, dtype=torch.float64, device=device)
    if ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0:
        local += sum(float(o["loss_sum"]) for o in outputs)
    torch.distributed.all_reduce(local)
    return float(local.item()) / max(loss_tokens, 1), float(grad_norm if grad_norm is not None else float("nan"))


def run_sft(ctx: WorkerContext) -> None:
    cfg = ctx.config
    megatron = cfg.actor_rollout_ref.actor.megatron
    if megatron.context_parallel_size > 1:
        raise UserError("actor_rollout_ref.actor.megatron.context_parallel_size: the SFT loop does not split sequences for CP yet; set it to 1")
    data = build_data(ctx)
    steps = total_steps(ctx, data)
    ctx.log(f"data: {data.summary()}; training {steps} steps")
    state = build_train_state(ctx.actor, megatron, cfg.actor_rollout_ref.actor.optim, dtype=ctx.dtype, total_steps=steps)
    ckpt = CheckpointManager(
        ctx.output_dir / "checkpoints", keep_last=cfg.trainer.keep_last, is_rank0=ctx.is_rank0, hf_dir=cfg.model.path
    )
    start = 0
    resume_from = ckpt.resume_path(cfg.trainer.resume)
    if resume_from is not None:
        start = ckpt.load(resume_from, state, data)
        ctx.log(f"resumed from {resume_from} at step {start}")
    metrics = MetricsLogger(
        ctx.output_dir, enabled=ctx.is_rank0, total_steps=steps, start_step=start,
        log_interval=cfg.trainer.log_interval, tensorboard=cfg.trainer.tensorboard,
    )
    save_every = cfg.trainer.save_interval
    profiler = StepProfiler.from_config(cfg, ctx.output_dir, ctx.rank, ctx.device)
    try:
        for step in range(start + 1, steps + 1):
            _sync(ctx.device)
            t0 = time.perf_counter()
            with profiler.step(step):
                micro = data.next_global_batch()
                loss, grad_norm = train_step(
                    state, micro, loss_tokens=data.last_step_loss_tokens, seq_len=data.seq_len, device=ctx.device,
                    vocab_size=ctx.facts.vocab_size,
                )
                _sync(ctx.device)
                dt = time.perf_counter() - t0
            lr = state.lr()  # set by the schedule for this step before the optimizer ran
            profiler.log(metrics, {
                "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                "loss_tokens": data.last_step_loss_tokens, "tokens_per_s": data.tokens_per_step / dt,
                "step_time_s": dt, "mem_peak_gib": peak_memory_gib(ctx.device),
            })
            if (save_every and step % save_every == 0) or step == steps:
                path = ckpt.save(step, state, data)
                metrics.print(f"saved checkpoint {path}")
        if metrics.first is not None:
            metrics.print(f"first loss {metrics.first['loss']:.4f} (step {metrics.first['step']}), "
                          f"last loss {metrics.last['loss']:.4f} (step {metrics.last['step']})")
    finally:
        metrics.close()
    if cfg.trainer.export_hf:
        from trinity.trainer.export import export_hf

        out = export_hf(ctx, [chunk.module for chunk in state.model])
        ctx.log(f"exported HF model to {out}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
