"""SFT: packed rows -> the actor engine's step, one optimizer step per global batch.

Loss normalisation: the loss of a step is the sum of the per-token cross-entropy over the trained
(response) tokens of the whole global batch, divided by their number. Each micro batch's loss is
scaled so that megatron's own divisions (by the number of micro batches, and DDP's average over
data-parallel ranks) cancel, which makes every TP/PP/DP layout compute the same loss and gradients. With context parallelism each
CP rank computes its own chunks' token sum (`TokenRows`): megatron's schedule multiplies a loss by CP and
DDP averages the gradients over DP x CP, so the two cancel and the ranks' shares add up to the batch's
loss; the logged loss sums every rank's share (`train_step`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Protocol

import torch

from trinity.distributed import collectives
from trinity.errors import UserError
from trinity.trainer.engine import Denominator, RoleEngine
from trinity.trainer.metrics import peak_memory_gib, sft_line
from trinity.trainer.recipes import Metrics, Recipe, StepOutput, TrainData


@dataclass(frozen=True)
class TokenRows:
    """A micro batch of token rows (SFT, PT, DPO, the loss evaluation), all [b, s]: documents packed into
    rows (or one per row, padded), each attending only to itself (`doc_ids`: the document within the row,
    -1 on padding; host, the varlen boundaries are computed there). `labels` are the next tokens,
    `loss_mask` 1 on the trained ones. The rows may wait on the host: the forward and the loss copy them
    to `device`."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    device: torch.device

    @classmethod
    def from_arrays(cls, fields: Mapping[str, torch.Tensor], device: torch.device) -> "TokenRows":
        """From the data loaders' fields (trinity.data: `tokens`, `position_ids`, `doc_ids`, `labels`, `loss_mask`)."""
        return cls(fields["tokens"], fields["position_ids"], fields["doc_ids"], fields["labels"], fields["loss_mask"],
                   device)

    def forward(self, chunk: torch.nn.Module) -> torch.Tensor:
        from trinity.models.build import packed_attention
        from trinity.models.logprobs import stage_output

        from trinity.distributed.context_parallel import local_rows

        # context parallelism: this CP rank's two chunks of every row; attention gets the whole rows' documents
        tokens, position_ids = local_rows(self.tokens.to(self.device, non_blocking=True),
                                          self.position_ids.to(self.device, non_blocking=True))
        return stage_output(chunk, tokens, position_ids, **packed_attention(chunk, self.doc_ids, self.device))


class SFTLoss:
    """Masked token-sum cross-entropy over a micro batch of `TokenRows`, divided by `denom` (the global
    batch's trained tokens) and times `scale` (`trinity.trainer.engine.LossFn`).

    Computed from the vocab-parallel logits with the padded vocabulary columns (the model's vocab is
    padded to a multiple of 128 * TP) left out of the softmax, as in the HF model: megatron's own
    loss would include them and give a different loss under each TP size."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, rows: TokenRows, logits: torch.Tensor, *, denom: Denominator,
                 scale: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from megatron.core import parallel_state as ps

        from trinity.algorithms.logprob import vocab_parallel_log_probs

        from trinity.distributed.context_parallel import local_rows

        # the last stage's logits come as [s, b, vocab / tp]: labels follow them. With context parallelism
        # the logits are this CP rank's chunks of the rows, and so are the labels (shifted on the whole
        # rows by the loaders): each rank's token sum is its own share of the batch's
        labels, loss_mask = (t.t() for t in local_rows(rows.labels.to(rows.device, non_blocking=True),
                                                       rows.loss_mask.to(rows.device, non_blocking=True)))
        logp = vocab_parallel_log_probs(
            logits, labels, group=ps.get_tensor_model_parallel_group(), vocab_size=self.vocab_size
        )
        token_sum = -(logp * loss_mask).sum()
        return token_sum * (scale / denom), {"loss_sum": token_sum.detach()}


class RowData(TrainData, Protocol):
    """SFT's and PT's data (trinity.data.loader.SFTData, trinity.data.pretrain.PTData): this rank's micro
    batches of each step as the loaders' fields, and the step's trained tokens over all ranks."""

    last_step_loss_tokens: int

    @property
    def tokens_per_step(self) -> int: ...

    def next_global_batch(self) -> list[dict[str, torch.Tensor]]: ...


class SFTRecipe(Recipe):
    data: RowData
    flat_checkpoint = True  # step_N/ is the actor's dist checkpoint: `trinity convert mcore-to-hf` reads it
    optimizer_on_host = True  # one phase: optimizer_offload = the optimizer steps in host memory

    def build_data(self) -> RowData:
        from megatron.core import parallel_state as ps

        from trinity.data.loader import build_sft_data

        cfg = self.cfg
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

    def step(self, step: int) -> StepOutput:
        device, data, actor = self.ctx.device, self.data, self.actor
        _sync(device)
        t0 = time.perf_counter()
        micro = [TokenRows.from_arrays(b, device) for b in data.next_global_batch()]
        loss, grad_norm = train_step(actor, micro, loss_tokens=data.last_step_loss_tokens, device=device,
                                     vocab_size=self.ctx.facts.vocab_size)
        _sync(device)
        dt = time.perf_counter() - t0
        row: Metrics = {
            "step": step, "loss": loss, "lr": actor.lr(), "grad_norm": grad_norm,
            "loss_tokens": data.last_step_loss_tokens, "tokens_per_s": data.tokens_per_step / dt,
            "step_time_s": dt, "mem_peak_gib": peak_memory_gib(device),
        }
        if actor.host is not None:  # optimizer_offload: the part of step_time_s spent in the host optimizer step
            row["host_optimizer_s"] = actor.host.last_step_s
        return StepOutput(row)

    def describe(self) -> str:
        lora = self.cfg.actor_rollout_ref.actor.lora
        if lora.rank == 0:
            return super().describe()
        from trinity.models.lora_targets import adapter_parameter_count, resolve_targets

        n = adapter_parameter_count(self.ctx.facts, lora.rank, lora.target_modules)
        return (f"{super().describe()}; LoRA rank {lora.rank} on {', '.join(resolve_targets(lora.target_modules))}: "
                f"{n:,} trainable parameters, the base model frozen")

    def line(self, metrics: Metrics) -> list[str]:
        return sft_line(metrics)


def train_step(actor: RoleEngine, micro_batches: list[TokenRows], *, loss_tokens: int, device: torch.device,
               vocab_size: int) -> tuple[float, float]:
    """One optimizer step over this rank's micro batches; returns (global loss, grad norm) on every rank."""
    from megatron.core import parallel_state as ps

    actor.advance_schedule()  # step k trains with the schedule's lr at k (warm-up starts above 0)
    result = actor.train_batch(micro_batches, SFTLoss(vocab_size), denom=max(loss_tokens, 1))
    # The loss exists on the last pipeline stage; count each DP replica once (TP rank 0), each CP rank's
    # share of it (its own tokens) once.
    local = torch.zeros(1, dtype=torch.float64, device=device)
    if ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0:
        local += sum(float(o["loss_sum"]) for o in result.outputs)
    local = collectives.all_reduce(local)
    return float(local.item()) / max(loss_tokens, 1), result.grad_norm


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
