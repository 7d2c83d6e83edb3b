"""The resolved plan of a job: per role its parallel layout and a GPU-memory estimate per device.

The estimate is arithmetic on the model facts, documented in docs/memory-estimate.md; it is meant
to catch layouts that cannot fit before launch, not to replace a measurement. Sizes are for the
busiest GPU (the first or last pipeline stage, whichever holds more).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from trinity.config.megatron import MegatronConfig, RecomputeGranularity, RecomputeMethod, RecomputeModule
from trinity.config.roles import Role
from trinity.config.schema import JobConfig
from trinity.models.facts import ModelFacts

GIB = 1024**3
# Per-layer activation bytes per token per hidden unit, Korthikanti et al. 2022 (eq. 2) without the
# attention-score term 5as/h: SDPA/flash attention never stores the s x s scores.
ACT_PER_LAYER = 34
ACT_MLP_SHARE = 19  # the MLP's part of the 34 (recompute_modules: mlp)
ACT_NORM_SHARE = 4  # the two norms' inputs (recompute_modules: layernorm)


@dataclass
class MemoryEstimate:
    """Bytes on the busiest GPU of one role."""

    params_per_gpu: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    trained: bool
    offloaded: list[str] = field(default_factory=list)
    host_optimizer: int = 0  # bytes of optimizer state in host memory per rank (SFT optimizer_offload)
    trainable_per_gpu: int | None = None  # LoRA: adapter parameters on the busiest GPU (None: all are trained)
    lora_saved: int = 0  # LoRA: grad + optimizer bytes that full fine-tuning of the same layout would add

    @property
    def active(self) -> int:
        """While this role runs (trains, or runs forward if frozen). With `optimizer_offload` the optimizer
        states are on the GPU only for the optimizer step, after the micro batches' activations and logits
        are freed (trinity.trainer.engine.offload.RoleOffloader.optimizer_step)."""
        if "optimizer_offload" in self.offloaded:
            return self.weights + self.grads + max(self.optimizer, self.activations + self.logits)
        return self.weights + self.grads + self.optimizer + self.activations + self.logits

    @property
    def idle(self) -> int:
        """What stays on the GPU while another role runs, after offload."""
        keep = 0 if "param_offload" in self.offloaded else self.weights
        keep += 0 if "grad_offload" in self.offloaded else self.grads
        keep += 0 if "optimizer_offload" in self.offloaded else self.optimizer
        return keep


@dataclass
class RolePlan:
    path: str
    layout: str
    dp: int
    microbatches: int
    memory: MemoryEstimate


@dataclass
class JobPlan:
    algorithm: str
    device: str
    world_size: int
    model: str
    num_parameters: int
    roles: list[RolePlan]
    peak_per_gpu: int
    warnings: list[str]
    reward: str | None = None  # RL: the reward function, and for a user function the file of code it runs
    trainable_parameters: int | None = None  # LoRA: the adapters' parameters (whole model); None: every parameter
    data: dict | None = None  # pt: tokens, rows and steps per epoch (trinity.data.pretrain.PTData.describe)

    def to_dict(self) -> dict:
        out = asdict(self)
        for role, plan in zip(out["roles"], self.roles):
            role["memory"]["active"] = plan.memory.active
            role["memory"]["idle"] = plan.memory.idle
        return out


def padded_vocab(vocab: int, tp: int, multiple: int = 128) -> int:
    step = multiple * tp
    return -(-vocab // step) * step


def estimate_memory(
    f: ModelFacts, m: MegatronConfig, *, world: int, seq: int, micro: int, microbatches: int,
    bytes_per_param: int, trained: bool, value_head: bool = False, optimizer_on_host: bool = False,
    lora: tuple[int, list[str]] | None = None,
) -> MemoryEstimate:
    """`optimizer_on_host`: the optimizer lives in host memory (SFT / pt `optimizer_offload`): its bytes
    leave the GPU and are reported as `host_optimizer`, with the host copy of fp32 master weights
    that fp32 training adds there. `lora` (rank, target modules): only the adapters are trained, so
    grads and optimizer are sized by them; the weights add theirs to the frozen base."""
    lay = m.layout()
    tp, pp, cp, dp = lay.tp, lay.pp, lay.cp, lay.dp(world)
    h, L = f.hidden_size, f.num_layers
    vocab = padded_vocab(f.vocab_size, tp)
    q, kv = f.num_attention_heads * f.head_dim, f.num_query_groups * f.head_dim
    dense_layer = h * q + 2 * h * kv + q * h + 2 * h + (q + 2 * kv if f.qkv_bias else 0) + (2 * f.head_dim if f.qk_norm else 0)
    if f.is_moe:
        expert_layer = f.num_experts * 3 * h * f.moe_ffn_hidden_size
        dense_layer += h * f.num_experts  # router, replicated over TP
    else:
        expert_layer, dense_layer = 0, dense_layer + 3 * h * f.ffn_hidden_size
    layers = L // pp
    embed = vocab * h // tp
    first = embed
    head = h if value_head else embed  # the critic's scalar head replaces the vocabulary projection
    last = h + (head if (value_head or not f.tie_word_embeddings or pp > 1) else 0)
    ends = first + last if pp == 1 else max(first, last)
    dense_params = layers * dense_layer // tp + ends
    expert_params = layers * expert_layer // (lay.ep * lay.expert_tp)
    params = dense_params + expert_params
    weights = params * bytes_per_param
    grads = optimizer = acts = logits = 0
    adapters = saved = 0
    if trained and lora is not None:
        from trinity.models.lora_targets import adapter_parameters_per_gpu

        adapters = adapter_parameters_per_gpu(f, lora[0], lora[1], tp=tp, layers=layers)
        weights += adapters * bytes_per_param
    if trained:
        per_param = 12 if bytes_per_param < 4 else 8  # fp32 master + Adam m, v (fp32 params are their own master)
        edp = lay.expert_dp(world) if f.is_moe else dp
        full_grads = params * 4  # fp32 gradient buffers (grad_reduce_in_fp32)
        # megatron's distributed optimizer shards dense parameters over DP x CP (its dp_cp group), experts
        # over the expert-data-parallel ranks (world / (PP x EP x ETP), which holds the CP ranks too)
        if m.use_distributed_optimizer:
            full_optimizer = per_param * (dense_params // (dp * cp) + expert_params // max(edp, 1))
        else:
            full_optimizer = per_param * params
        grads, optimizer = full_grads, full_optimizer
        if lora is not None:  # DDP buffers and the optimizer hold the adapters only
            grads = adapters * 4
            optimizer = per_param * (adapters // (dp * cp) if m.use_distributed_optimizer else adapters)
            saved = full_grads + full_optimizer - grads - optimizer
        acts = _activations(f, m, seq // cp, micro, layers, microbatches)
    else:
        acts = ACT_PER_LAYER * (seq // cp) * micro * h * 2 // (tp if m.sequence_parallel else 1)
    # bf16 logits + one fp32 copy for the loss; a critic's value head has one output per token.
    logits = (seq // cp) * micro * (1 if value_head else vocab // tp) * 6
    offloaded = [k for k in ("param_offload", "grad_offload", "optimizer_offload") if getattr(m, k)]
    host = 0
    if trained and optimizer_on_host:
        host = optimizer * 12 // (12 if bytes_per_param < 4 else 8)  # + the fp32 masters' host copy
        optimizer = 0
    return MemoryEstimate(params, weights, grads, optimizer, acts, logits, trained, offloaded, host,
                          trainable_per_gpu=adapters if lora is not None and trained else None, lora_saved=saved)


def _activations(f: ModelFacts, m: MegatronConfig, s: int, b: int, layers: int, microbatches: int) -> int:
    lay = m.layout()
    tp = lay.tp
    sp = m.sequence_parallel and tp > 1
    per_layer = s * b * f.hidden_size * (ACT_PER_LAYER / tp if sp else 10 + 24 / tp)
    checkpoint = 2 * s * b * f.hidden_size / (tp if sp else 1)  # bf16 layer input kept by full recompute
    o = m.override_transformer_config
    if o.recompute_granularity == RecomputeGranularity.full:
        n = o.recompute_num_layers or 1
        if o.recompute_method == RecomputeMethod.block:
            stage = min(n, layers) * checkpoint + max(layers - n, 0) * per_layer
        else:  # uniform: one checkpoint per unit of n layers, plus one unit recomputed at a time
            stage = -(-layers // n) * checkpoint + n * per_layer
    else:
        if o.recompute_granularity == RecomputeGranularity.selective:
            mods = set(o.recompute_modules or [RecomputeModule.core_attn])
            share = (ACT_MLP_SHARE if RecomputeModule.mlp in mods else 0) + (ACT_NORM_SHARE if RecomputeModule.layernorm in mods else 0)
            per_layer *= (ACT_PER_LAYER - share) / ACT_PER_LAYER
        stage = layers * per_layer
    # 1F1B: the first stage holds min(PP, microbatches) micro batches in flight; interleaving adds
    # (PP-1)/(PP*VPP) of a stage more.
    in_flight = min(lay.pp, microbatches)
    if lay.vpp:
        in_flight *= 1 + (lay.pp - 1) / (lay.pp * lay.vpp)
    return int(stage * in_flight)


REF_BUDGET_FACTOR = 4  # the ref's unset budget on CUDA: this many padded micro batches' tokens (forward only)


def rl_token_budget(cfg: JobConfig, role: Role) -> int | None:
    """Tokens per packed micro batch of an RL role (`use_dynamic_bsz` and its `*_max_token_len_per_gpu`);
    None: padded rows of trainer.micro_batch_size sequences. Unset: one padded micro batch's tokens, and on
    CUDA REF_BUDGET_FACTOR times that for the ref, whose pass is forward only (no activations kept for a
    backward: its memory per token is the logits'; measured on an H100, 0.5B, 4x: the ref phase 1.86 ->
    1.45 s, docs/performance.md). Not on CPU: there the ref's rows would pack differently from the
    actor's, and step 1's ref KL, exactly 0 in fp32 with the same packing, would become rounding noise."""
    arr = cfg.actor_rollout_ref
    factor = 1
    if role is Role.actor:
        on, budget = arr.actor.use_dynamic_bsz, arr.actor.ppo_max_token_len_per_gpu
    elif role is Role.ref:
        on, budget = arr.ref.log_prob_use_dynamic_bsz, arr.ref.log_prob_max_token_len_per_gpu
        factor = REF_BUDGET_FACTOR if cfg.cluster.device == "cuda" else 1
    else:
        on, budget = (cfg.critic.use_dynamic_bsz, cfg.critic.ppo_max_token_len_per_gpu) if cfg.critic else (False, None)
    if not on:
        return None
    return budget or factor * cfg.trainer.micro_batch_size * (cfg.data.max_prompt_length + arr.rollout.response_length)


def build_plan(cfg: JobConfig, facts: ModelFacts, warnings: list[str]) -> JobPlan:
    world = cfg.cluster.world_size
    dtype = cfg.model.dtype
    if dtype == "auto":
        dtype = "fp32" if cfg.cluster.device == "cpu" else "bf16"
    bpp = 4 if dtype == "fp32" else 2
    seq = cfg.data.seq_length if not cfg.is_rl else cfg.data.max_prompt_length + cfg.actor_rollout_ref.rollout.response_length
    micro = cfg.trainer.micro_batch_size
    roles = []
    for path, m in cfg.roles().items():
        lay = m.layout()
        dp = lay.dp(world)
        if cfg.is_rl:
            seqs = cfg.actor_rollout_ref.actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n
            mbs = max(seqs // (micro * dp), 1)
        else:
            mbs = lay.num_microbatches(cfg.trainer.global_batch_size, micro, world)
        trained = Role.from_path(path).trained
        # dpo: a micro batch of `micro` pairs runs 2 x micro sequences
        rows = micro * cfg.spec.rows_per_sample
        lora = cfg.actor_rollout_ref.actor.lora
        adapted = (lora.rank, list(lora.target_modules)) if path == "actor_rollout_ref.actor" and lora.rank > 0 else None
        role_seq = seq
        budget = rl_token_budget(cfg, Role.from_path(path)) if cfg.is_rl else None
        if budget is not None:  # a packed micro batch is one row of `budget` tokens (estimates are linear in tokens)
            role_seq, rows = budget, 1
        mem = estimate_memory(facts, m, world=world, seq=role_seq, micro=rows, microbatches=mbs, bytes_per_param=bpp,
                              trained=trained, value_head=path == "critic",
                              optimizer_on_host=m.optimizer_offload and not cfg.is_rl, lora=adapted)
        roles.append(RolePlan(path=path, layout=lay.describe(world), dp=dp, microbatches=mbs, memory=mem))
    # Roles share the GPUs: the peak is one role active while the others keep what is not offloaded.
    peak = max(r.memory.active + sum(o.memory.idle for o in roles if o is not r) for r in roles)
    reward = describe_reward(cfg) if cfg.is_rl else None
    data = None
    if cfg.spec.data == "text":
        from trinity.data.pretrain import plan_data  # reads (and tokenises) the data, as each rank will

        data = plan_data(cfg)
    trainable = None
    lora = cfg.actor_rollout_ref.actor.lora
    if lora.rank > 0:
        from trinity.models.lora_targets import adapter_parameter_count

        trainable = adapter_parameter_count(facts, lora.rank, lora.target_modules)
    return JobPlan(
        algorithm=cfg.spec.name, device=cfg.cluster.device, world_size=world,
        model=f"{facts.architecture} ({cfg.model.path})", num_parameters=facts.num_parameters(),
        roles=roles, peak_per_gpu=peak, warnings=list(warnings), reward=reward, data=data, trainable_parameters=trainable,
    )


def describe_reward(cfg: JobConfig) -> str:
    """One line on the reward: a built-in, or the file of user code that every rank runs with the job's
    rights (it can read, write and send whatever the job's user can), so that a config from someone
    else is read before it runs."""
    from trinity.rewards.loader import reward_code_file

    r = cfg.reward
    if cfg.workflow is not None:  # the workflow scores its episodes: its code is what runs
        from trinity.config.schema.workflow import BUILTIN_WORKFLOWS

        fn = cfg.workflow.function
        if fn in BUILTIN_WORKFLOWS:
            return f"workflow {fn} (built-in: {BUILTIN_WORKFLOWS[fn]}) scores its episodes"
        return (f"workflow {fn} scores its episodes: it runs code from module {fn.partition(':')[0]} with this job's "
                "rights; read it before running a config you did not write")
    code = reward_code_file(r.function)
    if code is None:
        extra = f", extractor {r.extractor}" if r.function in ("math_exact_match", "math_verify") else ""
        return f"built-in {r.function}{extra}"
    fn = r.function.rpartition(":")[2]
    package = Path(__file__).resolve().parents[1]
    if Path(code).resolve().is_relative_to(package):
        return f"{r.function} (shipped with trinity: {Path(code).resolve().relative_to(package.parent)})"
    return f"runs code from {code} (function {fn}) with this job's rights; read it before running a config you did not write"


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def render_plan(plan: JobPlan) -> str:
    g = human_bytes
    n = plan.num_parameters
    size = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"
    lines = [f"job: {plan.algorithm} on {plan.world_size} x {plan.device}; model {plan.model}, {size} parameters"]
    if plan.trainable_parameters is not None:
        t = plan.trainable_parameters
        lines.append(f"LoRA: {t:,} trainable adapter parameters ({100 * t / max(n, 1):.2f}% of the model); the base is frozen")
    for r in plan.roles:
        m = r.memory
        lines.append(f"{r.path}: {r.layout}, {r.microbatches} micro batches per step per DP rank")
        if m.trainable_per_gpu is not None:
            lines.append(f"  LoRA: {m.trainable_per_gpu / 1e6:,.2f} M trainable params/GPU; grads and optimizer "
                         f"hold only them: {g(m.lora_saved)} less than full fine-tuning")
        lines.append(f"  params/GPU {m.params_per_gpu / 1e6:,.1f} M   weights {g(m.weights)}   grads {g(m.grads)}   optimizer {g(m.optimizer)}"
                     + (f" (in host memory: {g(m.host_optimizer)} per rank, optimizer_offload)" if m.host_optimizer else ""))
        lines.append(f"  activations {g(m.activations)}   logits {g(m.logits)}   active {g(m.active)}   idle {g(m.idle)}"
                     + (f"   (offload: {', '.join(m.offloaded)})" if m.offloaded else ""))
    lines.append(f"estimated peak per GPU: {g(plan.peak_per_gpu)} (formula: docs/memory-estimate.md)")
    if plan.reward is not None:
        lines.append(f"reward: {plan.reward}")
    if plan.data is not None:
        d = plan.data
        lines.append(
            f"data: {d['tokens']:,} tokens in {d['documents']:,} documents from {len(d['sources'])} source(s) -> "
            f"{d['rows_per_epoch']:,} rows of {d['seq_length']} tokens per epoch "
            f"({'packed per document' if d['packing'] else 'concatenated'}), {d['steps_per_epoch']:,} steps per epoch, "
            f"{d['total_steps']:,} steps in total"
        )
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)
