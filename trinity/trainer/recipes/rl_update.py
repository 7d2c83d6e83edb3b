"""Actor and critic updates of one RL step: mini-batches x epochs, micro batches through megatron's
schedules, losses normalised over the whole mini-batch (`trinity.algorithms.losses` recipe).

Per optimizer update (one mini-batch): D = global_agg_denominator(masks of this rank's micro batches,
all-reduced over DP); micro loss = agg(loss, mask, denominator=D) x num_micro x DP, which cancels the
schedule's division by the number of micro batches and DDP's average over DP ranks, so that the
gradient is the one of the whole mini-batch's loss on every layout. The denominators count tokens or
sequences, so they do not depend on how the sequences are cut into micro batches: padded rows of
`trainer.micro_batch_size`, or packed rows of a token budget (`Batching`, dynamic micro batches).

On-policy steps (one epoch, one mini-batch: the weights that generated the rollout are the ones the
update starts from) can leave `Experience.old_logp` unset: the update's own forward gives them, detached
(ratio 1 exactly), and `actor_update` returns them (`ActorUpdate.old_logp`) for the step's metrics.

Each micro batch of an update is an `ExperienceMicro`: its sequences' rollout micro batch (padded rows or
one packed row, `rollout_forward.RolloutMicro`) with their part of the experience, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from trinity.algorithms.losses import (
    LossAggMode,
    PolicyLossFn,
    actor_loss,
    global_agg_denominator,
    truncated_is_weights,
    value_loss,
)
from trinity.distributed import collectives
from trinity.rollout.types import Rollout
from trinity.trainer.engine import Denominator, LossFn, RoleEngine
from trinity.trainer.recipes.rollout_forward import Batching, RolloutMicro

if TYPE_CHECKING:
    import torch.distributed

    from trinity.config.schema import ActorConfig, CriticConfig


@dataclass(frozen=True)
class ExperiencePart:
    """The experience of some sequences (all [b, R] except rollout), in the order a micro batch holds them;
    `rows`: their rows in the step's `Experience`."""

    rollout: Rollout
    old_logp: torch.Tensor | None
    advantages: torch.Tensor
    returns: torch.Tensor
    ref_logp: torch.Tensor | None
    values: torch.Tensor | None
    rows: torch.Tensor


@dataclass(frozen=True)
class Experience:
    """Everything the updates need for this rank's sequences (all [B, R] except rollout), each the result
    of its phase: the rollout's, the ref's (ref_logp), the old log-probs' (None: from the actor update's own
    forward, on-policy, see module doc), the critic's (values) and the advantage estimator's."""

    rollout: Rollout
    old_logp: torch.Tensor | None
    advantages: torch.Tensor
    returns: torch.Tensor
    ref_logp: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.rollout.tokens.shape[0]

    def part(self, idx: torch.Tensor) -> ExperiencePart:
        """The sequences `idx` (int64 row indices, in the order the micro batch holds them)."""
        on = self.advantages.device

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[idx.to(t.device)]

        return ExperiencePart(
            self.rollout.select(idx.to(self.rollout.tokens.device)), pick(self.old_logp), self.advantages[idx.to(on)],
            self.returns[idx.to(self.returns.device)], pick(self.ref_logp), pick(self.values), idx.to(on),
        )


@dataclass(frozen=True)
class ExperienceMicro:
    """A micro batch of an update: the sequences' rollout micro batch (what the engine runs) and their
    experience (what the loss reads)."""

    batch: RolloutMicro
    exp: ExperiencePart

    @property
    def tokens(self) -> torch.Tensor:
        return self.batch.tokens

    def forward(self, chunk: torch.nn.Module) -> torch.Tensor:
        return self.batch.forward(chunk)


@dataclass(frozen=True)
class ActorUpdate:
    """The actor's updates of one step: their metrics (last pipeline stage), and the old log-probs [B, R]
    the losses used (every stage): the given ones, or on-policy those of the update's own forward."""

    metrics: dict[str, float]
    old_logp: torch.Tensor


def _dp() -> tuple[int, torch.distributed.ProcessGroup]:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size(), ps.get_data_parallel_group()


@dataclass
class ActorLoss:
    """The actor's `LossFn`. On-policy (no old log-probs given) it takes them from this forward, detached,
    and keeps (rows, log-probs) of each micro batch in `on_policy` (last stage) for `actor_update` to return."""

    actor_cfg: ActorConfig
    vocab_size: int
    policy_loss: PolicyLossFn | None = None
    rollout_is_threshold: float | None = None  # partial rollouts: TIS against the rollout's log-probs
    on_policy: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def __call__(self, micro: ExperienceMicro, output: torch.Tensor, *, denom: Denominator,
                 scale: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        exp = micro.exp
        logp, entropy = micro.batch.logprobs(output, self.vocab_size, with_entropy=True)
        old_logp = exp.old_logp
        if old_logp is None:  # on-policy: this forward runs the weights that generated the rollout
            old_logp = logp.detach()
            self.on_policy.append((exp.rows, old_logp))
        weights = None
        if self.rollout_is_threshold is not None:
            weights, _ = truncated_is_weights(old_logp, exp.rollout.logprobs, exp.rollout.response_mask,
                                              self.rollout_is_threshold)
        loss, metrics = actor_loss(
            logp, old_logp, exp.advantages, exp.rollout.response_mask, self.actor_cfg,
            entropy=entropy, ref_logp=exp.ref_logp, denominator=denom, policy_loss=self.policy_loss,
            is_weights=weights,
        )
        return loss * scale, {k: v.float() for k, v in metrics.items()} | {"actor/loss": loss.detach()}


@dataclass(frozen=True)
class CriticLoss:
    """The critic's `LossFn`: the clipped value loss against the experience's returns."""

    critic_cfg: CriticConfig
    mode: LossAggMode | str

    def __call__(self, micro: ExperienceMicro, output: torch.Tensor, *, denom: Denominator,
                 scale: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        exp = micro.exp
        assert exp.values is not None, "the critic update needs the values phase's values"
        loss, m = value_loss(micro.batch.values(output), exp.values, exp.returns, exp.rollout.response_mask,
                             self.critic_cfg.cliprange_value, self.mode, denom)
        return loss * scale, {"critic/vf_loss": loss.detach(), "critic/vf_clipfrac": m.vf_clipfrac,
                              "critic/vpred_mean": m.vpred_mean}


def _one_update(engine: RoleEngine, micros: list[ExperienceMicro], loss: LossFn[ExperienceMicro],
                mode: LossAggMode | str) -> tuple[list[dict[str, torch.Tensor]], float]:
    dp, group = _dp()
    denom = global_agg_denominator([m.exp.rollout.response_mask for m in micros], mode, group if dp > 1 else None)
    result = engine.train_batch(micros, loss, denom=denom)
    return result.outputs, result.grad_norm


def _micro_batches(exp: Experience, start: int, end: int, batching: Batching) -> list[ExperienceMicro]:
    """The micro batches of sequences start ... end - 1: padded rows, or packed rows whose sequences are
    picked in the row's order."""
    return [ExperienceMicro(m, exp.part(m.index + start)) for m in batching.split(exp.rollout.select(slice(start, end)))]


def _reduce(records: list[dict[str, torch.Tensor]], grad_norms: list[float], prefix: str) -> dict[str, float]:
    """Mean over micro batches and DP ranks; losses are summed per update first (each micro loss is a
    share of its mini-batch's loss), then averaged over updates."""
    dp, group = _dp()
    keys = sorted({k for r in records for k in r})
    sums, counts = collectives.all_reduce(torch.tensor(
        [[sum(float(r[k]) for r in records if k in r) for k in keys], [sum(1 for r in records if k in r) for k in keys]],
        dtype=torch.float64), group=group)
    updates = max(len(grad_norms), 1)
    out = {}
    for k, s, c in zip(keys, sums.tolist(), counts.tolist()):
        is_loss = k.endswith("loss")
        out[k] = s / updates / (dp if is_loss else 1) if is_loss else s / max(c, 1)
    out[f"{prefix}/grad_norm"] = sum(grad_norms) / updates
    return out


def _as_batching(micro: int | Batching) -> Batching:
    return micro if isinstance(micro, Batching) else Batching(micro)


def update(
    engine: RoleEngine, exp: Experience, *, seqs_per_update: int, epochs: int, micro: int | Batching,
    loss: LossFn[ExperienceMicro], mode: LossAggMode | str, prefix: str,
) -> dict[str, float]:
    """`epochs` passes over this rank's sequences in mini-batches of `seqs_per_update`; `micro`: rows per
    padded micro batch, or a `Batching`."""
    batching = _as_batching(micro)
    records: list[dict[str, torch.Tensor]] = []
    norms: list[float] = []
    for _ in range(epochs):
        for start in range(0, exp.size, seqs_per_update):
            micros = _micro_batches(exp, start, min(start + seqs_per_update, exp.size), batching)
            outputs, norm = _one_update(engine, micros, loss, mode)
            records.extend(outputs)
            norms.append(norm)
    return _reduce(records, norms, prefix)


def actor_update(engine: RoleEngine, exp: Experience, actor_cfg: ActorConfig, vocab_size: int, *, seqs_per_update: int,
                 micro: int | Batching, policy_loss: PolicyLossFn | None = None,
                 rollout_is_threshold: float | None = None) -> ActorUpdate:
    """The actor's updates of one step. With `exp.old_logp` None (on-policy: one epoch, one mini-batch),
    the update's forward gives the old log-probs, returned on every stage. `policy_loss`: the algorithm's
    own (AlgorithmSpec.policy_loss), else actor.policy_loss.loss_mode's. `rollout_is_threshold` (partial
    rollouts): each token's policy loss times min(exp(old_logp - rollout log-prob), threshold)."""
    if exp.old_logp is None and (actor_cfg.ppo_epochs != 1 or seqs_per_update < exp.size):
        raise ValueError("old log-probs from the update's forward need one epoch over one mini-batch")
    loss = ActorLoss(actor_cfg, vocab_size, policy_loss, rollout_is_threshold)
    metrics = update(engine, exp, seqs_per_update=seqs_per_update, epochs=actor_cfg.ppo_epochs, micro=micro,
                     loss=loss, mode=actor_cfg.loss_agg_mode, prefix="actor")
    old_logp = exp.old_logp if exp.old_logp is not None else _assemble(loss.on_policy, exp)
    return ActorUpdate(metrics, old_logp)


def _assemble(pieces: list[tuple[torch.Tensor, torch.Tensor]], exp: Experience) -> torch.Tensor:
    """[B, R] from the last stage's per-micro-batch (rows, log-probs), broadcast to every stage."""
    from megatron.core import parallel_state as ps

    mask = exp.rollout.response_mask
    out = torch.zeros(tuple(mask.shape), dtype=torch.float32, device=mask.device)
    for rows, logp in pieces:
        out[rows.to(out.device)] = logp.float().to(out.device)
    out = collectives.broadcast(out, src=ps.get_pipeline_model_parallel_last_rank(),
                                group=ps.get_pipeline_model_parallel_group())
    return out * mask


def critic_update(engine: RoleEngine, exp: Experience, critic_cfg: CriticConfig, mode: LossAggMode | str, *,
                  seqs_per_update: int, micro: int | Batching) -> dict[str, float]:
    return update(engine, exp, seqs_per_update=seqs_per_update, epochs=critic_cfg.ppo_epochs, micro=micro,
                  loss=CriticLoss(critic_cfg, mode), mode=mode, prefix="critic")
