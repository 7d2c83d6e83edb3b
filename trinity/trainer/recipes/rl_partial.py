"""The RL recipe's side of partial rollouts (`actor_rollout_ref.rollout.partial`, trinity.rollout.partial):
this DP rank's prompt stream, its carried-over groups and their checkpointed state.

Per step t (the policy version of the tokens sampled in it is t):
1. a carried group whose oldest token would be trained more than `max_staleness` versions after it was
   sampled is restarted: its answers are dropped and decoded again from its prompt (the prompt keeps
   its place in the data order and its group stays whole; `rollout/restarted_groups`);
2. the rollout (`generate_partial`) runs the carried groups and new prompts from this rank's stream until
   data.train_batch_size / DP groups are complete and the due groups (those `max_staleness` versions
   old, which could not be carried again) are complete too; the oldest complete groups are scored and
   trained this step. A group is restarted by step 1 only when more groups were due than a step trains,
   so long answers are not dropped again and again;
3. every other group is carried over to step t + 1.
A rank takes its new prompts one by one from its share of each batch (`PromptData.next_indices`), in the
data order; since ranks finish at different times, each rank's position in the data is its own: it is
saved per rank with the carried groups (`state_dict`, trinity.trainer.checkpoint's rank state), so a
resumed run continues every rank exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

from trinity.rollout.partial import PartialGroup, PartialOutcome, fresh_group, groups_rollout
from trinity.rollout.types import Rollout, SamplingParams

if TYPE_CHECKING:
    from trinity.config.schema import JobConfig
    from trinity.data.prompts import Prompt, PromptData


class PartialEngine(Protocol):
    def generate_partial(self, carried: Sequence[PartialGroup], fresh: Any, params: SamplingParams,
                         generator: torch.Generator | None = None, **kw: Any) -> PartialOutcome: ...


class PartialStream:
    """This rank's prompt stream and carried-over groups (module doc)."""

    def __init__(self, cfg: JobConfig, data: PromptData, dp_rank: int, dp: int):
        partial = cfg.actor_rollout_ref.rollout.partial
        self.data, self.n = data, cfg.actor_rollout_ref.rollout.n
        self.need = cfg.data.train_batch_size // dp
        self.inflight = (partial.over_sampling_batch_size or 2 * cfg.data.train_batch_size) // dp
        self.max_staleness = partial.max_staleness
        self.longest_prompt = cfg.data.max_prompt_length
        self.seed = cfg.trainer.seed * 1_000_003 + dp_rank  # keys every step's draws: carried draws unchanged
        self.buffer: list[int] = []  # the rest of this rank's share of the last batch drawn
        self.next_uid = 0
        self.carry: list[PartialGroup] = []

    def fresh(self) -> PartialGroup:
        if not self.buffer:
            self.buffer = self.data.next_indices()
        i = self.buffer.pop(0)
        uid, self.next_uid = self.next_uid, self.next_uid + 1
        return fresh_group(uid, i, self.data.prompts[i].prompt_ids, self.n)

    def rollout(self, engine: PartialEngine, params: SamplingParams, step: int, device: torch.device,
                pad_id: int) -> tuple[list[Prompt], Rollout, torch.Tensor, dict[str, float]]:
        """Step `step`'s groups to train: their prompts (n each), rollout (behaviour log-probs), the policy
        version of every response token (-1 on padding), and this rank's counts (restarted groups, answers
        carried over to the next step)."""
        restarted = 0
        carried = []
        for g in self.carry:
            if g.oldest is not None and step - g.oldest > self.max_staleness:
                g, restarted = g.restarted(), restarted + 1
            carried.append(g)
        # the draws are keyed by (seed, sample, token index): one seed for every step; the generator only
        # feeds the torch sampler where it cannot key its draws (top-k / top-p on CUDA), a new one per step
        gen = torch.Generator(device=device).manual_seed(self.seed * 1009 + step)
        out = engine.generate_partial(carried, self.fresh, params, gen, seed=self.seed, n=self.n, need=self.need,
                                      inflight=self.inflight, version=step, max_staleness=self.max_staleness,
                                      longest_prompt=self.longest_prompt)
        if len(out.trained) != self.need:
            raise RuntimeError(f"partial rollout: {len(out.trained)} complete groups, {self.need} needed")
        self.carry = out.carry
        ro, versions = groups_rollout(out.trained, pad_id, device)
        prompts = [self.data.prompts[g.source] for g in out.trained]
        carried_answers = sum(1 for g in out.carry for a in g.answers if a.tokens and not a.ended)
        return prompts, ro, versions, {"restarted_groups": float(restarted), "carried_over": float(carried_answers)}

    # ---- this rank's checkpointed state (trinity.trainer.checkpoint: rank state) -------------------
    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data.state_dict(), "buffer": list(self.buffer), "next_uid": self.next_uid,
                "carry": [g.state() for g in self.carry]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.load_state_dict(state["data"])
        self.buffer = [int(i) for i in state["buffer"]]
        self.next_uid = int(state["next_uid"])
        self.carry = [PartialGroup.from_state(g) for g in state["carry"]]

