"""Cross-field rules of a job config, checked before any process starts.

Every rule appends `path.to.key: what is wrong; how to fix it` to one list so that the user sees
all problems at once. Rules that megatron-core would otherwise hit minutes into start-up (layout,
heads, layers, experts, recompute) are mirrored here from its asserts.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

from trinity.config.megatron import MegatronConfig, RecomputeGranularity, RecomputeMethod, RecomputeModule
from trinity.config.evaluation import check_evaluation
from trinity.config.schema import AlgorithmName, JobConfig
from trinity.errors import UserError
from trinity.models.facts import ModelFacts
from trinity.models.hub import resolve_model_path

OFFLOAD_FLAGS = ("param_offload", "grad_offload", "optimizer_offload")


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
        except UserError as exc:
            problems.append(f"model.tokenizer_path: {exc}")

    _check_roles_exist(cfg, problems)
    for path, megatron in cfg.roles().items():
        _check_megatron(f"{path}.megatron", megatron, cfg, facts, problems, warnings, check_paths)
    _check_rl_roles(cfg, problems)
    _check_batches(cfg, problems)
    _check_data(cfg, problems, check_paths)
    _check_profile(cfg, problems)
    check_evaluation(cfg, problems, check_paths)
    return facts, problems, warnings


def _check_roles_exist(cfg: JobConfig, problems: list[str]) -> None:
    algo = cfg.algorithm.name
    if algo == AlgorithmName.ppo and cfg.critic is None:
        problems.append("critic: ppo needs a critic; add a `critic:` block (its megatron: and optim:)")
    if algo != AlgorithmName.ppo and cfg.critic is not None:
        problems.append(
            f"critic: only ppo uses a critic, but algorithm.name is {algo.value}; remove the critic block"
        )
    if not cfg.needs_ref:
        ref = cfg.actor_rollout_ref.ref.megatron
        why = (
            "sft has no reference model"
            if algo == AlgorithmName.sft
            else "no KL is used (actor.use_kl_loss and algorithm.use_kl_in_reward are false)"
        )
        for flag in OFFLOAD_FLAGS:
            if getattr(ref, flag):
                problems.append(
                    f"actor_rollout_ref.ref.megatron.{flag}: the ref role does not exist in this job ({why}); "
                    "remove the flag"
                )


LAYOUT_FIELDS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
)


def _check_rl_roles(cfg: JobConfig, problems: list[str]) -> None:
    """What the RL loop cannot do yet: rollout over virtual pipeline stages or with sequence parallel,
    and roles of different layouts (which would need resharding weights between them)."""
    if not cfg.is_rl:
        return
    roles = cfg.roles()
    actor = roles.pop("actor_rollout_ref.actor")
    a = "actor_rollout_ref.actor.megatron"
    if actor.pipeline_model_parallel_size > 1 and (actor.virtual_pipeline_model_parallel_size or 1) > 1:
        problems.append(
            f"{a}.virtual_pipeline_model_parallel_size: rollout runs one model chunk per pipeline stage; "
            "unset it (plain PP is supported)"
        )
    if actor.sequence_parallel:
        problems.append(f"{a}.sequence_parallel: rollout with sequence parallel is not supported yet; set it to false")
    for path, m in roles.items():
        for name in LAYOUT_FIELDS:
            if getattr(m, name) != getattr(actor, name):
                problems.append(
                    f"{path}.megatron.{name}: {getattr(m, name)} differs from the actor's {getattr(actor, name)}; "
                    "roles share the GPUs with one layout (resharding between roles is out of scope)"
                )
        if m.sequence_parallel != actor.sequence_parallel:
            problems.append(f"{path}.megatron.sequence_parallel: must equal the actor's ({actor.sequence_parallel})")
    if cfg.critic is not None and cfg.critic.megatron.use_mbridge:
        problems.append("critic.megatron.use_mbridge: the critic's value head cannot load through mbridge; set it to false")


def _check_megatron(
    p: str,
    m: MegatronConfig,
    cfg: JobConfig,
    facts: ModelFacts | None,
    problems: list[str],
    warnings: list[str],
    check_paths: bool,
) -> None:
    world = cfg.cluster.world_size
    lay = m.layout()
    world_desc = f"world size {world} (cluster.nnodes {cfg.cluster.nnodes} x cluster.nproc_per_node {cfg.cluster.nproc_per_node})"
    if world % lay.model_parallel_size:
        problems.append(
            f"{p}.tensor_model_parallel_size: {world_desc} is not divisible by TP x PP x CP = "
            f"{lay.tp} x {lay.pp} x {lay.cp} = {lay.model_parallel_size}; pick sizes whose product divides {world}"
        )
    elif (world // lay.pp) % (lay.ep * lay.expert_tp):
        problems.append(
            f"{p}.expert_model_parallel_size: EP x ETP = {lay.ep} x {lay.expert_tp} must divide world/PP = "
            f"{world // lay.pp}; lower expert_model_parallel_size or expert_tensor_parallel_size"
        )
    if lay.vpp is not None and lay.pp == 1:
        problems.append(
            f"{p}.virtual_pipeline_model_parallel_size: needs pipeline_model_parallel_size > 1; unset it or raise PP"
        )
    if m.sequence_parallel and lay.tp == 1:
        m.sequence_parallel = False
        warnings.append(f"{p}.sequence_parallel: has no effect with TP=1; disabled (as megatron-core does)")
    if lay.cp > 1:
        if cfg.cluster.device == "cpu":
            problems.append(f"{p}.context_parallel_size: context parallelism needs GPUs; set it to 1 on cpu")
        elif importlib.util.find_spec("transformer_engine") is None:
            problems.append(
                f"{p}.context_parallel_size: context parallelism needs TransformerEngine, which is not "
                "installed; set it to 1 or use the Docker image (scripts/docker_for_megatron)"
            )
        # Neither training loop gives each CP rank its share of the sequence (megatron's
        # get_batch_on_this_cp_rank); trinity.trainer.sft keeps a runtime guard.
        problems.append(
            f"{p}.context_parallel_size: the SFT and RL loops do not split sequences across CP ranks yet; set it to 1"
        )
    if m.use_mbridge and m.use_dist_checkpointing:
        problems.append(f"{p}.use_mbridge: cannot be combined with use_dist_checkpointing; choose one weight source")
    if m.use_dist_checkpointing:
        ckpt = m.dist_checkpointing_path
        if not ckpt:
            problems.append(
                f"{p}.dist_checkpointing_path: required with use_dist_checkpointing; "
                "point it at the output of `trinity convert hf-to-mcore`"
            )
        elif check_paths and not Path(ckpt).is_dir():
            problems.append(f"{p}.dist_checkpointing_path: {ckpt} does not exist; run `trinity convert hf-to-mcore` first")
    if facts is not None:
        _check_against_model(p, m, facts, problems, warnings)
    _check_recompute(p, m, facts, problems)
    _check_transformer_overrides(p, m, problems)
    seq = cfg.data.seq_length if not cfg.is_rl else cfg.data.max_prompt_length + cfg.actor_rollout_ref.rollout.response_length
    key = "data.seq_length" if not cfg.is_rl else "data.max_prompt_length"
    if lay.cp > 1 and seq % (2 * lay.cp):
        problems.append(f"{key}: sequence length {seq} must be divisible by 2 x CP = {2 * lay.cp} ({p}.context_parallel_size)")


def _check_against_model(p: str, m: MegatronConfig, f: ModelFacts, problems: list[str], warnings: list[str]) -> None:
    lay = m.layout()
    if f.num_attention_heads % lay.tp:
        problems.append(
            f"{p}.tensor_model_parallel_size: {f.num_attention_heads} attention heads are not divisible by TP={lay.tp}"
        )
    if f.num_query_groups % lay.tp:
        problems.append(
            f"{p}.tensor_model_parallel_size: {f.num_query_groups} key/value heads are not divisible by TP={lay.tp}; "
            f"use a TP that divides {f.num_query_groups}"
        )
    stages = lay.pp * (lay.vpp or 1)
    if f.num_layers % stages:
        what = f"PP x VPP = {lay.pp} x {lay.vpp}" if lay.vpp else f"PP={lay.pp}"
        problems.append(f"{p}.pipeline_model_parallel_size: {f.num_layers} layers are not divisible by {what}")
    if m.use_mbridge and f.is_moe:
        problems.append(
            f"{p}.use_mbridge: mbridge cannot load the MoE {f.architecture} (it maps experts only onto "
            "TransformerEngine grouped experts); set it to false to convert with the builtin converter"
        )
    if lay.ep > 1 and not f.is_moe:
        problems.append(f"{p}.expert_model_parallel_size: EP={lay.ep} needs an MoE model, but {f.architecture} is dense; set it to 1")
    if f.is_moe and f.num_experts % lay.ep:
        problems.append(f"{p}.expert_model_parallel_size: {f.num_experts} experts are not divisible by EP={lay.ep}")
    if f.is_moe and lay.ep > 1 and lay.tp > 1 and not m.sequence_parallel:
        problems.append(f"{p}.sequence_parallel: megatron-core needs sequence_parallel with both TP>1 and EP>1; set it to true")
    if f.is_moe and m.moe_grouped_gemm and not any(
        importlib.util.find_spec(mod) for mod in ("grouped_gemm", "transformer_engine")
    ):
        problems.append(
            f"{p}.moe_grouped_gemm: needs the grouped_gemm package or TransformerEngine, neither is installed; "
            "set it to false or use the Docker image (scripts/docker_for_megatron)"
        )
    if not f.is_moe and (m.moe_grouped_gemm or m.moe_layer_recompute):
        warnings.append(f"{p}: moe_grouped_gemm/moe_layer_recompute have no effect on the dense {f.architecture}")


def _check_recompute(p: str, m: MegatronConfig, f: ModelFacts | None, problems: list[str]) -> None:
    o = m.override_transformer_config
    q = f"{p}.override_transformer_config"
    full = o.recompute_granularity == RecomputeGranularity.full
    if not full:
        for name in ("recompute_method", "recompute_num_layers"):
            if getattr(o, name) is not None:
                problems.append(f"{q}.{name}: only applies with recompute_granularity: full; remove it or set granularity full")
    else:
        if o.recompute_method is None:
            problems.append(f"{q}.recompute_method: required with recompute_granularity: full; use uniform or block")
        if o.recompute_num_layers is None:
            problems.append(f"{q}.recompute_num_layers: required with recompute_granularity: full (e.g. 1)")
        elif f is not None:
            lay = m.layout()
            limit = lay.layers_per_stage(f.num_layers) if o.recompute_method == RecomputeMethod.block else lay.layers_per_chunk(f.num_layers)
            if limit and o.recompute_num_layers > limit:
                problems.append(f"{q}.recompute_num_layers: {o.recompute_num_layers} is more than the {limit} layers per pipeline stage")
    if o.recompute_modules is not None:
        if o.recompute_granularity != RecomputeGranularity.selective:
            problems.append(f"{q}.recompute_modules: only applies with recompute_granularity: selective")
        mods = set(o.recompute_modules)
        if RecomputeModule.mla_up_proj in mods:
            problems.append(f"{q}.recompute_modules: mla_up_proj needs multi-latent attention, which no supported model uses")
        if f is not None and not f.is_moe and mods & {RecomputeModule.moe, RecomputeModule.moe_act, RecomputeModule.shared_experts}:
            problems.append(f"{q}.recompute_modules: moe/moe_act/shared_experts need an MoE model")
        if RecomputeModule.moe_act in mods and not m.moe_grouped_gemm:
            problems.append(f"{q}.recompute_modules: moe_act needs moe_grouped_gemm: true")


@functools.lru_cache(maxsize=1)
def transformer_config_fields() -> frozenset[str] | None:
    """Field names of megatron-core's TransformerConfig, read from its source without importing it."""
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    names: set[str] = set()
    for rel, cls in (("transformer/transformer_config.py", "TransformerConfig"), ("model_parallel_config.py", "ModelParallelConfig")):
        tree = ast.parse((root / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == cls:
                names.update(s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name))
    return frozenset(names) or None


def _check_transformer_overrides(p: str, m: MegatronConfig, problems: list[str]) -> None:
    import difflib

    extra = m.override_transformer_config.extra_fields()
    known = transformer_config_fields() if extra else None
    for name in extra if known else ():
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else "see megatron-core's TransformerConfig for the field names"
            problems.append(f"{p}.override_transformer_config.{name}: not a TransformerConfig field; {hint}")


def _check_batches(cfg: JobConfig, problems: list[str]) -> None:
    actor = cfg.actor_rollout_ref.actor
    lay = actor.megatron.layout()
    world = cfg.cluster.world_size
    if world % lay.model_parallel_size:
        return  # reported by the layout rule; DP is undefined
    dp = lay.dp(world)
    micro = cfg.trainer.micro_batch_size
    if not cfg.is_rl:
        if cfg.trainer.global_batch_size % (micro * dp):
            problems.append(
                f"trainer.global_batch_size: {cfg.trainer.global_batch_size} is not divisible by "
                f"trainer.micro_batch_size x DP = {micro} x {dp}; use a multiple of {micro * dp}"
            )
        return
    if cfg.data.train_batch_size % actor.ppo_mini_batch_size:
        problems.append(
            f"actor_rollout_ref.actor.ppo_mini_batch_size: {actor.ppo_mini_batch_size} must divide "
            f"data.train_batch_size {cfg.data.train_batch_size}"
        )
    seqs = actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n
    if seqs % (micro * dp):
        problems.append(
            f"actor_rollout_ref.actor.ppo_mini_batch_size: {actor.ppo_mini_batch_size} prompts x rollout.n "
            f"{cfg.actor_rollout_ref.rollout.n} = {seqs} sequences are not divisible by trainer.micro_batch_size x DP = {micro} x {dp}"
        )
    if cfg.algorithm.name == AlgorithmName.grpo and cfg.actor_rollout_ref.rollout.n < 2:
        problems.append("actor_rollout_ref.rollout.n: GRPO compares responses within a group; use n >= 2")


def _check_profile(cfg: JobConfig, problems: list[str]) -> None:
    t = cfg.trainer
    if t.profile_step is not None and t.total_steps is not None and t.profile_step > t.total_steps:
        problems.append(
            f"trainer.profile_step: step {t.profile_step} comes after the last step (trainer.total_steps = "
            f"{t.total_steps}); pick a step from 2 to {t.total_steps}, or unset it"
        )


def _check_data(cfg: JobConfig, problems: list[str], check_paths: bool) -> None:
    if not cfg.data.train_files:
        problems.append("data.train_files: no training files; list at least one .jsonl or .parquet file")
    for i, f in enumerate(cfg.data.train_files):
        if not f.endswith((".jsonl", ".json", ".parquet")):
            problems.append(f"data.train_files.{i}: {f} is neither .jsonl nor .parquet")
        elif check_paths and not Path(f).is_file():
            problems.append(f"data.train_files.{i}: {f} does not exist")
    tok = cfg.model.tokenizer_path
    if tok and check_paths and not Path(tok).is_dir():
        problems.append(f"model.tokenizer_path: {tok} does not exist")
    resume = cfg.trainer.resume
    if resume not in ("auto", "disable") and check_paths and not Path(resume).is_dir():
        problems.append(f"trainer.resume: {resume} is not a checkpoint folder; use auto, disable or an existing folder")
