"""Cross-field rules of a job config, checked before any process starts (`check_job`).

Every rule appends `path.to.key: what is wrong; how to fix it` to one list so that the user sees
all problems at once. Rules that megatron-core would otherwise hit minutes into start-up (layout,
heads, layers, experts, recompute) are mirrored here from its asserts. One module per concern:
`roles`, `megatron` (a role's parallel layout and model options), `batches` (sizes and lengths),
`algorithms` (what the algorithm's spec owns and adds, LoRA, reward), `data`, `profile`, `schedule`
(warm-ups), `evaluation`, `workflow`; `check_job` runs them in order. What depends on the algorithm is asked of its
spec (`cfg.spec`, trinity.algorithms.registry).
"""

from __future__ import annotations

from trinity.config.rules.algorithms import DPO_REFUSED, check_algorithm, check_lora, check_lora_ref, check_reward
from trinity.config.rules.batches import GROUP_ALGORITHMS, check_batches, check_kv_budget, check_sequence_length
from trinity.config.rules.data import check_data, check_vocabulary
from trinity.config.rules.evaluation import check_evaluation
from trinity.config.rules.megatron import check_megatron, transformer_config_fields
from trinity.config.rules.partial import check_partial
from trinity.config.rules.profile import check_profile
from trinity.config.rules.roles import (
    SFT_OFFLOAD_REFUSALS,
    check_rl_roles,
    check_roles_exist,
    check_sft_offload,
    check_strategy,
)
from trinity.config.rules.schedule import check_warmups
from trinity.config.rules.workflow import check_workflow
from trinity.config.schema import JobConfig
from trinity.errors import UserError
from trinity.models.facts import ModelFacts, refuse_custom_code
from trinity.models.hub import resolve_model_path

# What other code may import from here: check_job, and the tables the rules decide with.
__all__ = ["DPO_REFUSED", "GROUP_ALGORITHMS", "SFT_OFFLOAD_REFUSALS", "check_job", "transformer_config_fields"]


def check_job(cfg: JobConfig, *, check_paths: bool = True) -> tuple[ModelFacts | None, list[str], list[str]]:
    """Return (model facts, problems, warnings). May disable sequence_parallel at TP=1 (with a warning)."""
    problems: list[str] = []
    warnings: list[str] = []
    facts: ModelFacts | None = None
    try:
        # A hub id becomes its local snapshot folder here, the one place validate and run both pass.
        cfg.model.path = resolve_model_path(cfg.model.path)
        facts = ModelFacts.from_hf_dir(cfg.model.path)
    except UserError as exc:
        problems.append(f"model.path: {exc}")
    if cfg.model.tokenizer_path:
        try:
            cfg.model.tokenizer_path = resolve_model_path(cfg.model.tokenizer_path)
            refuse_custom_code(cfg.model.tokenizer_path)
        except UserError as exc:
            problems.append(f"model.tokenizer_path: {exc}")

    check_roles_exist(cfg, problems)
    check_strategy(cfg, problems)
    for path, megatron in cfg.roles().items():
        check_megatron(f"{path}.megatron", megatron, cfg, facts, problems, warnings, check_paths)
    check_rl_roles(cfg, problems)
    check_sft_offload(cfg, problems)
    check_batches(cfg, problems)
    check_data(cfg, problems, check_paths)
    if facts is not None:
        check_sequence_length(cfg, facts, problems)
        if check_paths:
            check_vocabulary(cfg, facts, problems)
    if cfg.is_rl:
        if cfg.workflow is None:  # a workflow scores its own episodes (check_workflow)
            check_reward(cfg, problems, check_paths)
        if facts is not None:
            check_kv_budget(cfg, facts, problems)
    check_algorithm(cfg, problems)
    check_partial(cfg, problems)
    check_lora(cfg, facts, problems, check_paths)
    check_lora_ref(cfg, problems)
    check_profile(cfg, problems)
    check_warmups(cfg, problems, warnings)
    check_evaluation(cfg, problems, check_paths)
    check_workflow(cfg, problems, check_paths)
    return facts, problems, warnings
