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
(ratio 1 exactly), and `actor_update` fills `exp.old_logp` from it for the step's metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch

from trinity.algorithms.losses import PolicyLossFn, actor_loss, global_agg_denominator, value_loss
from trinity.distributed import collectives
from trinity.rollout.types import Rollout
from trinity.trainer.recipes.rollout_forward import (
    Batching, forward_output, packed_forward, packed_response_logprobs, packed_response_values, response_logprobs,
    response_values,
)


@dataclass
class Experience:
    """Everything the updates need for this rank's sequences (all [B, R] except rollout)."""

    rollout: Rollout
    old_logp: torch.Tensor | None  # None: from the update's own forward (on-policy, see module doc)
    advantages: torch.Tensor
    returns: torch.Tensor
    ref_logp: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.rollout.tokens.shape[0]

    def part(self, idx: torch.Tensor) -> dict[str, Any]:
        """The sequences `idx` (int64 row indices, in the order the micro batch holds them)."""
        on = self.advantages.device
        pick = lambda t: None if t is None else t[idx.to(t.device)]  # noqa: E731
        return {
            "rollout": self.rollout.select(idx.to(self.rollout.tokens.device)), "old_logp": pick(self.old_logp),
            "advantages": pick(self.advantages), "returns": pick(self.returns), "ref_logp": pick(self.ref_logp),
            "values": pick(self.values), "rows": idx.to(on),
        }


def _dp() -> tuple[int, Any]:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size(), ps.get_data_parallel_group()


def _actor_loss_func(micro: dict, actor_cfg: Any, vocab_size: int, denom: torch.Tensor, scale: float,
                     collect: list, policy_loss: PolicyLossFn | None, output: torch.Tensor):
    ro: Rollout = micro["rollout"]
    if "pack" in micro:
        logp, entropy = packed_response_logprobs(output, micro["pack"], vocab_size, with_entropy=True)
    else:
        logp, entropy = response_logprobs(output, ro, vocab_size, with_entropy=True)
    old_logp = micro["old_logp"]
    if old_logp is None:  # on-policy: this forward runs the weights that generated the rollout
        old_logp = logp.detach()
        collect.append((micro["rows"], old_logp))
    loss, metrics = actor_loss(
        logp, old_logp, micro["advantages"], ro.response_mask, actor_cfg,
        entropy=entropy, ref_logp=micro["ref_logp"], denominator=denom, policy_loss=policy_loss,
    )
    return loss * scale, {k: v.float() for k, v in metrics.items()} | {"actor/loss": loss.detach()}


def _critic_loss_func(micro: dict, critic_cfg: Any, mode: Any, denom: torch.Tensor, scale: float, output: torch.Tensor):
    ro: Rollout = micro["rollout"]
    values = packed_response_values(output, micro["pack"]) if "pack" in micro else response_values(output, ro)
    loss, m = value_loss(values, micro["values"], micro["returns"], ro.response_mask, critic_cfg.cliprange_value, mode, denom)
    return loss * scale, {"critic/vf_loss": loss.detach(), "critic/vf_clipfrac": m.vf_clipfrac, "critic/vpred_mean": m.vpred_mean}


class RolloutLoss:
    """A `LossFn` over rollout micro batches: the whole-sequence forward, then `fn(micro, output=...)`."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def forward(self, chunk: Any, micro: dict[str, Any]) -> torch.Tensor:
        if "pack" in micro:
            return packed_forward(chunk, micro["pack"])
        ro: Rollout = micro["rollout"]
        return forward_output(chunk, ro.tokens, ro.attention_pad_mask())

    def __call__(self, micro: dict[str, Any], output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        return self.fn(micro, output=output)


def _one_update(engine: Any, micros: list[dict], make_loss: Callable[[torch.Tensor, float], Callable], mode: Any) -> tuple[list[dict], float]:
    dp, group = _dp()
    denom = global_agg_denominator([m["rollout"].response_mask for m in micros], mode, group if dp > 1 else None)
    result = engine.train_batch(micros, RolloutLoss(make_loss(denom, float(len(micros) * dp))))
    return result.outputs, result.grad_norm


def _micro_batches(exp: Experience, start: int, end: int, batching: Batching) -> list[dict]:
    """The micro batches of sequences start ... end - 1: padded rows, or packed rows (`pack`, with the
    row's `tokens` [1, S] for the schedule's shapes) whose sequences are picked in the row's order."""
    parts = batching.split(exp.rollout.select(slice(start, end)))
    if batching.budget is None:
        return [exp.part(torch.arange(start + i * batching.micro, start + i * batching.micro + p.tokens.shape[0]))
                for i, p in enumerate(parts)]
    return [exp.part(m.index + start) | {"pack": m, "tokens": m.tokens} for m in parts]


def _reduce(records: list[dict], grad_norms: list[float], prefix: str) -> dict[str, float]:
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
    engine: Any, exp: Experience, *, seqs_per_update: int, epochs: int, micro: int | Batching,
    make_loss: Callable[[torch.Tensor, float], Callable], mode: Any, prefix: str,
) -> dict[str, float]:
    """`epochs` passes over this rank's sequences in mini-batches of `seqs_per_update`; `micro`: rows per
    padded micro batch, or a `Batching`."""
    batching = _as_batching(micro)
    records: list[dict] = []
    norms: list[float] = []
    for _ in range(epochs):
        for start in range(0, exp.size, seqs_per_update):
            micros = _micro_batches(exp, start, min(start + seqs_per_update, exp.size), batching)
            outputs, norm = _one_update(engine, micros, make_loss, mode)
            records.extend(outputs)
            norms.append(norm)
    return _reduce(records, norms, prefix)


def actor_update(engine: Any, exp: Experience, actor_cfg: Any, vocab_size: int, *, seqs_per_update: int,
                 micro: int | Batching, policy_loss: PolicyLossFn | None = None) -> dict[str, float]:
    """The actor's updates of one step. With `exp.old_logp` None (on-policy: one epoch, one mini-batch),
    the update's forward gives the old log-probs and `exp.old_logp` holds them afterwards, on every stage.
    `policy_loss`: the algorithm's own (AlgorithmSpec.policy_loss), else actor.policy_loss.loss_mode's."""
    collect: list[tuple[torch.Tensor, torch.Tensor]] = []
    on_policy = exp.old_logp is None
    if on_policy and (actor_cfg.ppo_epochs != 1 or seqs_per_update < exp.size):
        raise ValueError("old log-probs from the update's forward need one epoch over one mini-batch")

    def make(denom: torch.Tensor, scale: float) -> Callable:
        return partial(_actor_loss_func, actor_cfg=actor_cfg, vocab_size=vocab_size, denom=denom, scale=scale,
                       collect=collect, policy_loss=policy_loss)

    metrics = update(engine, exp, seqs_per_update=seqs_per_update, epochs=actor_cfg.ppo_epochs, micro=micro,
                     make_loss=_kw_last(make), mode=actor_cfg.loss_agg_mode, prefix="actor")
    if on_policy:
        exp.old_logp = _assemble(collect, exp)
    return metrics


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


def critic_update(engine: Any, exp: Experience, critic_cfg: Any, mode: Any, *, seqs_per_update: int,
                  micro: int | Batching) -> dict[str, float]:
    def make(denom: torch.Tensor, scale: float) -> Callable:
        return partial(_critic_loss_func, critic_cfg=critic_cfg, mode=mode, denom=denom, scale=scale)

    return update(engine, exp, seqs_per_update=seqs_per_update, epochs=critic_cfg.ppo_epochs, micro=micro,
                  make_loss=_kw_last(make), mode=mode, prefix="critic")


def _kw_last(make: Callable[[torch.Tensor, float], Callable]) -> Callable[[torch.Tensor, float], Callable]:
    """Loss functions take (micro, <keywords>, output): bind micro positionally, output last."""

    def bound(denom: torch.Tensor, scale: float) -> Callable:
        fn = make(denom, scale)
        return lambda micro, output: fn(micro, output=output)

    return bound
