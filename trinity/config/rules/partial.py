"""Rules of partial rollouts (`actor_rollout_ref.rollout.partial`, trinity.rollout.partial): refused where
they would be accepted and not take effect."""

from __future__ import annotations

from trinity.config.rules.fields import non_default
from trinity.config.schema import JobConfig

P = "actor_rollout_ref.rollout.partial"


def check_partial(cfg: JobConfig, problems: list[str]) -> None:
    partial = cfg.actor_rollout_ref.rollout.partial
    if not partial.enable:
        for name in non_default(partial, ["over_sampling_batch_size", "max_staleness", "rollout_is_threshold"]):
            problems.append(f"{P}.{name}: has no effect while {P}.enable is false; set enable: true or remove the key")
        return
    if not cfg.spec.rollout:
        problems.append(f"{P}.enable: partial rollouts apply to RL algorithms, not {cfg.spec.name}; remove the block")
        return
    if cfg.spec.name == "dapo":
        problems.append(
            f"{P}.enable: not available with dapo (its dynamic sampling draws whole batches again and drops groups, "
            "which carried-over groups cannot follow); use grpo, rloo, reinforce_plus_plus, cispo or ppo, or disable "
            "partial rollouts")
    lay = cfg.actor_rollout_ref.actor.megatron
    if lay.pipeline_model_parallel_size > 1:
        problems.append(
            f"{P}.enable: not supported with pipeline parallelism (actor_rollout_ref.actor.megatron."
            f"pipeline_model_parallel_size = {lay.pipeline_model_parallel_size}); use pipeline_model_parallel_size 1 "
            "or disable partial rollouts")
    if lay.context_parallel_size > 1:
        problems.append(
            f"{P}.enable: not supported with context parallelism (actor_rollout_ref.actor.megatron."
            f"context_parallel_size = {lay.context_parallel_size}); use context_parallel_size 1 or disable partial "
            "rollouts")
    if cfg.workflow is not None:
        problems.append(
            f"{P}.enable: not available with a workflow (workflow.function): an episode's turns are generated one "
            "after another, not carried over between steps; remove the workflow or disable partial rollouts")
    layout, world = lay.layout(), cfg.cluster.world_size
    dp = layout.dp(world) if world % layout.model_parallel_size == 0 else None  # else the layout rule reports it
    batch = cfg.data.train_batch_size
    over = partial.over_sampling_batch_size
    if over is not None:
        if over < batch:
            problems.append(f"{P}.over_sampling_batch_size: {over} is below data.train_batch_size ({batch}); the "
                            f"rollout keeps at least a batch in flight: use at least {batch}, or unset it (2 x {batch})")
        elif dp and over % dp:
            problems.append(f"{P}.over_sampling_batch_size: {over} is not divisible by the data-parallel size ({dp}); "
                            f"use a multiple of {dp}")
