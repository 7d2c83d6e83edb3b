"""DAPO (Yu et al. 2025, verl's DAPO recipe): GRPO's group-relative advantages, plus

- dynamic sampling (`algorithm.filter_groups`): groups whose metric is equal for all rollout.n responses
  are dropped and more batches of prompts are drawn until this step has data.train_batch_size groups;
- overlong reward shaping (`reward_model.overlong_buffer`): a linear penalty on responses that run into
  the last `len` tokens of rollout.response_length;
- clip-higher (`actor.clip_ratio_high`) and token-level aggregation (`actor.loss_agg_mode: token-mean`,
  the default) come from the shared actor loss.

Every DP rank draws its share of each batch; ranks draw together (one all-reduce of the largest
shortfall per draw) so that the data samplers stay in step and each rank ends with its share of groups.
"""

from __future__ import annotations


import torch

from trinity.distributed import collectives
from trinity.rollout.types import Rollout
from trinity.trainer.recipes.rl import RLRecipe, Sampled, Scored, _dp_info


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """One rollout of the rows of `parts`: prompts left-padded and responses right-padded to the widest
    (padding shifts a row's positions only, which rotary attention does not see; see trinity.rollout.layout)."""
    import torch.nn.functional as F

    if len(parts) == 1:
        return parts[0]
    p_len = max(r.prompt_len for r in parts)
    r_len = max(r.response_len for r in parts)
    tokens, prompt_mask, response_mask, logprobs = [], [], [], []
    for r in parts:
        dp, dr = p_len - r.prompt_len, r_len - r.response_len
        tokens.append(torch.cat([F.pad(r.tokens[:, : r.prompt_len], (dp, 0), value=pad_id),
                                 F.pad(r.responses, (0, dr), value=pad_id)], dim=1))
        prompt_mask.append(F.pad(r.prompt_mask, (dp, 0)))
        response_mask.append(F.pad(r.response_mask, (0, dr)))
        logprobs.append(F.pad(r.logprobs, (0, dr)))
    return Rollout(torch.cat(tokens), torch.cat(prompt_mask), torch.cat(response_mask), torch.cat(logprobs))


class DAPORecipe(RLRecipe):
    def draw(self, gen: torch.Generator) -> tuple[Rollout, Scored, torch.Tensor]:
        """One batch of prompts: (rollout, the reward function's scores, scores + overlong penalty)."""
        from trinity.algorithms.dapo import overlong_penalty

        prompts = self.data.next_batch()
        ro = self.generate(prompts, gen)
        scored = self.score(prompts, ro)
        ob = self.cfg.reward_model.overlong_buffer
        if not ob.enable:
            return ro, scored, scored.scores
        penalty = overlong_penalty(ro.response_mask.sum(-1), self.cfg.actor_rollout_ref.rollout.response_length,
                                   ob.len, ob.penalty_factor)
        return ro, scored, scored.scores + penalty

    def sample(self, step: int, gen: torch.Generator) -> Sampled:
        from trinity.algorithms.dapo import varied_groups

        cfg = self.cfg
        n = cfg.actor_rollout_ref.rollout.n
        fg = cfg.algorithm.filter_groups
        _, dp, dp_group = _dp_info()
        want = cfg.data.train_batch_size // dp  # groups per rank
        kept: list[tuple[Rollout, torch.Tensor, torch.Tensor]] = []
        dropped: list[tuple[Rollout, torch.Tensor, torch.Tensor]] = []
        times: dict[str, float] = {}
        rollout_tokens, draws = 0, 0
        samples, errors, scored_count = [], [], 0
        while True:
            ro, scored, shaped = self.draw(gen)
            score = scored.scores
            samples += scored.samples
            errors += scored.errors
            scored_count += int(score.numel())
            draws += 1
            rollout_tokens += int(ro.response_mask.sum())
            for key in ("time/rollout_s", "time/reward_s"):
                times[key] = times.get(key, 0.0) + self.phases.metrics[key]
            keep = varied_groups(score if fg.metric == "score" else shaped, n) if fg.enable else torch.ones(want, dtype=torch.bool)
            for g, ok in enumerate(keep.tolist()):
                rows = slice(g * n, (g + 1) * n)
                (kept if ok else dropped).append((ro.select(rows), score[rows], shaped[rows]))
            short = torch.tensor([max(0, want - len(kept))], dtype=torch.long, device=score.device)
            short = collectives.all_reduce(short, "max", group=dp_group)
            if int(short) == 0 or (fg.max_num_gen_batches > 0 and draws >= fg.max_num_gen_batches):
                break
        kept_groups = min(len(kept), want)
        # Not enough varied groups within max_num_gen_batches: fill up with dropped ones (equal rewards give
        # zero GRPO advantage, so they add no policy gradient) rather than stop the job as verl does.
        chosen = kept[:want] + dropped[: want - kept_groups]
        ro = concat_rollouts([c[0] for c in chosen], self.pad_id)
        score = torch.cat([c[1] for c in chosen])
        shaped = torch.cat([c[2] for c in chosen])
        self.phases.metrics.update(times)
        self.phases.metrics["tokens_per_s/rollout"] = rollout_tokens / max(times["time/rollout_s"], 1e-9)
        counts = torch.tensor([kept_groups, want - kept_groups, float(score.sum()), float((shaped - score).sum()), score.numel()],
                              dtype=torch.float64, device=score.device)
        counts = collectives.all_reduce(counts, group=dp_group)
        metrics = {
            "dapo/num_gen_batches": draws, "dapo/kept_groups": int(counts[0]), "dapo/filled_groups": int(counts[1]),
            "dapo/score_mean": float(counts[2] / counts[4]), "dapo/overlong_penalty_mean": float(counts[3] / counts[4]),
        }
        return Sampled(ro, shaped, [i for i in range(want) for _ in range(n)], metrics, samples, errors, scored_count)
