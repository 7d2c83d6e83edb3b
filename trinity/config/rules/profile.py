"""Rules of the profiling options (trainer.profile_step, actor.profile, actor.profiler)."""

from __future__ import annotations

from trinity.config.schema import JobConfig


def check_profile(cfg: JobConfig, problems: list[str]) -> None:
    t = cfg.trainer
    if t.profile_step is not None and t.total_steps is not None and t.profile_step > t.total_steps:
        problems.append(
            f"trainer.profile_step: step {t.profile_step} comes after the last step (trainer.total_steps = "
            f"{t.total_steps}); pick a step from 2 to {t.total_steps}, or unset it"
        )
    world = cfg.cluster.world_size
    old, new = cfg.actor_rollout_ref.actor.profile, cfg.actor_rollout_ref.actor.profiler
    p = "actor_rollout_ref.actor.profile"
    if old.use_profile:
        if new.enable:
            problems.append(f"{p}.use_profile: cannot be combined with actor_rollout_ref.actor.profiler.enable; use one")
        if t.profile_step is not None:
            problems.append(
                f"{p}.use_profile: cannot be combined with trainer.profile_step (its short form); unset one of them"
            )
        if old.step_start < 0:
            problems.append(f"{p}.step_start: must be >= 0 with use_profile (steps count from 0, as in verl)")
        if old.step_end <= old.step_start:
            problems.append(
                f"{p}.step_end: must be greater than step_start ({old.step_start}); the range "
                "[step_start, step_end) is profiled"
            )
        elif t.total_steps is not None and old.step_end > t.total_steps:
            problems.append(
                f"{p}.step_end: {old.step_end} is past the last step (trainer.total_steps = {t.total_steps}, "
                f"steps 0 to {t.total_steps - 1} counted from 0); lower it"
            )
        for r in old.profile_ranks or []:
            if not 0 <= r < world:
                problems.append(f"{p}.profile_ranks: rank {r} does not exist (world size {world}); list ranks 0 to {world - 1}")
    q = "actor_rollout_ref.actor.profiler"
    if new.tool not in (None, "torch"):
        problems.append(
            f"{q}.tool: {new.tool!r} is not available; only torch (torch.profiler) is, or leave it unset"
        )
    if new.enable:
        if t.profile_step is None:
            problems.append(
                f"{q}.enable: needs trainer.profile_step, the step to profile (verl's global_profiler.steps); set it"
            )
        if not new.all_ranks and not new.ranks:
            problems.append(f"{q}.ranks: empty and all_ranks is false, so no rank would profile; list ranks or set all_ranks: true")
        for r in new.ranks:
            if not 0 <= r < world:
                problems.append(f"{q}.ranks: rank {r} does not exist (world size {world}); list ranks 0 to {world - 1}")
