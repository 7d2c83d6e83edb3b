"""Rules on the roles of a job: which exist for the algorithm (a block for a role the job does not have
is refused), their backend, what they must share (one parallel layout), and the offload flags a
single-phase step cannot use.
"""

from __future__ import annotations

from trinity.algorithms.registry import ALGORITHMS
from trinity.config.rules.fields import non_default
from trinity.config.schema import JobConfig
from trinity.distributed.layout import differing_sizes


def check_roles_exist(cfg: JobConfig, problems: list[str]) -> None:
    algo = cfg.spec.name
    if cfg.needs_critic and cfg.critic is None:
        problems.append(f"critic: {algo} needs a critic; add a `critic:` block (its megatron: and optim:)")
    if not cfg.needs_critic and cfg.critic is not None:
        users = " and ".join(s.name for s in ALGORITHMS.values() if s.critic)
        problems.append(
            f"critic: only {users} uses a critic, but algorithm.name is {algo}; remove the critic block"
        )
    check_ref_block(cfg, problems)


def check_ref_block(cfg: JobConfig, problems: list[str]) -> None:
    """A ref block in a job without a ref role would be accepted and never read (a TP size at odds with
    the actor's included): each key it sets is refused with the reason. Keys at their defaults pass: a
    resolved config spells every key out."""
    if cfg.needs_ref:
        return
    ref = cfg.actor_rollout_ref.ref
    keys = [f"megatron.{k}" for k in non_default(ref.megatron, None)]
    keys += [k for k in non_default(ref, None) if k != "megatron"]
    for key in keys:
        problems.append(
            f"actor_rollout_ref.ref.{key}: the ref role does not exist in this job ({_no_ref_reason(cfg)}); "
            "remove the key"
        )


def _no_ref_reason(cfg: JobConfig) -> str:
    if not cfg.is_rl:
        return f"{cfg.spec.name} has no reference model"
    return ("no KL is used: actor_rollout_ref.actor.use_kl_loss and algorithm.use_kl_in_reward are false, "
            "set one to use a ref")


def check_strategy(cfg: JobConfig, problems: list[str]) -> None:
    """Trinity-RFT / verl name the backend per role; `megatron` is the only one here."""
    arr = cfg.actor_rollout_ref
    blocks = {"actor_rollout_ref.actor": arr.actor, "actor_rollout_ref.ref": arr.ref}
    if cfg.critic is not None:
        blocks["critic"] = cfg.critic
    for path, block in blocks.items():
        if block.strategy is not None and block.strategy != "megatron":
            problems.append(
                f"{path}.strategy: {block.strategy!r} is not available: this toolkit trains with megatron-core "
                "only; set it to megatron or remove the key"
            )


# Why param_offload / grad_offload cannot lower the peak of a single-phase (sft, pt) step.
SFT_OFFLOAD_REFUSALS = {
    "param_offload": "every parameter is read by the forward and the backward pass of every micro batch and no "
                     "other phase runs between steps, so offloaded parameters would have to come straight back",
    "grad_offload": "the fp32 gradient buffer is written by every backward pass and accumulates over the micro "
                    "batches until the optimizer step, so it is needed on the GPU for the whole step "
                    "(optimizer_offload already copies the gradients to the host for the step)",
}


def check_sft_offload(cfg: JobConfig, problems: list[str]) -> None:
    """The SFT / pt recipes have one phase: `optimizer_offload` keeps the optimizer in host memory and
    steps it there (trinity.trainer.engine.host_optimizer); the parameters and gradients are needed on
    the GPU during the whole step, so their flags are refused with the reason rather than ignored."""
    if cfg.is_rl:
        return
    actor = cfg.actor_rollout_ref.actor.megatron
    algo = cfg.spec.name
    for flag, why in SFT_OFFLOAD_REFUSALS.items():
        if getattr(actor, flag):
            problems.append(
                f"actor_rollout_ref.actor.megatron.{flag}: cannot lower the GPU memory of a {algo} step ({why}); "
                "set it to false and lower memory with optimizer_offload, recompute, TP or PP (docs/parallelism.md)"
            )
    if actor.optimizer_offload and cfg.model.dtype == "fp16":
        problems.append(
            f"actor_rollout_ref.actor.megatron.optimizer_offload: not available with model.dtype fp16 in {algo} jobs "
            "(the host optimizer step has no loss scaling); use model.dtype bf16 (or auto)"
        )


def check_rl_roles(cfg: JobConfig, problems: list[str]) -> None:
    """What the RL loop cannot do yet: roles of different layouts (which would need resharding weights
    between them; dpo's ref too: all roles share one parallel state). The rollout itself serves every
    layout the actor trains with (sequence parallel, virtual pipeline stages: trinity.distributed.layout)."""
    roles = cfg.roles()
    actor = roles.pop("actor_rollout_ref.actor")
    for path, m in roles.items():
        for field, value, actor_value in differing_sizes(m.layout(), actor.layout()):
            problems.append(
                f"{path}.megatron.{field}: {value} differs from the actor's {actor_value}; "
                "roles share the GPUs with one layout (resharding between roles is out of scope)"
            )
        if m.sequence_parallel != actor.sequence_parallel:
            problems.append(f"{path}.megatron.sequence_parallel: must equal the actor's ({actor.sequence_parallel})")
    if cfg.critic is not None and cfg.critic.megatron.use_mbridge:
        problems.append("critic.megatron.use_mbridge: the critic's value head cannot load through mbridge; set it to false")
