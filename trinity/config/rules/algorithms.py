"""Rules on options that belong to one algorithm or training method (DAPO, DPO, LoRA, the RL reward):
refused where they would be accepted and ignored, checked where they apply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trinity.algorithms.registry import ALGORITHMS, load
from trinity.config.rules.fields import non_default
from trinity.config.schema import JobConfig
from trinity.errors import UserError
from trinity.models.facts import ModelFacts


def check_algorithm(cfg: JobConfig, problems: list[str]) -> None:
    """What depends on the algorithm (its AlgorithmSpec): the keys another algorithm owns and those this one
    ignores are refused, a policy loss only where one applies, then the algorithm's own rules."""
    spec = cfg.spec
    name = spec.name
    loss_mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if not spec.rollout and loss_mode != "vanilla":
        problems.append(
            f"actor_rollout_ref.actor.policy_loss.loss_mode: a policy loss applies to RL algorithms, not {name}; "
            "remove the key"
        )
    elif spec.policy_loss is not None and loss_mode != "vanilla":
        problems.append(
            f"actor_rollout_ref.actor.policy_loss.loss_mode: {name} has its own policy loss ({spec.title}), which "
            f"{loss_mode} would replace; remove the key, or use grpo with loss_mode {loss_mode}"
        )
    for other in ALGORITHMS.values():
        for owned in other.owns if other is not spec else ():
            block, field = _parent(cfg, owned.key)
            if non_default(block, [field]):
                problems.append(f"{owned.key}: {owned.why}, not {name}; set algorithm.name: {other.name} or remove "
                                f"the {owned.unit}")
    for ignored in spec.ignores:
        block, field = _parent(cfg, ignored.key)
        if non_default(block, [field]):
            problems.append(f"{ignored.key}: {getattr(block, field)} has no effect with {name} ({ignored.why}); "
                            "remove the key")
    for rule in spec.rules:
        load(rule)(cfg, problems)


def _parent(cfg: JobConfig, key: str) -> tuple[Any, str]:
    """The config block holding dotted `key`, and the key's last part."""
    *parts, field = key.split(".")
    block: Any = cfg
    for part in parts:
        block = getattr(block, part)
    return block, field


def check_dapo_overlong(cfg: JobConfig, problems: list[str]) -> None:
    """dapo: the overlong buffer must fit inside the response length."""
    ob = cfg.reward_model.overlong_buffer
    limit = cfg.actor_rollout_ref.rollout.response_length
    if ob.enable and not 0 < ob.len < limit:
        problems.append(
            f"reward_model.overlong_buffer.len: {ob.len} must be between 1 and actor_rollout_ref.rollout."
            f"response_length - 1 ({limit - 1}): the penalty starts response_length - len tokens in"
        )


# What only a rollout or an RL loss uses: set in a dpo job, it would be accepted and change nothing.
DPO_REFUSED = {
    "algorithm": ("gamma", "lam", "norm_adv_by_std_in_grpo", "use_kl_in_reward", "kl_penalty", "kl_coef", "filter_groups"),
    "data": ("answer_key", "response_key", "max_prompt_length", "train_batch_size", "train_weights", "text_key"),
    "actor_rollout_ref.actor": ("ppo_mini_batch_size", "ppo_epochs", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c",
                                "use_kl_loss", "kl_loss_coef", "kl_loss_type", "entropy_coeff", "loss_agg_mode",
                                "use_dynamic_bsz", "ppo_max_token_len_per_gpu", "recompute_old_log_prob"),
    "actor_rollout_ref.ref": ("log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu"),
    "actor_rollout_ref.rollout": None,  # every field
    "reward": None,
    "reward_model": None,
}


def check_dpo_job(cfg: JobConfig, problems: list[str]) -> None:
    """A dpo job refuses the rollout / reward / RL-loss options, and checks its own."""
    for path, fields in DPO_REFUSED.items():
        block: Any = cfg
        for part in path.split("."):
            block = getattr(block, part)
        for field in non_default(block, fields):
            problems.append(
                f"{path}.{field}: not used by dpo (it trains on fixed chosen/rejected pairs: no rollout, reward, "
                "RL loss or packing); remove the key (docs/rl.md, DPO)"
            )
    d = cfg.algorithm.dpo
    if d.loss_type.value == "ipo" and d.label_smoothing:
        problems.append(
            f"algorithm.dpo.label_smoothing: {d.label_smoothing} has no effect with loss_type ipo; remove it, or use "
            "sigmoid (conservative DPO) or robust"
        )
    if cfg.data.packing:  # false is dpo's default (its AlgorithmSpec.defaults)
        problems.append(
            "data.packing: dpo runs each sequence of a pair in its own row (its log-prob is a per-row sum); "
            "remove the key or set it to false"
        )


def check_lora(cfg: JobConfig, facts: ModelFacts | None, problems: list[str], check_paths: bool = True) -> None:
    """actor.lora: target names known, settings only with rank >= 1, and only where adapters can act."""
    lora = cfg.actor_rollout_ref.actor.lora
    p = "actor_rollout_ref.actor.lora"
    if lora.rank == 0:
        for field in non_default(lora, ["alpha", "dropout", "target_modules", "rollout_weights", "adapter_path"]):
            problems.append(f"{p}.{field}: has no effect while {p}.rank is 0 (LoRA off); set rank >= 1 or remove the key")
        return
    if not cfg.is_rl and non_default(lora, ["rollout_weights"]):
        problems.append(f"{p}.rollout_weights: {cfg.spec.name} jobs have no rollout, so it has no effect; "
                        "remove the key")
    if lora.adapter_path is not None and check_paths:
        check_adapter_path(lora, problems)
    from trinity.models.lora_targets import resolve_targets

    try:
        targets = resolve_targets(lora.target_modules)
    except ValueError as exc:
        problems.append(f"{p}.target_modules: {exc}")
        return
    if not targets:
        problems.append(f"{p}.target_modules: is empty; name at least one linear (e.g. all-linear)")
    from trinity.models.lora_targets import HF_TO_MCORE, MLA_TARGETS

    named = {HF_TO_MCORE.get(n, n) for n in lora.target_modules}  # all-linear: whatever the model has
    if facts is not None and facts.mla is not None:
        if "linear_qkv" in named:
            problems.append(
                f"{p}.target_modules: linear_qkv (q_proj, k_proj, v_proj) does not exist in {facts.architecture}'s "
                "multi-latent attention; target its latent projections (q_a_proj, q_b_proj, kv_a_proj_with_mqa, "
                "kv_b_proj) and linear_proj (o_proj)"
            )
        if facts.mla.q_lora_rank is None and named & {"linear_q_down_proj", "linear_q_up_proj"}:
            problems.append(f"{p}.target_modules: q_a_proj / q_b_proj do not exist in this model (q_lora_rank is null)")
    elif named & set(MLA_TARGETS):
        problems.append(f"{p}.target_modules: {', '.join(sorted(named & set(MLA_TARGETS)))} exist only in "
                        "multi-latent attention (DeepSeek-V2/V3)")
    mlp = sorted(set(targets) & {"linear_fc1", "linear_fc2"})
    if facts is not None and facts.is_moe and mlp:
        problems.append(
            f"{p}.target_modules: {', '.join(mlp)} of an MoE model are its experts, which LoRA does not adapt; "
            "target linear_qkv and linear_proj only"
        )


def check_adapter_path(lora: Any, problems: list[str]) -> None:
    """actor.lora.adapter_path: a PEFT folder of plain LoRA adapters whose r, lora_alpha and target modules
    are the job's (the adapters are loaded into the job's own, which have the job's shapes)."""
    from trinity.models.lora_targets import (
        PEFT_CONFIG_FILE, adapter_config_targets, check_shared_a, read_adapter_config, resolve_targets,
    )

    p = "actor_rollout_ref.actor.lora"
    folder = Path(lora.adapter_path)
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.is_file() else "does not exist"
        problems.append(f"{p}.adapter_path: {folder} {what}; point it at a PEFT adapter folder "
                        "(adapter_config.json + adapter_model.safetensors)")
        return
    where = folder / PEFT_CONFIG_FILE
    try:
        config = read_adapter_config(folder)
        theirs = adapter_config_targets(config, where)
        check_shared_a(folder)
    except UserError as exc:
        problems.append(f"{p}.adapter_path: {exc}")
        return
    r, alpha = config.get("r"), config.get("lora_alpha")
    if r != lora.rank:
        problems.append(f"{p}.rank: {lora.rank} but {where} has r {r}; set {p}.rank to {r} to start from its adapters")
    if alpha is None or float(alpha) != float(lora.alpha):
        problems.append(f"{p}.alpha: {lora.alpha:g} but {where} has lora_alpha {alpha}; set {p}.alpha to {alpha} "
                        "to start from its adapters")
    try:
        ours = resolve_targets(lora.target_modules)
    except ValueError:
        return  # _check_lora names the unknown target
    if ours != theirs:
        problems.append(f"{p}.target_modules: adapts {', '.join(ours) or 'nothing'} but {where} adapts "
                        f"{', '.join(theirs) or 'nothing'}; set {p}.target_modules to {theirs}")


def check_lora_ref(cfg: JobConfig, problems: list[str]) -> None:
    """With LoRA the reference policy (RL with KL, DPO) is the actor with its adapters off
    (trinity.trainer.recipes.lora_ref): no ref model is built, so its megatron block cannot apply."""
    if cfg.actor_rollout_ref.actor.lora.rank == 0 or not cfg.needs_ref:
        return  # without a ref role at all, check_ref_block says so
    ref = cfg.actor_rollout_ref.ref.megatron
    for name in non_default(ref, None):
        problems.append(
            f"actor_rollout_ref.ref.megatron.{name}: with actor_rollout_ref.actor.lora the reference policy is "
            "the actor with its adapters off (no ref model is built), so the ref block cannot apply; remove the key"
        )


def check_reward(cfg: JobConfig, problems: list[str], check_paths: bool) -> None:
    from trinity.rewards.loader import BUILTIN_REWARDS, reward_problems

    r = cfg.reward
    if not check_paths and r.function not in BUILTIN_REWARDS:
        return  # a user function's file is looked up on this machine: a path check
    problems += reward_problems(r.function, r.format_pattern, r.extractor, r.marker)
