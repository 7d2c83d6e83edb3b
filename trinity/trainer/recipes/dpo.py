"""DPO: preference pairs -> the ref's sequence log-probs (forward only, once per step) -> the actor's
step with the DPO loss (trinity.algorithms.dpo). The ref is the frozen initial policy.

Loss normalisation: the loss of a step is the mean of the per-pair losses over the global batch (TRL's
`loss.mean()` over its batch). As in SFT, each micro batch's loss sum is scaled by
(micro batches x DP / global pairs), which cancels megatron's division by the number of micro batches
and DDP's average over DP: every TP/PP/DP layout and micro batch size computes the same loss and gradients.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trinity.config.roles import Role
from trinity.distributed import collectives
from trinity.errors import UserError
from trinity.trainer.engine import Denominator
from trinity.trainer.metrics import peak_memory_gib
from trinity.trainer.recipes import Metrics, Recipe, StepOutput
from trinity.trainer.recipes.lora_ref import AdaptersOff, uses_lora
from trinity.trainer.recipes.rollout_forward import Inference
from trinity.trainer.recipes.sft import TokenRows, _sync

if TYPE_CHECKING:
    from trinity.config.schema.algorithm import DPOConfig
    from trinity.data.preference import PreferenceData

# Per-pair sums each micro batch reports (last stage), averaged over the global batch's pairs: the
# metrics.jsonl keys are TRL's.
METRICS = {
    "loss": "loss", "chosen_reward": "rewards/chosen", "rejected_reward": "rewards/rejected", "margin": "rewards/margins",
    "accuracy": "rewards/accuracies", "chosen_logps": "logps/chosen", "rejected_logps": "logps/rejected",
}


def sequence_logps(logits: torch.Tensor, rows: TokenRows, vocab_size: int) -> torch.Tensor:
    """Summed log-probs of each row's trained (answer) tokens, [rows] fp32, from the last stage's
    vocab-parallel logits [s, b, vocab / tp]."""
    from megatron.core import parallel_state as ps

    from trinity.algorithms.logprob import vocab_parallel_log_probs

    from trinity.distributed.context_parallel import cp_group, local_rows, sum_over_ranks

    # context parallelism: the logits are this CP rank's chunks of the rows; a row's sum adds every
    # rank's part (DPO's loss is nonlinear in it), each rank keeping its own part's gradient
    labels, loss_mask = (t.t() for t in local_rows(rows.labels.to(rows.device, non_blocking=True),
                                                   rows.loss_mask.to(rows.device, non_blocking=True)))
    logp = vocab_parallel_log_probs(logits, labels, group=ps.get_tensor_model_parallel_group(), vocab_size=vocab_size)
    return sum_over_ranks((logp.float() * loss_mask).sum(0), cp_group())


@dataclass(frozen=True)
class ScoredPairs(TokenRows):
    """A micro batch of pairs (chosen rows, then rejected rows) with the reference policy's sequence
    log-probs of its rows, `ref_logps` [2 x pairs]."""

    ref_logps: torch.Tensor


class DPOLoss:
    """The DPO loss of a micro batch of pairs, summed over its pairs, divided by `denom` (the global
    batch's pairs) and times `scale` (`trinity.trainer.engine.LossFn`)."""

    def __init__(self, vocab_size: int, dpo: DPOConfig):
        self.vocab_size, self.dpo = vocab_size, dpo

    def __call__(self, batch: ScoredPairs, logits: torch.Tensor, *, denom: Denominator,
                 scale: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from trinity.algorithms.dpo import dpo_loss

        logps = sequence_logps(logits, batch, self.vocab_size)
        ref = batch.ref_logps.to(batch.device)
        m = logps.shape[0] // 2
        losses, pair = dpo_loss(
            logps[:m], logps[m:], ref[:m], ref[m:], beta=self.dpo.beta, loss_type=self.dpo.loss_type.value,
            label_smoothing=self.dpo.label_smoothing,
        )
        sums = {
            "loss": losses.detach().sum(), "chosen_reward": pair.chosen_reward.sum(),
            "rejected_reward": pair.rejected_reward.sum(), "margin": pair.margin.sum(), "accuracy": pair.accuracy.sum(),
            "chosen_logps": logps[:m].detach().sum(), "rejected_logps": logps[m:].detach().sum(),
        }
        return losses.sum() * (scale / denom), sums


class DPORecipe(Recipe):
    flat_checkpoint = True  # one trained role (the ref is frozen, never saved): step_N/ is the actor's checkpoint
    optimizer_on_host = True  # one trained role, one update a step: optimizer_offload steps it in host memory, as SFT

    data: PreferenceData

    def build_data(self) -> PreferenceData:
        from megatron.core import parallel_state as ps

        from trinity.data.preference import PreferenceKeys, build_preference_data

        cfg = self.cfg
        if not cfg.data.train_files:
            raise UserError("data.train_files: DPO needs at least one file of preference pairs")
        return build_preference_data(
            cfg.data.train_files, cfg.model.tokenizer_path or cfg.model.path, seq_len=cfg.data.seq_length,
            global_batch_size=cfg.trainer.global_batch_size, micro_batch_size=cfg.trainer.micro_batch_size,
            seed=cfg.trainer.seed, dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
            shuffle=cfg.data.shuffle,
            keys=PreferenceKeys(cfg.data.prompt_key, cfg.data.chosen_key, cfg.data.rejected_key),
        )

    def describe(self) -> str:
        d = self.cfg.algorithm.dpo
        ref = "the actor with its LoRA adapters off" if uses_lora(self.cfg) else "the frozen initial policy"
        return (f"{super().describe()}; dpo loss {d.loss_type.value}, beta {d.beta}, label_smoothing "
                f"{d.label_smoothing}; reference: {ref}")

    @property
    def ref(self) -> Inference:
        return AdaptersOff(self.actor) if uses_lora(self.cfg) else self.engines[Role.ref.value]

    def ref_logps(self, micro: list[TokenRows]) -> list[ScoredPairs]:
        """The micro batches with the ref's sequence log-probs of their rows: one forward of the frozen ref
        per step, before the actor's step needs the memory."""
        vocab = self.ctx.facts.vocab_size
        ref = self.ref
        ref.need(params=True)
        out = ref.infer_batch(micro, lambda logits, rows: sequence_logps(logits, rows, vocab),
                              (sum(b.tokens.shape[0] for b in micro),))
        ref.need(params=False)
        scored, start = [], 0
        for rows in micro:
            n = rows.tokens.shape[0]
            scored.append(ScoredPairs(rows.tokens, rows.position_ids, rows.doc_ids, rows.labels, rows.loss_mask,
                                      rows.device, out[start : start + n]))
            start += n
        return scored

    def step(self, step: int) -> StepOutput:
        from megatron.core import parallel_state as ps

        device, actor = self.ctx.device, self.actor
        pairs = self.cfg.trainer.global_batch_size
        _sync(device)
        t0 = time.perf_counter()
        # on the device up front: at PP>1 the ref's result is broadcast on the tokens' device
        micro = self.ref_logps([TokenRows.from_arrays({k: v.to(device) for k, v in b.items()}, device)
                                for b in self.data.next_global_batch()])
        actor.advance_schedule()
        result = actor.train_batch(micro, DPOLoss(self.ctx.facts.vocab_size, self.cfg.algorithm.dpo), denom=pairs)
        # The sums exist on the last pipeline stage; count each DP replica once (TP rank 0; CP rank 0: every
        # CP rank computes the whole pairs' loss).
        local = torch.zeros(len(METRICS), dtype=torch.float64, device=device)
        if (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_context_parallel_rank() == 0):
            for o in result.outputs:
                local += torch.stack([o[k].double() for k in METRICS]).to(device)
        local = collectives.all_reduce(local)
        _sync(device)
        dt = time.perf_counter() - t0
        row: Metrics = {"step": step}
        row.update({name: float(v) / pairs for name, v in zip(METRICS.values(), local.tolist())})
        row.update({
            "lr": actor.lr(), "grad_norm": result.grad_norm, "tokens_per_s": self.data.tokens_per_step / dt,
            "step_time_s": dt, "mem_peak_gib": peak_memory_gib(device),
        })
        return StepOutput(row)

    def line(self, metrics: Metrics) -> list[str]:
        return [
            f"loss {metrics['loss']:.4f}", f"acc {metrics['rewards/accuracies']:.2f}",
            f"margin {metrics['rewards/margins']:.4f}", f"lr {metrics['lr']:.2e}", f"grad_norm {metrics['grad_norm']:.3f}",
            f"{metrics['step_time_s']:.3f} s/step", f"mem {metrics['mem_peak_gib']:.2f} GiB",
        ]
