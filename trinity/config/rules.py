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
from typing import Any

from trinity.config.megatron import MegatronConfig, RecomputeGranularity, RecomputeMethod, RecomputeModule
from trinity.config.evaluation import check_evaluation
from trinity.config.schema import AlgorithmName, JobConfig
from trinity.distributed.layout import differing_sizes, layout_problems, rollout_problems
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
    _check_strategy(cfg, problems)
    for path, megatron in cfg.roles().items():
        _check_megatron(f"{path}.megatron", megatron, cfg, facts, problems, warnings, check_paths)
    _check_rl_roles(cfg, problems)
    _check_sft_offload(cfg, problems)
    _check_batches(cfg, problems)
    _check_data(cfg, problems, check_paths)
    if facts is not None:
        _check_sequence_length(cfg, facts, problems)
    if cfg.is_rl:
        _check_reward(cfg, problems, check_paths)
        if facts is not None:
            _check_kv_budget(cfg, facts, problems)
    _check_dapo(cfg, problems)
    _check_dpo(cfg, problems)
    _check_lora(cfg, facts, problems, check_paths)
    _check_lora_ref(cfg, problems)
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
            f"{algo.value} has no reference model"
            if not cfg.is_rl
            else "no KL is used (actor.use_kl_loss and algorithm.use_kl_in_reward are false)"
        )
        for flag in OFFLOAD_FLAGS:
            if getattr(ref, flag):
                problems.append(
                    f"actor_rollout_ref.ref.megatron.{flag}: the ref role does not exist in this job ({why}); "
                    "remove the flag"
                )


def _check_strategy(cfg: JobConfig, problems: list[str]) -> None:
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


def _check_sft_offload(cfg: JobConfig, problems: list[str]) -> None:
    """The SFT / pt recipes have one phase: `optimizer_offload` keeps the optimizer in host memory and
    steps it there (trinity.trainer.engine.host_optimizer); the parameters and gradients are needed on
    the GPU during the whole step, so their flags are refused with the reason rather than ignored."""
    if cfg.is_rl:
        return
    actor = cfg.actor_rollout_ref.actor.megatron
    algo = cfg.algorithm.name.value
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


def _check_rl_roles(cfg: JobConfig, problems: list[str]) -> None:
    """What the RL loop cannot do yet: what `rollout_problems` names (nothing today: sequence parallel and
    virtual pipeline stages are served, trinity.distributed.sequence_parallel and trinity.rollout), and roles of different layouts (which would need resharding weights between them; dpo's ref too:
    all roles share one parallel state)."""
    roles = cfg.roles()
    actor = roles.pop("actor_rollout_ref.actor")
    a = "actor_rollout_ref.actor.megatron"
    if cfg.is_rl:
        for field, text in rollout_problems(actor.layout()):
            problems.append(f"{a}.{field}: {text}")
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
    # The layout's own rules (trinity.distributed.layout.layout_problems); the model's come in
    # _check_against_model, the rollout's in _check_rl_roles.
    for field, text in layout_problems(lay, world_size=world, world_desc=world_desc):
        problems.append(f"{p}.{field}: {text}")
    if m.sequence_parallel and lay.tp == 1:
        m.sequence_parallel = False
        warnings.append(f"{p}.sequence_parallel: has no effect with TP=1; disabled (as megatron-core does)")
    if lay.cp > 1:
        # Neither training loop gives each CP rank its share of the sequence (megatron's
        # get_batch_on_this_cp_rank), on any device and with or without TransformerEngine; one message
        # says so (validation is the only check: the recipes do not re-check it).
        problems.append(
            f"{p}.context_parallel_size: context parallelism is not supported: the SFT and RL loops do not "
            "split sequences across CP ranks; set it to 1 (use recompute or TP/PP for long sequences)"
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
        elif check_paths and not (Path(ckpt) / ".metadata").is_file():
            # Any megatron-core torch_dist checkpoint loads (trinity's or e.g. verl's converter's); all
            # of them have torch's index file. Keys and shapes are checked against the model at load.
            problems.append(
                f"{p}.dist_checkpointing_path: {ckpt} is not a megatron-core dist checkpoint (no .metadata in it); "
                "point it at the output of `trinity convert hf-to-mcore` (or of another megatron-core converter)"
            )
    if facts is not None:
        _check_against_model(p, m, facts, problems, warnings)
    _check_recompute(p, m, facts, problems)
    _check_transformer_overrides(p, m, problems)


def _check_against_model(p: str, m: MegatronConfig, f: ModelFacts, problems: list[str], warnings: list[str]) -> None:
    for field, text in layout_problems(m.layout(), f, sequence_parallel=m.sequence_parallel):
        problems.append(f"{p}.{field}: {text}")
    if f.is_moe and m.moe_grouped_gemm and not any(
        importlib.util.find_spec(mod) for mod in ("grouped_gemm", "transformer_engine")
    ):
        problems.append(
            f"{p}.moe_grouped_gemm: needs the grouped_gemm package or TransformerEngine, neither is installed; "
            "set it to false or use the Docker image (scripts/docker_for_megatron)"
        )
    if not f.is_moe:
        # Refused, not warned about: on a dense model these options would be accepted and ignored.
        # (moe_token_dispatcher_type has a default value, so the resolved config a worker re-validates
        # always carries it: it cannot be told apart from a user's setting and is not checked.)
        for key in (k for k in ("moe_grouped_gemm", "moe_layer_recompute") if getattr(m, k)):
            problems.append(f"{p}.{key}: has no effect on the dense {f.architecture} (it has no MoE layers); remove it")


def _check_recompute(p: str, m: MegatronConfig, f: ModelFacts | None, problems: list[str]) -> None:
    o = m.override_transformer_config
    q = f"{p}.override_transformer_config"
    full = o.recompute_granularity == RecomputeGranularity.full
    if m.moe_layer_recompute and full:
        # megatron-core turns moe_layer_recompute into selective recompute of the MoE layers and raises
        # on a full granularity (TransformerConfig.__post_init__).
        problems.append(
            f"{p}.moe_layer_recompute: megatron-core refuses it with override_transformer_config."
            "recompute_granularity: full, which already recomputes whole layers; remove one of the two"
        )
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
        elif lay.vpp and lay.pp > 1 and (cfg.trainer.global_batch_size // (micro * dp)) % lay.pp:
            # megatron's interleaved schedule runs micro batches in groups of PP and raises otherwise
            m, step = cfg.trainer.global_batch_size // (micro * dp), micro * dp * lay.pp
            problems.append(
                f"trainer.global_batch_size: with virtual pipeline stages each step's micro batches per DP rank "
                f"({m}) must be a multiple of PP = {lay.pp} (megatron's interleaved schedule); use a multiple of "
                f"trainer.micro_batch_size x DP x PP = {step}"
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
    name = cfg.algorithm.name
    if name in GROUP_ALGORITHMS and cfg.actor_rollout_ref.rollout.n < 2:
        problems.append(f"actor_rollout_ref.rollout.n: {GROUP_ALGORITHMS[name]} compares responses within a group; use n >= 2")
    ro = cfg.actor_rollout_ref.rollout
    if ro.gpu_memory_utilization is not None and ro.kv_cache_memory_gib is not None:
        problems.append("actor_rollout_ref.rollout.kv_cache_memory_gib: set either kv_cache_memory_gib or "
                        "gpu_memory_utilization (the rollout's KV-cache budget), not both")
    _check_token_budgets(cfg, problems)


def _check_kv_budget(cfg: JobConfig, facts: ModelFacts, problems: list[str]) -> None:
    """An explicit rollout KV budget must hold one whole sequence (the longest prompt + response_length,
    rounded up to 64 as the engine's cache is) of the largest pipeline stage, for one TP rank's heads;
    the engine checks the same when a rollout starts (with the memory free then, for
    gpu_memory_utilization)."""
    ro, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor.megatron
    if ro.kv_cache_memory_gib is None:
        return
    tp, pp = actor.tensor_model_parallel_size, actor.pipeline_model_parallel_size
    elem = 4 if cfg.model.dtype == "fp32" or (cfg.model.dtype == "auto" and cfg.cluster.device == "cpu") else 2
    cache_len = -(-(cfg.data.max_prompt_length + ro.response_length) // 64) * 64
    per_slot = (-(-facts.num_layers // pp)) * 2 * (-(-facts.num_query_groups // tp)) * facts.head_dim * elem * cache_len
    budget = ro.kv_cache_memory_gib * 2**30
    if budget < per_slot:
        problems.append(
            f"actor_rollout_ref.rollout.kv_cache_memory_gib: the KV cache budget ({budget / 2**30:.3g} GiB) holds no "
            f"sequence: one sequence of {cache_len} tokens (longest prompt + response_length) needs "
            f"{per_slot / 2**30:.3g} GiB; raise kv_cache_memory_gib or lower data.max_prompt_length / "
            "actor_rollout_ref.rollout.response_length")


def _check_token_budgets(cfg: JobConfig, problems: list[str]) -> None:
    """Packed (dynamic) micro batches never split a sequence: each budget must hold the longest one; a
    budget without packing would be ignored, so it is refused."""
    arr = cfg.actor_rollout_ref
    longest = cfg.data.max_prompt_length + arr.rollout.response_length
    budgets = [("actor_rollout_ref.actor", "use_dynamic_bsz", arr.actor.use_dynamic_bsz, "ppo_max_token_len_per_gpu",
                arr.actor.ppo_max_token_len_per_gpu),
               ("actor_rollout_ref.ref", "log_prob_use_dynamic_bsz", arr.ref.log_prob_use_dynamic_bsz,
                "log_prob_max_token_len_per_gpu", arr.ref.log_prob_max_token_len_per_gpu)]
    if cfg.critic is not None:
        budgets.append(("critic", "use_dynamic_bsz", cfg.critic.use_dynamic_bsz, "ppo_max_token_len_per_gpu",
                        cfg.critic.ppo_max_token_len_per_gpu))
    for path, switch, on, key, budget in budgets:
        if budget is None:
            continue
        if not on:
            problems.append(f"{path}.{key}: a token budget applies to packed micro batches only, and {path}.{switch} "
                            "is false; remove the key or set the switch to true")
        elif budget < longest:
            problems.append(
                f"{path}.{key}: {budget} tokens cannot hold the longest sequence (prompt + response length > budget): "
                f"data.max_prompt_length + actor_rollout_ref.rollout.response_length = {longest}; raise it to at "
                f"least {longest}")


# Algorithms whose baseline comes from the other responses to the same prompt (RLOO: the mean of the
# other n - 1 rewards), so a group of one has none.
GROUP_ALGORITHMS = {AlgorithmName.grpo: "GRPO", AlgorithmName.rloo: "RLOO", AlgorithmName.dapo: "DAPO"}


def _check_dapo(cfg: JobConfig, problems: list[str]) -> None:
    """DAPO's dynamic sampling and overlong shaping exist in the dapo recipe only, a policy loss in RL only:
    refused elsewhere rather than accepted and ignored."""
    name = cfg.algorithm.name
    fg, ob = cfg.algorithm.filter_groups, cfg.reward_model.overlong_buffer
    if not cfg.is_rl and cfg.actor_rollout_ref.actor.policy_loss.loss_mode != "vanilla":
        problems.append(
            f"actor_rollout_ref.actor.policy_loss.loss_mode: a policy loss applies to RL algorithms, not {name.value}; "
            "remove the key"
        )
    if name != AlgorithmName.dapo:
        if fg.enable:
            problems.append(
                f"algorithm.filter_groups.enable: dynamic sampling is part of the dapo recipe, not {name.value}; "
                "set algorithm.name: dapo or remove the key"
            )
        if ob.enable:
            problems.append(
                f"reward_model.overlong_buffer.enable: overlong reward shaping is part of the dapo recipe, not "
                f"{name.value}; set algorithm.name: dapo or remove the key"
            )
        return
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


def _non_default(block: Any, fields: Any) -> list[str]:
    """Fields of `block` whose value differs from the schema default. (Not `model_fields_set`: the
    workers read the resolved config, which spells every field out.)"""
    out = []
    for name in fields if fields is not None else type(block).model_fields:
        info = type(block).model_fields[name]
        default = info.default_factory() if info.default_factory is not None else info.default
        if getattr(block, name) != default:
            out.append(name)
    return sorted(out)


def _check_dpo(cfg: JobConfig, problems: list[str]) -> None:
    """algorithm.dpo belongs to dpo; a dpo job refuses the rollout / reward / RL-loss options."""
    name = cfg.algorithm.name
    if name != AlgorithmName.dpo:
        if _non_default(cfg.algorithm, ["dpo"]):
            problems.append(
                f"algorithm.dpo: DPO settings apply to algorithm.name dpo, not {name.value}; set algorithm.name: dpo "
                "or remove the block"
            )
        return
    for path, fields in DPO_REFUSED.items():
        block: Any = cfg
        for part in path.split("."):
            block = getattr(block, part)
        for field in _non_default(block, fields):
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
    if cfg.data.packing:  # false is dpo's default (JobConfig._pt_concatenates)
        problems.append(
            "data.packing: dpo runs each sequence of a pair in its own row (its log-prob is a per-row sum); "
            "remove the key or set it to false"
        )


def _check_lora(cfg: JobConfig, facts: ModelFacts | None, problems: list[str], check_paths: bool = True) -> None:
    """actor.lora: target names known, settings only with rank >= 1, and only where adapters can act."""
    lora = cfg.actor_rollout_ref.actor.lora
    p = "actor_rollout_ref.actor.lora"
    if lora.rank == 0:
        for field in _non_default(lora, ["alpha", "dropout", "target_modules", "rollout_weights", "adapter_path"]):
            problems.append(f"{p}.{field}: has no effect while {p}.rank is 0 (LoRA off); set rank >= 1 or remove the key")
        return
    if not cfg.is_rl and _non_default(lora, ["rollout_weights"]):
        problems.append(f"{p}.rollout_weights: {cfg.algorithm.name.value} jobs have no rollout, so it has no effect; "
                        "remove the key")
    if lora.adapter_path is not None and check_paths:
        _check_adapter_path(lora, problems)
    from trinity.models.lora_targets import resolve_targets

    try:
        targets = resolve_targets(lora.target_modules)
    except ValueError as exc:
        problems.append(f"{p}.target_modules: {exc}")
        return
    if not targets:
        problems.append(f"{p}.target_modules: is empty; name at least one linear (e.g. all-linear)")
    mlp = sorted(set(targets) & {"linear_fc1", "linear_fc2"})
    if facts is not None and facts.is_moe and mlp:
        problems.append(
            f"{p}.target_modules: {', '.join(mlp)} of an MoE model are its experts, which LoRA does not adapt; "
            "target linear_qkv and linear_proj only"
        )


def _check_adapter_path(lora: Any, problems: list[str]) -> None:
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


def _check_lora_ref(cfg: JobConfig, problems: list[str]) -> None:
    """With LoRA the reference policy (RL with KL, DPO) is the actor with its adapters off
    (trinity.trainer.recipes.lora_ref): no ref model is built, so its megatron block cannot apply."""
    if cfg.actor_rollout_ref.actor.lora.rank == 0:
        return
    ref = cfg.actor_rollout_ref.ref.megatron
    for name in _non_default(ref, None):
        if name in OFFLOAD_FLAGS and not cfg.needs_ref:
            continue  # _check_roles_exist already says the ref does not exist
        problems.append(
            f"actor_rollout_ref.ref.megatron.{name}: with actor_rollout_ref.actor.lora the reference policy is "
            "the actor with its adapters off (no ref model is built), so the ref block cannot apply; remove the key"
        )


def _check_profile(cfg: JobConfig, problems: list[str]) -> None:
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


def _check_sequence_length(cfg: JobConfig, facts: ModelFacts, problems: list[str]) -> None:
    """Sequences longer than the model's context: RoPE positions it never saw in training (megatron-core
    accepts them silently and the model degrades), so refuse them with the numbers."""
    limit = facts.max_position_embeddings
    where = facts.source or "config.json"
    if not cfg.is_rl:
        if cfg.data.seq_length > limit:
            problems.append(
                f"data.seq_length: {cfg.data.seq_length} tokens is more than the model's max_position_embeddings "
                f"{limit} ({where}); use at most {limit}"
            )
        return
    prompt, response = cfg.data.max_prompt_length, cfg.actor_rollout_ref.rollout.response_length
    if prompt + response > limit:
        problems.append(
            f"data.max_prompt_length: {prompt} + actor_rollout_ref.rollout.response_length {response} = "
            f"{prompt + response} tokens is more than the model's max_position_embeddings {limit} ({where}); "
            f"lower either so that they sum to at most {limit}"
        )


def _check_reward(cfg: JobConfig, problems: list[str], check_paths: bool) -> None:
    from trinity.rollout.rewards import BUILTIN_REWARDS, reward_problems

    r = cfg.reward
    if not check_paths and r.function not in BUILTIN_REWARDS:
        return  # a user function's file is looked up on this machine: a path check
    problems += reward_problems(r.function, r.format_pattern, r.extractor, r.marker)


def _check_tokenizer_files(cfg: JobConfig, problems: list[str]) -> None:
    from trinity.data.loader import missing_tokenizer_files

    key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
    folder = cfg.model.tokenizer_path or cfg.model.path
    if not Path(folder).is_dir():
        return  # reported as a missing folder
    missing = missing_tokenizer_files(folder)
    if missing:
        # Without them transformers loads a tokenizer that encodes every text to nothing, and the
        # job "trains" at loss 0.
        problems.append(
            f"{key}: {folder} has no {missing}; copy them from the original model folder"
            + ("" if cfg.model.tokenizer_path else ", or set model.tokenizer_path to a folder that has them")
        )


def _check_data(cfg: JobConfig, problems: list[str], check_paths: bool) -> None:
    from trinity.data.readers import is_hf_dataset_dir

    pt = cfg.algorithm.name == AlgorithmName.pt
    if pt:  # text files and Megatron indexed datasets, with blend weights
        from trinity.data.pretrain import source_problems

        problems += source_problems(cfg.data.train_files, cfg.data.train_weights, check_paths=check_paths)
    elif cfg.data.train_weights is not None:
        problems.append(
            f"data.train_weights: blend weights apply to algorithm.name pt only, not {cfg.algorithm.name.value}; "
            "list plain paths in data.train_files"
        )
    if not cfg.data.train_files and not pt:
        problems.append(
            "data.train_files: no training files; list at least one .jsonl, .json or .parquet file or datasets folder"
        )
    for i, f in enumerate([] if pt else cfg.data.train_files):
        if check_paths and is_hf_dataset_dir(Path(f)):
            if importlib.util.find_spec("datasets") is None:
                problems.append(
                    f"data.train_files.{i}: {f} is a Hugging Face datasets folder; reading it needs the datasets "
                    "package: pip install datasets"
                )
        elif check_paths and Path(f).is_dir():
            problems.append(
                f"data.train_files.{i}: {f} is a directory but not a datasets folder (save_to_disk); list the "
                ".jsonl, .json or .parquet files in it (data.train_files takes files, e.g. "
                "[dir/part-0.parquet, dir/part-1.parquet])"
            )
        elif not f.endswith((".jsonl", ".json", ".parquet")) and (check_paths or Path(f).suffix):
            # (without check_paths a name with no suffix may be a datasets folder: not checked)
            problems.append(f"data.train_files.{i}: {f} is not a .jsonl, .json or .parquet file or a datasets folder")
        elif check_paths and not Path(f).is_file():
            problems.append(f"data.train_files.{i}: {f} does not exist")
    tok = cfg.model.tokenizer_path
    if tok and check_paths and not Path(tok).is_dir():
        what = "is a file, not a folder" if Path(tok).is_file() else "does not exist"
        problems.append(f"model.tokenizer_path: {tok} {what}; point it at the folder holding tokenizer.json")
    if check_paths:
        _check_tokenizer_files(cfg, problems)
    resume = cfg.trainer.resume
    if resume not in ("auto", "disable") and check_paths and not Path(resume).is_dir():
        problems.append(f"trainer.resume: {resume} is not a checkpoint folder; use auto, disable or an existing folder")
