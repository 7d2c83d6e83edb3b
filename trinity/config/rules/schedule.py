"""Rules of the warm-ups against the length of the run (trainer.total_steps): a critic warm-up that covers
every step would leave the actor untrained (refused); an lr warm-up as long as the run is cut short by the
schedule (stated)."""

from __future__ import annotations

from trinity.config.roles import Role
from trinity.config.schema import JobConfig


def check_warmups(cfg: JobConfig, problems: list[str], warnings: list[str]) -> None:
    total = cfg.trainer.total_steps
    if total is None:  # the length follows from the data (epochs): the plan reads it, validation does not
        return
    critic = cfg.critic
    if critic is not None and critic.warmup_steps >= total:
        problems.append(
            f"critic.warmup_steps: {critic.warmup_steps} warm-up steps cover all {total} steps of the run "
            f"(trainer.total_steps), so the actor would never train; set it below {total} or raise trainer.total_steps"
        )
    optims = {Role.actor.config_path: cfg.actor_rollout_ref.actor.optim}
    if critic is not None:
        optims[Role.critic.config_path] = critic.optim
    for path, optim in optims.items():
        if optim.lr_warmup_steps >= total:
            cut = optim.warmup_within(total)
            warnings.append(
                f"{path}.optim.lr_warmup_steps: {optim.lr_warmup_steps} warm-up steps are not fewer than the "
                f"{total} steps of the run (trainer.total_steps); the schedule cuts the warm-up to total_steps - 1 = {cut}, so "
                f"the lr peaks at step {max(cut, 1)}"
            )
