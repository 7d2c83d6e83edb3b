"""Rules on sizes: batch sizes against the data-parallel layout, packed token budgets, the rollout's KV-cache
budget and sequence lengths against the model's context.
"""

from __future__ import annotations

from trinity.algorithms.registry import ALGORITHMS
from trinity.config.schema import JobConfig
from trinity.models.facts import ModelFacts


# Algorithms whose baseline comes from the other responses to the same prompt (RLOO: the mean of the
# other n - 1 rewards), so a group of one has none: name -> title (AlgorithmSpec.group).
GROUP_ALGORITHMS = {s.name: s.title for s in ALGORITHMS.values() if s.group}


def check_batches(cfg: JobConfig, problems: list[str]) -> None:
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
    if cfg.spec.group and cfg.actor_rollout_ref.rollout.n < 2:
        problems.append(f"actor_rollout_ref.rollout.n: {cfg.spec.title} compares responses within a group; use n >= 2")
    ro = cfg.actor_rollout_ref.rollout
    if ro.gpu_memory_utilization is not None and ro.kv_cache_memory_gib is not None:
        problems.append("actor_rollout_ref.rollout.kv_cache_memory_gib: set either kv_cache_memory_gib or "
                        "gpu_memory_utilization (the rollout's KV-cache budget), not both")
    _check_token_budgets(cfg, problems)


def check_kv_budget(cfg: JobConfig, facts: ModelFacts, problems: list[str]) -> None:
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
    # per token and layer: keys and values of this rank's query groups (MLA: every head's key and value,
    # expanded from the latent as trinity.rollout.decode_mla caches them)
    width = 2 * (-(-facts.num_query_groups // tp)) * facts.head_dim
    if facts.mla is not None:
        width = (-(-facts.num_attention_heads // tp)) * (facts.head_dim + facts.mla.v_head_dim)
    per_slot = (-(-facts.num_layers // pp)) * width * elem * cache_len
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


def check_sequence_length(cfg: JobConfig, facts: ModelFacts, problems: list[str]) -> None:
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
