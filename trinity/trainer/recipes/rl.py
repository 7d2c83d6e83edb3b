"""The RL recipe (`RLRecipe`): one step is rollout -> rewards -> ref log-probs -> old log-probs (+ values)
-> advantages -> actor update (-> critic update), with offload between phases. It runs grpo, rloo,
reinforce_plus_plus and cispo as it is; their specs (trinity.algorithms.registry) choose the advantage
estimator and the policy loss. PPO (`ppo.py`) adds the critic, DAPO (`dapo.py`) its dynamic sampling.

Data parallelism: each DP rank generates `rollout.n` responses for its own prompts, so a GRPO group never
spans ranks and group statistics are local; PPO whitens advantages over the whole batch of the DP group
(one all-reduce of sum, sum of squares and count), so they do not depend on the DP size. TP ranks of
one DP replica see the same prompts and sample the same tokens (trinity.rollout.parallel).

Micro batches: by default each phase packs the sequences' real tokens into rows of a token budget
(`actor.use_dynamic_bsz` / `ppo_max_token_len_per_gpu`, `ref.log_prob_*`, `critic.*`: verl's names;
`rollout_forward.Batching`); results come back per sequence, [B, R] in the rollout's order. On-policy
steps take the old log-probs from the actor update's own forward (`rl_update` module doc).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence, TypeVar

import torch

from trinity.config.roles import Role
from trinity.distributed import collectives
from trinity.errors import UserError
from trinity.rollout.types import Rollout, RolloutEngine, RolloutStats, SamplingParams
from trinity.trainer.engine import RoleEngine
from trinity.trainer.engine.offload import memory_gib
from trinity.trainer.recipes import Metrics, Recipe, StepOutput
from trinity.trainer.recipes import rollout_forward as F
from trinity.trainer.recipes.lora_ref import AdaptersOff, rollout_weights, uses_lora
from trinity.trainer.recipes.rl_update import ActorUpdate, Experience, actor_update
from trinity.trainer.samples import Sample

if TYPE_CHECKING:
    import torch.distributed
    from transformers import PreTrainedTokenizerBase

    from trinity.data.prompts import Prompt, PromptData
    from trinity.rollout.partial import PartialGroup, PartialOutcome
    from trinity.trainer.recipes.rl_partial import PartialStream
    from trinity.trainer.recipes.workflow import TaskData, WorkflowSampling

T = TypeVar("T")
# A phase's tokens (`Phases.run`): the real ones, or (real, computed: padding included); ints or 0-d tensors.
PhaseTokens = int | torch.Tensor | tuple[int | torch.Tensor, int | torch.Tensor]


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model_dir: str) -> tuple[int, ...]:
    """EOS of the tokenizer plus generation_config.json's eos_token_id (int or list), if any."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(int(v) for v in (value if isinstance(value, list) else [value]) if v is not None)
    return tuple(sorted(ids))


class Phases:
    """Times, token counts and memory per phase; `run` moves offloaded parts for the phase.

    mem/<phase>_gib is measured after the moves, before the phase; mem/<phase>_end_gib after it finishes
    (outside the timed span); on CUDA mem/<phase>_peak_gib is the peak during it.
    """

    def __init__(self, device: torch.device, engines: Mapping[str, RoleEngine]):
        self.device, self.engines = device, engines
        self.metrics: dict[str, float] = {}

    def run(self, name: str, needs: dict[str, dict[str, bool]], fn: Callable[[], T],
            tokens: Callable[[T], PhaseTokens] | PhaseTokens | None = None) -> T:
        """`tokens`: the phase's real tokens, or (real, computed) where computed counts what the forward
        passes ran, padding included (padding_fraction/<name>); a number, or a function of the result."""
        # every role gives up what the phase does not use before any role brings its parts back
        for role, engine in self.engines.items():
            engine.release(**needs.get(role, {"params": False}))
        for role, engine in self.engines.items():
            engine.need(**needs.get(role, {"params": False}))
        self.metrics[f"mem/{name}_gib"] = memory_gib(self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        result = fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.metrics[f"mem/{name}_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        dt = time.perf_counter() - t0
        # What the phase leaves behind (its outputs, activations not yet freed), before the next phase's moves.
        self.metrics[f"mem/{name}_end_gib"] = memory_gib(self.device)
        self.metrics[f"time/{name}_s"] = dt
        n = tokens(result) if callable(tokens) else tokens
        if n is not None:
            real, computed = n if isinstance(n, tuple) else (n, None)
            self.metrics[f"tokens_per_s/{name}"] = float(real) / max(dt, 1e-9)
            if computed:
                self.metrics[f"padding_fraction/{name}"] = 1.0 - float(real) / float(computed)
        return result


def _dp_info() -> tuple[int, int, torch.distributed.ProcessGroup]:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_group()


def _from_last_stage(metrics: dict[str, float]) -> dict[str, float]:
    """An update's metrics as the last pipeline stage has them (the losses exist only there), on every stage."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return metrics
    return collectives.broadcast_object(
        metrics, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())


def _dp_stats(values: torch.Tensor) -> tuple[float, float]:
    """Mean and std of per-sequence values over all DP ranks."""
    group = _dp_info()[2]
    v = values.double()
    s = torch.stack([v.sum(), (v * v).sum(), torch.tensor(float(v.numel()), dtype=torch.float64, device=v.device)])
    s = collectives.all_reduce(s, group=group)
    mean = s[0] / s[2]
    return float(mean), float(torch.sqrt(torch.clamp(s[1] / s[2] - mean * mean, min=0)))


def _logprob_gap(rollout_logp: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean and max |rollout log-prob - training log-prob| over the response tokens of all DP ranks: the
    rollout and the training forward run the same weights, so this is their numerical difference
    (KV-cache decoding vs one whole-sequence pass, kernels, dtype)."""
    group = _dp_info()[2]
    m = mask.float()
    d = (rollout_logp.float() - logp.float()).abs() * m
    s = torch.stack([d.sum().double(), m.sum().double()])
    mx = d.max().reshape(1) if d.numel() else d.new_zeros(1)
    s = collectives.all_reduce(s, group=group)
    mx = collectives.all_reduce(mx, "max", group=group)
    if float(s[1]) == 0:
        return {}
    return {"rollout/logprob_diff_mean": float(s[0] / s[1]), "rollout/logprob_diff_max": float(mx)}


def last_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, R] float32: each row's score on its last counted token (mask 1), 0 elsewhere and on rows with
    none. The last one, not position mask.sum() - 1: a multi-turn response's mask has holes (the tool and
    user tokens between assistant turns)."""
    last = (mask * torch.arange(1, mask.shape[1] + 1, device=mask.device)).argmax(-1)
    token_rewards = torch.zeros(tuple(mask.shape), dtype=torch.float32, device=mask.device)
    token_rewards[torch.arange(mask.shape[0], device=mask.device), last] = scores.float() * (mask.sum(-1) > 0)
    return token_rewards


def _masked_stats(prefix: str, x: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    sel = x[mask.bool()]
    if sel.numel() == 0:
        return {}
    return {f"{prefix}/mean": float(sel.mean()), f"{prefix}/max": float(sel.max()), f"{prefix}/min": float(sel.min())}


class SequenceParallelOff:
    """The rollout engine the RL recipes run (a `RolloutEngine`): `engine` with sequence parallel switched
    off on the actor's `chunks` around each `generate`. Decoding feeds one token per step, which cannot be
    split over TP ranks (trinity.distributed.sequence_parallel); a no-op for models built without it."""

    def __init__(self, engine: RolloutEngine, chunks: Sequence[torch.nn.Module]):
        self.engine, self.chunks = engine, list(chunks)

    @property
    def stats(self) -> RolloutStats:
        return self.engine.stats

    @property
    def time_buckets(self) -> bool:
        return self.engine.time_buckets

    @time_buckets.setter
    def time_buckets(self, on: bool) -> None:
        self.engine.time_buckets = on

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generator: torch.Generator | None = None) -> Rollout:
        from trinity.distributed import context_parallel as cpx
        from trinity.distributed.sequence_parallel import sequence_parallel_disabled

        # context parallelism: each CP rank decodes the replica's prompts whole (same seed); CP rank 0's
        # rollout is then every CP rank's
        with sequence_parallel_disabled(self.chunks), cpx.context_parallel_disabled(self.chunks):
            ro = self.engine.generate(prompts, params, generator)
        group = cpx.cp_group()
        if group is None:
            return ro
        tokens, prompt_mask, response_mask, logprobs = cpx.same_on_cp_ranks(
            [ro.tokens, ro.prompt_mask, ro.response_mask, ro.logprobs], group)
        return replace(ro, tokens=tokens, prompt_mask=prompt_mask, response_mask=response_mask,
                                   logprobs=logprobs)

    def generate_partial(self, carried: Sequence[PartialGroup], fresh: Callable[[], PartialGroup],
                         params: SamplingParams, generator: torch.Generator | None = None,
                         **kw: int) -> PartialOutcome:
        """A partial rollout (trinity.rollout.partial) of the wrapped engine, sequence parallel off."""
        from trinity.distributed.sequence_parallel import sequence_parallel_disabled

        with sequence_parallel_disabled(self.chunks):
            return self.engine.generate_partial(carried, fresh, params, generator, **kw)


@dataclass(frozen=True)
class Scored:
    """The reward of one rollout: a score per response, the samples logged (trinity.trainer.samples), and
    the errors of the responses scored 0 (reward.on_error: zero)."""

    scores: torch.Tensor
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Sampled:
    """A step's scored rollout: rollout.n responses per prompt (a prompt's responses consecutive), their
    scores and group ids, extra metrics, and every response scored on the way (samples, reward errors)."""

    rollout: Rollout
    scores: torch.Tensor
    groups: list[int]
    metrics: Metrics
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    scored: int = 0  # responses scored (DAPO scores more than it keeps)


class RLRecipe(Recipe):
    """Every RL algorithm. Subclasses add a critic (`update_critic(...)`, PPO) or replace `sample(...)`
    (DAPO)."""

    data: PromptData | TaskData
    rollout_engine: RolloutEngine
    partial: PartialStream | None = None  # actor_rollout_ref.rollout.partial (trinity.trainer.recipes.rl_partial)
    workflow: WorkflowSampling | None = None  # a `workflow:` job's sampling (recipes/workflow.py)

    def build_data(self) -> PromptData | TaskData:
        from trinity.data.loader import load_tokenizer, pad_token_id
        from trinity.data.prompts import build_prompt_data
        from trinity.rewards.process import GuardedReward

        cfg = self.cfg
        self.reward_fn = GuardedReward(cfg.reward)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
        self.pad_id = pad_token_id(self.tokenizer)
        rollout = cfg.actor_rollout_ref.rollout
        self.sampling = SamplingParams(
            temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
            max_new_tokens=rollout.response_length, eos_token_ids=eos_token_ids(self.tokenizer, cfg.model.path),
        )
        dp_rank, dp, _ = _dp_info()
        if not cfg.data.train_files:
            raise UserError("data.train_files: RL needs at least one prompt file")
        self.seqs_per_update = cfg.actor_rollout_ref.actor.ppo_mini_batch_size * rollout.n // dp
        if cfg.workflow is not None:  # the one place a workflow job's sampling is chosen
            from trinity.trainer.recipes.workflow import WorkflowSampling

            self.workflow = WorkflowSampling.build(self, dp_rank, dp)
            return self.workflow.data
        data = build_prompt_data(
            cfg.data.train_files, self.tokenizer, batch_size=cfg.data.train_batch_size,
            max_prompt_length=cfg.data.max_prompt_length, seed=cfg.trainer.seed, dp_rank=dp_rank, dp_size=dp,
            shuffle=cfg.data.shuffle, prompt_key=cfg.data.prompt_key, messages_key=cfg.data.messages_key,
            answer_key=cfg.data.answer_key,
        )
        if rollout.partial.enable:
            from trinity.trainer.recipes.rl_partial import PartialStream

            # each rank's data position and carried groups are its own: saved per rank with a checkpoint
            self.partial = data.rank_state = PartialStream(cfg, data, dp_rank, dp)
        return data

    def setup(self) -> None:
        from trinity.rollout.continuous import ActorRollout, KVBudget

        self.vocab_size = self.ctx.facts.vocab_size
        # Decoding feeds one token per step, which cannot be split over TP ranks: the rollout (and the
        # evaluation, which uses this engine) runs the actor's modules with sequence parallel off.
        # With virtual pipeline stages (VPP) the rollout decodes through all of this rank's model chunks.
        chunks = list(self.actor.model)
        self.rollout_engine = SequenceParallelOff(
            ActorRollout(chunks if len(chunks) > 1 else chunks[0], self.vocab_size, self.pad_id,
                         KVBudget.from_config(self.cfg.actor_rollout_ref.rollout)), self.actor.model)
        self.phases = Phases(self.ctx.device, self.engines)
        self.batching = self.make_batching()

    def describe(self) -> str:
        return f"{super().describe()}; roles: {', '.join(self.engines)}"

    def profiling(self, on: bool) -> None:
        # a profiled step also times the rollout's decode steps per batch bucket
        self.rollout_engine.time_buckets = on

    def profile_lines(self) -> list[str]:
        return self.rollout_engine.stats.bucket_lines()

    def make_batching(self) -> dict[str, F.Batching]:
        """Each role's `Batching` (rollout_forward): packed rows of its token budget, or padded rows."""
        from megatron.core import parallel_state as ps

        from trinity.config.plan import rl_token_budget

        cfg = self.cfg
        # sequence parallel splits a row over the TP ranks; at PP>1 one shape per schedule call
        tp = ps.get_tensor_model_parallel_world_size()
        multiple = tp if cfg.actor_rollout_ref.actor.megatron.sequence_parallel and tp > 1 else 1
        cp = ps.get_context_parallel_world_size()
        multiple *= 2 * cp if cp > 1 else 1  # context parallelism: two equal chunks per CP rank
        same = ps.get_pipeline_model_parallel_world_size() > 1
        return {
            role.value: F.Batching(cfg.trainer.micro_batch_size, rl_token_budget(cfg, role),
                                   multiple=multiple, same_length=same)
            for role in (Role.actor, Role.ref, Role.critic)
        }

    def on_policy(self, ro: Rollout, warmup: bool) -> bool:
        """Whether this step's old log-probs can come from the actor update's own forward: one epoch over
        one mini-batch (the update starts from the weights that generated the rollout), no KL in the
        reward (it needs them before the update), an actor update this step, and no forced recompute."""
        actor = self.cfg.actor_rollout_ref.actor
        return (not actor.recompute_old_log_prob and actor.ppo_epochs == 1 and not warmup
                and self.seqs_per_update >= ro.tokens.shape[0] and not self.cfg.algorithm.use_kl_in_reward)

    @property
    def ref(self) -> F.Inference | None:
        if uses_lora(self.cfg) and self.cfg.needs_ref:
            return AdaptersOff(self.actor)
        return self.engines.get(Role.ref.value)

    @property
    def ref_engine(self) -> str:
        """The engine whose parameters the ref phase needs: the actor's with LoRA."""
        return Role.actor.value if uses_lora(self.cfg) else Role.ref.value

    @property
    def critic(self) -> RoleEngine | None:
        return self.engines.get(Role.critic.value)

    # ---------------------------------------------------------------- what the algorithms differ in

    def advantages(self, token_rewards: torch.Tensor, groups: list[int], mask: torch.Tensor,
                   values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The algorithm's advantage estimator (AlgorithmSpec.advantages); whitening ones over the DP group."""
        from trinity.algorithms.advantages import ESTIMATORS

        _, dp, dp_group = _dp_info()
        estimator = ESTIMATORS[self.cfg.spec.advantages]
        return estimator(token_rewards, groups, mask, values, self.cfg.algorithm, dp_group if dp > 1 else None)

    def critic_warmup(self, step: int) -> bool:
        """Whether this step trains the critic only (PPO's critic.warmup_steps)."""
        return False

    def update_critic(self, exp: Experience) -> Metrics:
        return {}

    # ---------------------------------------------------------------- one step

    def sample(self, step: int, gen: torch.Generator) -> Sampled:
        """This step's scored rollout. DAPO's dynamic sampling overrides it."""
        if self.workflow is not None:
            return self.workflow.sample(step, gen)
        if self.partial is not None:
            return self.sample_partial(step)
        prompts = self.data.next_batch()
        ro = self.generate(prompts, gen)
        n = self.cfg.actor_rollout_ref.rollout.n
        scored = self.score(prompts, ro)
        return Sampled(ro, scored.scores, [i for i in range(len(prompts)) for _ in range(n)], {},
                       scored.samples, scored.errors, int(scored.scores.numel()))

    def sample_partial(self, step: int) -> Sampled:
        """Partial rollouts (trinity.trainer.recipes.rl_partial): this step's complete groups, carried-over
        answers continued; the rollout's log-probs are the behaviour policy's (older for carried tokens)."""
        assert self.partial is not None
        partial, n = self.partial, self.cfg.actor_rollout_ref.rollout.n

        def run() -> tuple[list[Prompt], Rollout, torch.Tensor, dict[str, float]]:
            with rollout_weights(self.actor, keep=self.cfg.actor_rollout_ref.actor.lora.rollout_weights):
                return partial.rollout(self.rollout_engine, self.sampling, step, self.phases.device, self.pad_id)

        def tokens(_: object) -> PhaseTokens:
            return self.rollout_engine.stats.tokens, self.rollout_engine.stats.computed_tokens

        prompts, ro, versions, counts = self.phases.run("rollout", {"actor": {"params": True}}, run, tokens=tokens)
        self.phases.metrics.update(self.engine_metrics())
        scored = self.score(prompts, ro)
        mask = ro.response_mask.bool()
        age = (step - versions).double()[mask]
        sums = torch.tensor([float(age.sum()), float(age.numel()), counts["carried_over"], counts["restarted_groups"]],
                            dtype=torch.float64, device=ro.tokens.device)
        sums = collectives.all_reduce(sums, group=_dp_info()[2])
        metrics = {"rollout/carried_over": float(sums[2]), "rollout/restarted_groups": float(sums[3]),
                   "rollout/staleness_mean": float(sums[0] / sums[1].clamp(min=1))}
        return Sampled(ro, scored.scores, [i for i in range(len(prompts)) for _ in range(n)], metrics,
                       scored.samples, scored.errors, int(scored.scores.numel()))

    def is_metrics(self, old_logp: torch.Tensor, ro: Rollout) -> dict[str, float]:
        """The truncated importance weights the update applied (partial rollouts), over all DP ranks."""
        from trinity.algorithms.losses import truncated_is_weights

        cap = self.cfg.actor_rollout_ref.rollout.partial.rollout_is_threshold
        group = _dp_info()[2]
        weights, ratio = truncated_is_weights(old_logp, ro.logprobs, ro.response_mask, cap)
        m = ro.response_mask.bool()
        s = torch.tensor([float(weights[m].sum()), float((ratio[m] > cap).sum()), float(m.sum())], dtype=torch.float64,
                         device=ro.tokens.device)
        s = collectives.all_reduce(s, group=group)
        mx = collectives.all_reduce(weights[m].max().reshape(1) if m.any() else weights.new_zeros(1), "max", group=group)
        count = float(s[2]) or 1.0
        return {"rollout/is_weight_mean": float(s[0]) / count, "rollout/is_weight_max": float(mx),
                "rollout/is_clipped_fraction": float(s[1]) / count}

    def generate(self, prompts: list[Prompt], gen: torch.Generator) -> Rollout:
        n = self.cfg.actor_rollout_ref.rollout.n
        ids = [p.prompt_ids for p in prompts for _ in range(n)]
        def run() -> Rollout:
            # LoRA: the decoders read W + alpha/rank * B A, or compute the adapters beside W (`adapters`)
            with rollout_weights(self.actor, keep=self.cfg.actor_rollout_ref.actor.lora.rollout_weights):
                return self.rollout_engine.generate(ids, self.sampling, gen)

        def tokens(r: Rollout) -> PhaseTokens:
            # and the rows the engine's decode steps computed (padding_fraction/rollout; 0 where it counts none)
            return r.response_mask.sum(), self.rollout_engine.stats.computed_tokens

        ro = self.phases.run("rollout", {"actor": {"params": True}}, run, tokens=tokens)
        self.phases.metrics.update(self.engine_metrics())
        return ro

    def engine_metrics(self) -> dict[str, float]:
        """The engine's shape of its last rollout: slots (KV budget), decode steps, graph captures."""
        stats = self.rollout_engine.stats
        return {"rollout/slots": stats.slots, "rollout/decode_steps": stats.decode_steps,
                "rollout/prefill_calls": stats.prefill_calls,
                "rollout/graph_captures": stats.graph_captures, "rollout/graph_capture_s": stats.capture_s}

    def score(self, prompts: list[Prompt], ro: Rollout) -> Scored:
        n = self.cfg.actor_rollout_ref.rollout.n
        lengths = ro.response_mask.sum(-1)

        def run() -> Scored:
            texts = [self.tokenizer.decode(row[: int(k)].tolist(), skip_special_tokens=True) for row, k in zip(ro.responses, lengths)]
            result = self.reward_fn.score([p.text for p in prompts for _ in range(n)], texts,
                                          [p.answer for p in prompts for _ in range(n)])
            s = result.scores
            # what trainer.log_samples prints and writes (trinity.trainer.samples); every scored response of
            # the step, so DAPO's groups dropped by dynamic sampling are there too
            samples: list[Sample] = [
                {"prompt": p.text, "response": t, "reward": float(r), "answer": p.answer, "source": p.source}
                for p, t, r in zip([p for p in prompts for _ in range(n)], texts, s)]
            return Scored(torch.tensor(s, dtype=torch.float32, device=ro.tokens.device), samples, list(result.errors))

        return self.phases.run("reward", {"actor": {"params": True}}, run)

    def step(self, step: int) -> StepOutput:
        cfg = self.cfg
        dp_rank, _, _ = _dp_info()
        # The generator lives on the model's device: a CPU generator makes every decode step copy the
        # [batch, vocab] probabilities to the host and draw there (measured on an H100, 0.5B shape, 64 x 128
        # tokens: 42.6 s of rollout, ~330 ms per step, against ~4.5 ms per decode step on the GPU).
        gen = torch.Generator(device=self.phases.device).manual_seed(cfg.trainer.seed * 1_000_003 + step * 1009 + dp_rank)
        ph = self.phases
        ph.metrics = {}
        actor = self.actor

        sampled = self.sample(step, gen)
        ro, scores, groups = sampled.rollout, sampled.scores, sampled.groups
        reward_errors = self.reward_error_metrics(sampled.errors, sampled.scored)
        mask = ro.response_mask.float()
        lengths = ro.response_mask.sum(-1)
        bat = self.batching
        ref_logp = None
        if self.ref is not None:
            ref_logp = ph.run("ref", {self.ref_engine: {"params": True}}, lambda: F.infer_logprobs(
                self.ref, ro, self.vocab_size, bat["ref"].reset()), bat["ref"].counts)
        warmup = self.critic_warmup(step)
        old_logp = None
        if not self.on_policy(ro, warmup):
            old_logp = ph.run("old_logp", {"actor": {"params": True}}, lambda: F.infer_logprobs(
                actor, ro, self.vocab_size, bat["actor"].reset()), bat["actor"].counts)
        values = None
        if self.critic is not None:
            values = ph.run("values", {"critic": {"params": True}}, lambda: F.infer_values(
                self.critic, ro, bat["critic"].reset()), bat["critic"].counts)

        exp, extra = self.experience(ro, scores, groups, old_logp, ref_logp, values)
        out: Metrics = {"step": step}
        # no optimizer states: the engine brings them back for each optimizer step itself, once the
        # activations are freed (RoleOffloader.optimizer_step)
        full = {"params": True, "grads": True}
        if not warmup:
            # A step's updates share one LR (verl steps the schedule once per RL step).
            actor.advance_schedule()

            def update_actor() -> ActorUpdate:
                u = actor_update(actor, exp, cfg.actor_rollout_ref.actor, self.vocab_size,
                                 seqs_per_update=self.seqs_per_update, micro=bat["actor"].reset(),
                                 policy_loss=cfg.spec.load_policy_loss(),
                                 rollout_is_threshold=(cfg.actor_rollout_ref.rollout.partial.rollout_is_threshold
                                                       if self.partial is not None else None))
                return replace(u, metrics=_from_last_stage(u.metrics))

            updated = ph.run("update_actor", {"actor": full}, update_actor, bat["actor"].counts)
            out.update(updated.metrics)
            old_logp = updated.old_logp  # on-policy steps: from the update's forward
        out.update(self.update_critic(exp))

        reward_mean, reward_std = _dp_stats(scores)
        len_mean, _ = _dp_stats(lengths.float())
        prompt_mean, _ = _dp_stats(ro.prompt_mask.sum(-1).float())
        len_max = int(collectives.all_reduce(lengths.max().reshape(1), "max", group=_dp_info()[2]).item())
        # verl's name: the share of responses that reached rollout.response_length (cut there unless their
        # last token was an EOS), over all DP ranks
        clipped, _ = _dp_stats((lengths >= cfg.actor_rollout_ref.rollout.response_length).float())
        out.update({
            "reward/mean": reward_mean, "reward/std": reward_std, "response_length/mean": len_mean,
            "response_length/max": len_max, "response_length/clip_ratio": clipped, "prompt_length/mean": prompt_mean,
            "actor/lr": actor.lr(), "actor/warmup": warmup,
        })
        out.update(_logprob_gap(ro.logprobs, old_logp, mask))
        if self.partial is not None and not warmup:
            out.update(self.is_metrics(old_logp, ro))
        if ref_logp is not None:
            from trinity.algorithms.kl import token_kl

            kl = token_kl(old_logp, ref_logp, cfg.actor_rollout_ref.actor.kl_loss_type)
            out["actor/ref_kl"] = float((kl * mask).sum() / mask.sum().clamp(min=1))
        out.update(_masked_stats("advantages", exp.advantages, mask))
        out.update(_masked_stats("returns", exp.returns, mask))
        out.update(extra)
        out.update(sampled.metrics)
        out.update(reward_errors)
        out.update(ph.metrics)
        out["step_time_s"] = sum(v for k, v in ph.metrics.items() if k.startswith("time/"))
        return StepOutput(out, sampled.samples)

    def reward_error_metrics(self, errors: list[str], scored: int) -> Metrics:
        """`reward/errors`: the step's samples (all DP ranks) whose reward failed and scored 0
        (`reward.on_error: zero`), with one warning of this rank's first; nothing while none failed."""
        from trinity.rewards.process import errors_warning

        if self.cfg.reward.on_error != "zero":
            return {}
        _, dp, _ = _dp_info()
        mean, _ = _dp_stats(torch.tensor([float(len(errors))], device=self.phases.device))
        if errors:
            print(errors_warning(self.cfg.reward.function, errors, scored), file=sys.stderr, flush=True)
        return {"reward/errors": round(mean * dp)}

    def experience(self, ro: Rollout, scores: torch.Tensor, groups: list[int], old_logp: torch.Tensor | None,
                   ref_logp: torch.Tensor | None, values: torch.Tensor | None) -> tuple[Experience, dict[str, float]]:
        """Outcome reward on each response's last token, optional KL penalty, then the recipe's advantages.
        `old_logp` None: the actor update computes them (on-policy steps)."""
        from trinity.algorithms.kl import apply_kl_penalty

        algo = self.cfg.algorithm
        mask = ro.response_mask
        token_rewards = last_token_rewards(scores, mask)
        extra: dict[str, float] = {}
        if algo.use_kl_in_reward:
            assert ref_logp is not None and old_logp is not None
            token_rewards = apply_kl_penalty(token_rewards, old_logp, ref_logp, algo.kl_coef, algo.kl_penalty, mask)
            extra["reward/with_kl_penalty_mean"] = float(token_rewards.sum(-1).mean())
        adv, ret = self.advantages(token_rewards, groups, mask, values)
        return Experience(ro, old_logp, adv, ret, ref_logp, values), extra

    # ---------------------------------------------------------------- console

    def line(self, metrics: Metrics) -> list[str]:
        parts = [f"reward {metrics['reward/mean']:.3f}", f"len {metrics['response_length/mean']:.1f}"]
        for key in ("actor/pg_loss", "actor/ref_kl", "critic/vf_loss"):
            if key in metrics:
                parts.append(f"{key.split('/')[-1]} {metrics[key]:.4f}")
        parts.append(f"{metrics['step_time_s']:.2f} s/step")
        return parts
