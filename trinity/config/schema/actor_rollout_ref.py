"""The `actor_rollout_ref:` block: the policy roles that share GPUs, actor (with its policy loss, LoRA and
profiler sub-blocks), ref and rollout.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from trinity.config.megatron import MegatronConfig, StrictModel
from trinity.config.schema.algorithm import KLEstimator, LossAggMode
from trinity.config.schema.optim import OptimConfig


class VerlProfileConfig(StrictModel):
    """verl's profiler block: torch.profiler over steps [step_start, step_end) on profile_ranks.

    The same trace and per-kernel summary files as `trainer.profile_step`, one pair per step and rank."""

    use_profile: bool = False
    """Profile the steps [step_start, step_end) on the ranks in profile_ranks."""
    profile_ranks: list[int] | None = None
    """Global ranks that profile; unset means rank 0 (as in verl)."""
    step_start: int = -1
    """First profiled step, counted from 0 as in verl: 0 is the job's first optimizer step (trinity's
    step 1). An RL step here is a whole training step (rollout and every update)."""
    step_end: int = -1
    """Profiling stops before this step (counted from 0, exclusive): step_start 0, step_end 1 profiles
    the first step."""
    save_path: str | None = None
    """Folder of the traces and summaries (relative to where `trinity run` starts); unset means
    <output_dir>/profile."""


class VerlProfilerConfig(StrictModel):
    """verl's newer profiler block: which ranks profile trainer.profile_step, and into which folder.

    The step itself is `trainer.profile_step` (verl's `global_profiler.steps`)."""

    enable: bool = False
    """Profile `trainer.profile_step` on the ranks below."""
    tool: str | None = None
    """Only `torch` (torch.profiler); unset means torch. verl's nsys / npu / torch_memory are not available."""
    all_ranks: bool = False
    """Profile on every rank."""
    ranks: list[int] = Field(default_factory=list)
    """Global ranks that profile (when all_ranks is false)."""
    save_path: str | None = None
    """Folder of the traces and summaries; unset means <output_dir>/profile."""


class PolicyLossConfig(StrictModel):
    """Which policy loss the actor minimises (verl's `actor.policy_loss`)."""

    loss_mode: Literal["vanilla", "gspo"] = "vanilla"
    """`vanilla`: PPO-clip on token ratios (with dual clip); `gspo`: PPO-clip on the sequence-level ratio
    (geometric mean of the token ratios). With gspo, unset clip_ratio_low / clip_ratio_high default to
    GSPO's 3e-4 / 4e-4 and an unset loss_agg_mode to seq-mean-token-mean (docs/rl.md)."""


class LoraConfig(StrictModel):
    """LoRA adapters on the actor (docs/lora.md): only the adapters are trained, the base weights stay
    frozen as loaded. Off while `rank` is 0."""

    rank: int = Field(default=0, ge=0)
    """Rank r of every adapter; 0 (default) trains the full model. PEFT's `r`."""
    alpha: float = Field(default=16.0, gt=0)
    """Scale numerator: each adapter adds alpha / rank x B A x to its layer's output. PEFT's `lora_alpha`."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input (not on the base layer). PEFT's `lora_dropout`."""
    target_modules: list[str] = Field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    """Linears that get an adapter, by megatron-core name (`linear_qkv`, `linear_proj`, `linear_fc1`,
    `linear_fc2`) or Hugging Face name (q_proj/k_proj/v_proj -> linear_qkv, o_proj -> linear_proj,
    gate_proj/up_proj -> linear_fc1, down_proj -> linear_fc2; `all-linear` = all four). One adapter
    covers a fused megatron linear: q_proj alone adapts q, k and v."""
    rollout_weights: Literal["auto", "device", "host", "adapters"] = "auto"
    """RL: how the rollout decodes the adapted model (docs/lora.md, Rollout with adapters): `auto`, `device`,
    `host` merge the adapters into the base weights around each rollout (W + alpha/rank x B A), the
    original weights waiting on the GPU (`device`), in host memory (`host`), or on the GPU while a quarter
    of its memory stays free besides them (`auto`); `adapters` merges nothing: the decoders add
    x A^T B^T beside each adapted linear, inside their CUDA graphs."""
    adapter_path: str | None = None
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors, e.g. from PEFT/TRL or a
    trinity job's `adapter/`) whose adapters the job starts from instead of fresh ones (verl's
    `lora_adapter_path`). Its r, lora_alpha and target_modules must equal rank, alpha and target_modules.
    A resumed job takes its adapters from its checkpoint."""



class ActorConfig(StrictModel):
    """The trained policy."""

    strategy: str | None = None
    """Training backend, kept so that Trinity-RFT / verl configs paste in unchanged: only `megatron` is
    accepted (this toolkit trains with megatron-core only); unset means megatron."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """Parallelism and memory options of the actor."""
    profile: VerlProfileConfig = Field(default_factory=VerlProfileConfig)
    """verl's profiler block: a step range on listed ranks (see also trainer.profile_step)."""
    profiler: VerlProfilerConfig = Field(default_factory=VerlProfilerConfig)
    """verl's newer profiler block: ranks and folder for trainer.profile_step."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer of the actor."""
    ppo_mini_batch_size: int = Field(default=8, ge=1)
    """RL: prompts per optimizer update (each with rollout.n responses)."""
    ppo_epochs: int = Field(default=1, ge=1)
    """RL: passes over each rollout batch."""
    clip_ratio_low: float = Field(default=0.2, ge=0)
    """RL: lower PPO clip range (ratio >= 1 - clip_ratio_low)."""
    clip_ratio_high: float = Field(default=0.2, ge=0)
    """RL: upper PPO clip range (ratio <= 1 + clip_ratio_high)."""
    clip_ratio_c: float | None = Field(default=3.0, gt=1)
    """RL: dual-clip bound for negative advantages (unset disables)."""
    entropy_coeff: float = Field(default=0.0, ge=0)
    """RL: weight of the entropy bonus."""
    loss_agg_mode: LossAggMode = LossAggMode.token_mean
    """RL: how token losses become one number."""
    use_kl_loss: bool = False
    """RL: add kl_loss_coef x KL(actor || ref) to the loss (needs the ref role)."""
    kl_loss_coef: float = Field(default=0.001, ge=0)
    """RL: coefficient of the KL loss."""
    kl_loss_type: KLEstimator = KLEstimator.low_var_kl
    """RL: KL estimator of the KL loss."""
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    """RL: the policy loss (vanilla PPO-clip or GSPO)."""
    use_dynamic_bsz: bool = True
    """RL: pack each sequence's real tokens (prompt + response, no padding) into rows of at most
    ppo_max_token_len_per_gpu tokens, one row per micro batch (first-fit decreasing), for the actor's
    update and old log-probs; false: padded rows of trainer.micro_batch_size sequences (docs/rl.md, Packing)."""
    ppo_max_token_len_per_gpu: int | None = Field(default=None, ge=1)
    """RL, with use_dynamic_bsz: tokens per packed micro batch of the actor (update and old log-probs);
    unset: trainer.micro_batch_size x (data.max_prompt_length + rollout.response_length), the tokens of one
    padded micro batch. Must hold the longest sequence (max_prompt_length + response_length)."""
    recompute_old_log_prob: bool = False
    """RL: run the separate old log-prob pass on every step. By default on-policy steps (ppo_epochs 1 and
    ppo_mini_batch_size = data.train_batch_size, no KL in the reward, not a critic warm-up step) take the
    old log-probs from the update's own forward (detached: the ratio is exactly 1); true is the check."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA: train low-rank adapters instead of the full model (rank >= 1 turns it on; docs/lora.md)."""

    @model_validator(mode="before")
    @classmethod
    def _gspo_defaults(cls, data: Any) -> Any:
        """GSPO's clip ranges and sequence-level aggregation when policy_loss.loss_mode is gspo and they are
        unset (the PPO defaults, 0.2 and token-mean, are not GSPO's); explicit values stand."""
        if not isinstance(data, dict):
            return data
        loss = data.get("policy_loss")
        if not (isinstance(loss, dict) and loss.get("loss_mode") == "gspo"):
            return data
        defaults = {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"}
        return {**defaults, **data}


class RefConfig(StrictModel):
    """The frozen reference policy (forward only), used for KL."""

    strategy: str | None = None
    """Training backend, kept so that Trinity-RFT / verl configs paste in unchanged: only `megatron` is
    accepted (this toolkit trains with megatron-core only); unset means megatron."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """Parallelism and memory options of the reference model."""
    log_prob_use_dynamic_bsz: bool = True
    """Pack the ref log-prob pass's sequences into rows of log_prob_max_token_len_per_gpu tokens (as
    actor.use_dynamic_bsz); false: padded rows of trainer.micro_batch_size sequences."""
    log_prob_max_token_len_per_gpu: int | None = Field(default=None, ge=1)
    """Tokens per packed micro batch of the ref log-prob pass; unset: actor.ppo_max_token_len_per_gpu's
    default, 4 x that on CUDA (the pass is forward only: no activations kept for a backward). Must hold the
    longest sequence (data.max_prompt_length + rollout.response_length)."""


class PartialRolloutConfig(StrictModel):
    """Partial rollouts (docs/rl.md "Partial rollouts"): a step's rollout ends once data.train_batch_size
    prompt groups are complete; unfinished answers carry over to the next step and go on decoding under
    the new weights, with a truncated importance-sampling correction in the update. Names follow slime
    (`partial_rollout`, `over_sampling_batch_size`) and verl (`rollout_is_threshold`)."""

    enable: bool = False
    """Stop the rollout once data.train_batch_size groups (all rollout.n answers each) are complete, keep
    admitting new prompts into free slots until then, and carry the unfinished answers over."""
    over_sampling_batch_size: int | None = Field(default=None, ge=1)
    """Prompts in flight at most (over all DP ranks, carried-over ones included; slime's name): the
    rollout admits new prompts while fewer are in flight. Unset: 2 x data.train_batch_size. At least
    data.train_batch_size."""
    max_staleness: int = Field(default=1, ge=1)
    """A group is trained at most this many policy versions (steps) after its oldest token was sampled;
    a group that would be older is restarted from its prompt (its answers decoded again from scratch)."""
    rollout_is_threshold: float = Field(default=2.0, gt=1)
    """Cap of the token-level truncated importance weight min(pi_old / pi_behaviour, cap) that multiplies
    each token's policy loss (verl's `algorithm.rollout_is_threshold`, TIS)."""


# top_k's "off" is 0; -1 (verl's and older vLLM's "off") is read as 0
TopK = Annotated[int, BeforeValidator(lambda v: 0 if v == -1 else v), Field(ge=0)]


class ValKwargs(StrictModel):
    """How the evaluation on data.val_files samples (verl's `rollout.val_kwargs`): greedy, one response per
    prompt, unless `do_sample`."""

    do_sample: bool = False
    """Sample with the settings below; false: greedy decoding, one response per prompt (pass@1)."""
    temperature: float = Field(default=0.0, ge=0)
    """With do_sample: the sampling temperature."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """With do_sample: the nucleus threshold."""
    top_k: TopK = 0
    """With do_sample: keep the k most likely tokens (0, or verl's -1 = off)."""
    n: int = Field(default=1, ge=1)
    """With do_sample: responses per val prompt; `val/reward_mean` is their mean (a sampled estimate of the
    policy's reward, with no lag behind the trained weights)."""


class RolloutConfig(StrictModel):
    """Generation with the actor's own megatron-core model."""

    n: int = Field(default=4, ge=1)
    """Responses per prompt (the GRPO group size)."""
    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature (0 = greedy)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    top_k: TopK = 0
    """Keep only the k most likely tokens (0, or verl's -1 = off)."""
    response_length: int = Field(default=128, ge=1)
    """Maximum new tokens per response."""
    max_num_seqs: int = Field(default=1024, ge=1)
    """Sequences decoded at once at most (the continuous-batching engine's slots, as in vLLM); fewer when
    the KV-cache budget holds fewer. A rollout with more rows (a DP rank's prompts x n) runs in waves: a
    row that ends frees its slot for a waiting one."""
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    """Fraction of the device memory free when the rollout starts that its KV cache may take (default
    0.8; on CPU: of the available host memory). Set this or `kv_cache_memory_gib`, not both."""
    kv_cache_memory_gib: float | None = Field(default=None, gt=0)
    """KV-cache budget of the rollout in GiB per GPU (per process on CPU), instead of
    `gpu_memory_utilization`."""
    partial: PartialRolloutConfig = Field(default_factory=PartialRolloutConfig)
    """Partial rollouts: a step does not wait for its longest answer (off by default)."""
    val_kwargs: ValKwargs = Field(default_factory=ValKwargs)
    """Sampling of the evaluation on data.val_files (RL): greedy by default."""


class ActorRolloutRefConfig(StrictModel):
    """The policy roles that share GPUs: actor (trained), ref (frozen), rollout (generation)."""

    actor: ActorConfig = Field(default_factory=ActorConfig)
    """The trained policy."""
    ref: RefConfig = Field(default_factory=RefConfig)
    """The reference policy (GRPO/PPO with KL)."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Generation settings."""
