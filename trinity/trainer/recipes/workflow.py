"""The RL step's sampling phase when the job has a `workflow:` block (docs/workflows.md): each task (a data
row) runs `rollout.n` episodes of the workflow, all concurrently through the recipe's rollout engine
(trinity.workflows.runner: their turns in one running batch of the continuous engine), and each episode's conversation becomes
training rows of the usual `Rollout` shape:

- the row's "prompt" is the conversation up to the first assistant token, its "response" everything after
  it: assistant tokens with response_mask 1 and the log-probs the engine sampled them with, the template's,
  tools' and users' tokens between turns with mask 0 (trinity.workflows.transcript builds them). The
  forward passes, packing and losses read the mask as they are (`rollout_forward.sequence_lengths` packs a
  response up to its last masked-in token);
- the score is the episode's reward (its per-turn rewards summed where it gives only those), on the row's
  last assistant token (`RLRecipe.experience`); group ids are the task's, so GRPO's and RLOO's baseline is
  over a task's n conversations. A conversation split into several sequences (`template_mismatch:
  segment`) gives several rows of its task's group, each with the episode's score; an episode that ended
  before its first turn one empty row (`episode_rows`).

`RLRecipe` picks this in one place (`build_data`); `sample` delegates here.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from trinity.errors import UserError
from trinity.rollout.types import Rollout
from trinity.trainer.recipes import Metrics
from trinity.trainer.samples import Sample

if TYPE_CHECKING:
    from trinity.data.loader import RowSampler
    from trinity.trainer.recipes.rl import RLRecipe, Sampled
    from trinity.workflows.backends import PrefillTotals
    from trinity.workflows.batcher import BatchStats
    from trinity.workflows.types import Episode, Task, TrainingSequence

END_REASONS = ("finished", "max_turns", "context_limit", "timeout", "error")


@dataclass(frozen=True)
class TaskRow:
    task: Task
    source: str  # "file:line"


class TaskData:
    """The workflow's tasks (data.train_files' rows as they are) and their sampler: `train_batch_size`
    tasks a step over all DP ranks, ordered, sharded and resumed as the RL prompts are."""

    def __init__(self, rows: list[TaskRow], sampler: RowSampler):
        self.rows, self.sampler = rows, sampler

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    def next_batch(self) -> list[TaskRow]:
        (mine,) = self.sampler.rank_micro_batches(self.sampler.next_global_indices())
        return [self.rows[i] for i in mine]

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.sampler.load_state_dict(state)

    def summary(self) -> str:
        return f"{len(self.rows)} workflow tasks, {self.steps_per_epoch} steps per epoch"


def build_task_data(files: Sequence[str], *, batch_size: int, seed: int, dp_rank: int, dp_size: int,
                    shuffle: bool) -> TaskData:
    from trinity.data.loader import RowSampler
    from trinity.data.readers import read_records

    rows = [TaskRow(r.row, r.where) for r in read_records(files)]
    if not rows:
        raise UserError(f"{', '.join(map(str, files))}: no tasks; the training files hold no records")
    sampler = RowSampler(len(rows), global_batch_size=batch_size, micro_batch_size=batch_size // dp_size,
                         dp_rank=dp_rank, dp_size=dp_size, seed=seed, shuffle=shuffle, what="data.train_batch_size")
    return TaskData(rows, sampler)


def episode_score(episode: Episode) -> float:
    """The episode's reward, or the sum of its per-turn rewards where it gives only those."""
    if episode.reward is not None:
        return float(episode.reward)
    return float(sum(episode.turn_rewards or ()))


@dataclass(frozen=True)
class EpisodeRows:
    """Episodes as RL rows: `rollout` (one row per training sequence), `scores` [rows], `groups` (the
    task of each row) and `episode` (the episode of each row, -1 for padding)."""

    rollout: Rollout
    scores: torch.Tensor
    groups: list[int]
    episode: list[int]


def episode_rows(episodes: Sequence[Episode], groups: Sequence[int], pad_id: int,
                 device: torch.device | str = "cpu", rows: int | None = None) -> EpisodeRows:
    """Every training sequence of `episodes` as a row `[prompt (left-padded) | response (right-padded)]`:
    the prompt is the sequence up to its first assistant token, the response the rest, with its loss mask
    and behaviour log-probs. `groups[k]`: the group id of episode k (ids >= 0).

    An episode without a sequence (it ended before its first turn) gives one empty row (a pad token as its
    prompt, no response token) scored as the episode, so that every episode counts in the step's reward;
    then, up to `rows`, empty rows scored 0 (data-parallel ranks must all have as many rows: each rank makes
    the same number of optimizer steps). An empty row is a group of its own (ids -1, -2, ...), outside every
    task's baseline, and trains nothing (its mask is 0)."""
    items: list[tuple[int, TrainingSequence | None]] = []
    for k, ep in enumerate(episodes):
        items += [(k, s) for s in ep.sequences] or [(k, None)]
    items += [(-1, None)] * max(0, (rows or 0) - len(items))
    firsts = [s.loss_mask.index(1) if s is not None else 1 for _, s in items]
    P = max(firsts, default=1)
    R = max([len(s.tokens) - f for (_, s), f in zip(items, firsts) if s is not None], default=1)
    B = len(items)
    tokens = torch.full((B, P + R), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    response_mask = torch.zeros(B, R, dtype=torch.long)
    logprobs = torch.zeros(B, R, dtype=torch.float32)
    row_groups: list[int] = []
    for i, ((k, s), f) in enumerate(zip(items, firsts)):
        prompt_mask[i, P - f:] = 1
        if s is None:  # an empty row: one pad token of prompt (a row needs one), nothing to train
            row_groups.append(-1 - i)
            continue
        row_groups.append(groups[k])
        ids, mask, logp = s.tensors()
        n = len(s.tokens) - f
        tokens[i, P - f: P] = ids[:f]
        tokens[i, P: P + n] = ids[f:]
        response_mask[i, :n] = mask[f:]
        logprobs[i, :n] = logp[f:]
    ro = Rollout(tokens.to(device), prompt_mask.to(device), response_mask.to(device), logprobs.to(device))
    scores = torch.tensor([episode_score(episodes[k]) if k >= 0 else 0.0 for k, _ in items], dtype=torch.float32,
                          device=device)
    return EpisodeRows(ro, scores, row_groups, [k for k, _ in items])


def episode_sample(episode: Episode, source: str) -> Sample:
    """What trainer.log_samples prints of an episode: its first message, the rest of the conversation."""
    first, *rest = episode.messages or ({"role": "user", "content": ""},)
    answer = episode.task.get("answer")
    return {"prompt": first["content"], "response": "\n".join(f"[{m['role']}] {m['content']}" for m in rest),
            "reward": episode_score(episode), "answer": None if answer is None else str(answer), "source": source}


class WorkflowSampling:
    """`RLRecipe.sample` for a workflow job: its data are the tasks, its rollout the episodes."""

    def __init__(self, recipe: RLRecipe, data: TaskData):
        from trinity.workflows.registry import resolve_workflow

        cfg = recipe.cfg
        assert cfg.workflow is not None
        self.recipe, self.data, self.cfg = recipe, data, cfg.workflow
        # a user's module is imported here, in the trainer, from the job's directory (as a shell would)
        if str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        try:
            self.workflow = resolve_workflow(self.cfg.function)
        except (ImportError, ValueError) as e:
            raise UserError(f"workflow.function: {e}") from e
        self.limits = self.cfg.limits(cfg.workflow_context_tokens)
        # The engine waits for the episodes it has just answered (deterministic steps, so a step's draws do
        # not depend on timing) unless one keeps it waiting this long (a tool or environment step running).
        self.window_s = min(1.0, self.limits.turn_timeout_s / 2)

    @classmethod
    def build(cls, recipe: RLRecipe, dp_rank: int, dp_size: int) -> WorkflowSampling:
        cfg = recipe.cfg
        if not cfg.data.train_files:
            raise UserError("data.train_files: a workflow job needs at least one task file")
        data = build_task_data(cfg.data.train_files, batch_size=cfg.data.train_batch_size, seed=cfg.trainer.seed,
                               dp_rank=dp_rank, dp_size=dp_size, shuffle=cfg.data.shuffle)
        return cls(recipe, data)

    def run_episodes(self, tasks: Sequence[Task], gen: torch.Generator) -> tuple[list[Episode], BatchStats, PrefillTotals]:
        """(episodes, task-major, rollout.n per task; what the running batch did; the prompt tokens prefilled
        and taken from parked KV slots). The actor's model chunks decode through one open continuous engine
        (workflow jobs run without model parallelism, so sequence parallelism is off), its KV slots sized to
        the context limit."""
        from trinity.rollout.kv_budget import KVBudget
        from trinity.workflows.backends import RolloutBackend
        from trinity.workflows.batcher import RunningBatcher
        from trinity.workflows.runner import run_episode

        recipe = self.recipe
        chunks = list(recipe.actor.model)
        backend = RolloutBackend(chunks if len(chunks) > 1 else chunks[0], recipe.vocab_size, recipe.pad_id,
                                 budget=KVBudget.from_config(recipe.cfg.actor_rollout_ref.rollout), generator=gen,
                                 context_tokens=self.limits.context_tokens)
        n = recipe.cfg.actor_rollout_ref.rollout.n

        async def run_all() -> list[Episode]:
            batcher = RunningBatcher(backend, episodes=len(tasks) * n, window_s=self.window_s)
            jobs = [run_episode(self.workflow, task, batcher, recipe.tokenizer, episode=i * n + k, limits=self.limits,
                                sampling=recipe.sampling, args=self.cfg.args, label=f"task {i} sample {k}",
                                template_args=self.cfg.template_args)
                    for i, task in enumerate(tasks) for k in range(n)]
            try:
                return list(await asyncio.gather(*jobs))
            finally:
                batcher.close()
                stats.append(batcher.stats)

        stats: list[BatchStats] = []
        return asyncio.run(run_all()), stats[0], backend.stats

    def sample(self, step: int, gen: torch.Generator) -> Sampled:
        from trinity.trainer.recipes.lora_ref import rollout_weights
        from trinity.distributed import collectives
        from trinity.trainer.recipes.rl import Sampled, _dp_info, _dp_stats
        from trinity.workflows.runner import WorkflowError

        recipe = self.recipe
        n = recipe.cfg.actor_rollout_ref.rollout.n
        rows = self.data.next_batch()

        def run() -> tuple[list[Episode], BatchStats, PrefillTotals]:
            with rollout_weights(recipe.actor, keep=recipe.cfg.actor_rollout_ref.actor.lora.rollout_weights):
                try:
                    return self.run_episodes([r.task for r in rows], gen)
                except WorkflowError as e:
                    raise UserError(f"workflow.function: {e}") from e

        episodes, batch, prefill = recipe.phases.run(
            "rollout", {"actor": {"params": True}}, run,
            tokens=lambda r: sum(len(t.output_ids) for ep in r[0] for t in ep.turns))
        device = recipe.phases.device
        groups = [i for i in range(len(rows)) for _ in range(n)]
        built = episode_rows(episodes, groups, recipe.pad_id, device)
        _, dp, dp_group = _dp_info()
        if dp > 1:  # as many rows on every rank (a conversation may give several)
            most = int(collectives.all_reduce(torch.tensor([built.rollout.tokens.shape[0]], device=device), "max",
                                              group=dp_group).item())
            if most > built.rollout.tokens.shape[0]:
                built = episode_rows(episodes, groups, recipe.pad_id, device, rows=most)
        # the share of the turns' prompt tokens whose keys came from the conversation's parked KV slot
        # instead of a prefill, over the DP ranks (a device tensor: NCCL reduces nothing on the host)
        tokens = torch.tensor([float(prefill.reused_tokens), float(prefill.prefilled_tokens)], dtype=torch.float64,
                              device=device)
        if dp > 1:
            tokens = collectives.all_reduce(tokens, group=dp_group)
        metrics: Metrics = {"workflow/live_rows_mean": batch.live_rows_mean,
                            "workflow/turns_joined": batch.joined / max(batch.turns, 1),
                            "workflow/sequences": built.rollout.tokens.shape[0],
                            "workflow/prompt_tokens_reused": float(tokens[0] / tokens.sum().clamp(min=1))}
        metrics["workflow/turns_mean"], _ = _dp_stats(torch.tensor([float(len(e.turns)) for e in episodes], device=device))
        for reason in END_REASONS:
            metrics[f"workflow/end_{reason}"], _ = _dp_stats(
                torch.tensor([float(e.end == reason) for e in episodes], device=device))
        errors = [f"{rows[i // n].source}: {e.end}: {e.error}" for i, e in enumerate(episodes) if e.error is not None]
        if errors:
            print(f"workflow {self.cfg.function}: {len(errors)} of {len(episodes)} episodes scored 0 "
                  f"(workflow.on_error: zero); the first: {errors[0]}", file=sys.stderr, flush=True)
        samples = [episode_sample(e, rows[i // n].source) for i, e in enumerate(episodes)]
        return Sampled(built.rollout, built.scores, built.groups, metrics, samples, [], len(episodes))
