"""The job config: one Pydantic model per section, every field documented.

Sections: algorithm, model, data, cluster, trainer, actor_rollout_ref (actor, ref, rollout), critic,
reward. Field docstrings are the reference documentation (docs/configuration.md is generated from
them) and the JSON Schema descriptions (`trinity schema`).
"""

from __future__ import annotations

import enum
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from trinity.config.megatron import MegatronConfig, StrictModel


class AlgorithmName(str, enum.Enum):
    sft = "sft"
    pt = "pt"  # continued pre-training (LLaMA-Factory's stage name; Megatron-LM's pretrain_gpt)
    grpo = "grpo"
    ppo = "ppo"
    rloo = "rloo"  # verl's adv_estimator names
    reinforce_plus_plus = "reinforce_plus_plus"
    dapo = "dapo"  # verl's DAPO recipe: GRPO advantages + dynamic sampling + overlong shaping
    dpo = "dpo"  # offline preference pairs (TRL's DPOTrainer); no rollout


class DPOLossType(str, enum.Enum):
    """DPO loss variants (TRL's `loss_type` names; trinity.algorithms.dpo)."""

    sigmoid = "sigmoid"  # DPO (Rafailov et al. 2023); with label_smoothing > 0, conservative DPO
    ipo = "ipo"  # IPO (Azar et al. 2023)
    robust = "robust"  # robust DPO (Chowdhury et al. 2024)


def split_train_files(value: Any) -> tuple[list[str], list[float] | None]:
    """`data.train_files` in any accepted form -> (paths, blend weights or None). The one place the
    forms are told apart:

    - a list of paths (`[a.jsonl, b.jsonl]`), or one path as a string;
    - a list of `{path, weight}` mappings (weight defaults to 1);
    - Megatron-LM's `--data-path` form, `weight path weight path ...`, as a list (`[0.3, a, 0.7, b]`)
      or one whitespace-separated string (`"0.3 a 0.7 b"`).

    Raises ValueError with the fix when the value is none of these.
    """

    def number(x: Any) -> float | None:
        if isinstance(x, bool):
            return None
        if isinstance(x, (int, float)):
            return float(x)
        if isinstance(x, str):
            try:
                return float(x)
            except ValueError:
                return None
        return None

    if isinstance(value, str):
        value = value.split() if len(value.split()) > 1 and number(value.split()[0]) is not None else [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError("must be a list of paths, of {path, weight} mappings, or Megatron's `weight path ...` pairs")
    items = list(value)
    if items and all(isinstance(x, dict) for x in items):
        paths, weights = [], []
        for i, x in enumerate(items):
            if set(x) - {"path", "weight"} or not isinstance(x.get("path"), str):
                raise ValueError(f"entry {i} must be a mapping of `path` (a string) and optional `weight`, got {x}")
            w = number(x.get("weight", 1.0))
            if w is None:
                raise ValueError(f"entry {i} ({x['path']}): weight must be a number, got {x.get('weight')!r}")
            paths.append(x["path"])
            weights.append(w)
        return paths, weights
    if items and number(items[0]) is not None:
        if len(items) % 2 or any(number(w) is None for w in items[::2]) or not all(isinstance(p, str) for p in items[1::2]):
            raise ValueError(
                "Megatron's form alternates weights and paths (`weight path weight path ...`); got an odd "
                "number of entries or a weight that is not a number"
            )
        return [str(p) for p in items[1::2]], [number(w) for w in items[::2]]  # type: ignore[misc]
    if not all(isinstance(x, str) for x in items):
        raise ValueError("mixes paths and other entries; use only paths, only {path, weight} mappings, or `weight path` pairs")
    return items, None


class KLEstimator(str, enum.Enum):
    """Token-level KL estimators (names as in verl)."""

    kl = "kl"  # k1: logp - ref_logp
    abs = "abs"
    mse = "mse"  # k2
    low_var_kl = "low_var_kl"  # k3, clamped


class LossAggMode(str, enum.Enum):
    token_mean = "token-mean"
    seq_mean_token_sum = "seq-mean-token-sum"
    seq_mean_token_mean = "seq-mean-token-mean"


class FilterGroupsConfig(StrictModel):
    """DAPO's dynamic sampling (verl's `algorithm.filter_groups`)."""

    enable: bool = False
    """dapo: drop the prompt groups whose `metric` is equal for all rollout.n responses and draw more
    prompts until data.train_batch_size groups are left (docs/rl.md)."""
    metric: Literal["score", "seq_reward"] = "seq_reward"
    """What must vary within a group: `score` (the reward function's value) or `seq_reward` (score plus the
    overlong penalty). verl's `acc` (a reward returning an accuracy beside the score) and
    `seq_final_reward` (after the in-reward KL penalty, known only after the ref forward) are not available."""
    max_num_gen_batches: int = 10
    """Most batches of data.train_batch_size prompts drawn for one step (<= 0: no limit, as in verl);
    when they do not yield enough varied groups the step trains on the kept groups filled up with dropped
    ones (equal rewards: zero advantage), and metrics.jsonl says so (dapo/filled_groups)."""


class DPOConfig(StrictModel):
    """DPO's settings (algorithm.name: dpo), named as in TRL's DPOConfig."""

    beta: float = Field(default=0.1, gt=0.0)
    """Strength of the implicit KL to the reference: the loss compares beta x (policy - ref log-prob
    margins); higher keeps the policy closer to the reference (TRL's default 0.1)."""
    loss_type: DPOLossType = DPOLossType.sigmoid
    """`sigmoid` (DPO), `ipo` (squared loss towards a margin of 1 / (2 beta)) or `robust` (robust DPO
    for noisy preference labels); docs/rl.md."""
    label_smoothing: float = Field(default=0.0, ge=0.0, lt=0.5)
    """Assumed probability that a pair's preference label is flipped (sigmoid: conservative DPO;
    robust: the noise rate); 0 is plain DPO. ipo takes none (refused)."""


class AlgorithmConfig(StrictModel):
    """Which fine-tuning algorithm runs, and its advantage / KL-in-reward settings."""

    name: AlgorithmName = AlgorithmName.sft
    """`sft` (supervised), `pt` (continued pre-training on raw text: loss on every token;
    docs/pretraining.md), `grpo` (group-relative policy optimisation), `ppo` (with a critic), `rloo`
    (leave-one-out baseline), `reinforce_plus_plus` (global baseline, KL in the reward), `dapo` (GRPO with
    dynamic sampling and overlong shaping) or `dpo` (direct preference optimisation on chosen/rejected
    pairs, against the frozen initial policy as reference); docs/rl.md. GSPO is a policy loss:
    actor_rollout_ref.actor.policy_loss.loss_mode: gspo."""
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """PPO: discount factor of GAE; reinforce_plus_plus: discount of the returns."""
    lam: float = Field(default=1.0, ge=0.0, le=1.0)
    """PPO: lambda of GAE."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide group-centred rewards by the group's standard deviation."""
    use_kl_in_reward: bool = False
    """Subtract kl_coef x KL(actor || ref) from the token rewards (needs the ref role)."""
    kl_penalty: KLEstimator = KLEstimator.kl
    """KL estimator used for the in-reward penalty."""
    kl_coef: float = Field(default=0.001, ge=0.0)
    """Coefficient of the in-reward KL penalty."""
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)
    """dapo: dynamic sampling."""
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    """dpo: beta, loss type and label smoothing."""


class ModelConfig(StrictModel):
    """The Hugging Face model to fine-tune."""

    path: str
    """Local folder of an HF causal-LM checkpoint (config.json + safetensors + tokenizer files), or a
    Hugging Face hub id such as `Qwen/Qwen2.5-0.5B-Instruct` (resolved once, at validation, through
    huggingface_hub's cache: HF_HUB_CACHE / HF_HOME; with HF_HUB_OFFLINE=1 only the cache is read)."""
    tokenizer_path: str | None = None
    """Tokenizer folder (or hub id, as model.path); unset means model.path."""
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Training dtype: auto is bf16 on cuda and fp32 on cpu."""


class DataConfig(StrictModel):
    """Local training data (jsonl or parquet)."""

    train_files: list[str] = Field(default_factory=list)
    """Training files: SFT samples (prompt/response or messages) or RL prompts (prompt + answer), as .jsonl,
    .json (an array of objects; alpaca's instruction/input/output and ShareGPT's conversations are read as
    prompt/response and messages), .parquet, or a Hugging Face `datasets` folder written by save_to_disk
    (its train split; needs `pip install datasets`). For pt:
    text files (.jsonl/.json/.parquet with data.text_key, plain .txt/.md) and Megatron indexed datasets
    (their path prefix, without .bin/.idx); a blend is `[{path: a, weight: 0.3}, {path: b, weight: 0.7}]`
    or Megatron's `[0.3, a, 0.7, b]`: the weights move to data.train_weights."""
    train_weights: list[float] | None = None
    """pt: blend weights, one per train_files entry (normally written inline in train_files); each
    epoch draws rows from the files in these proportions. Unset: every row of every file once per epoch."""
    text_key: str = "text"
    """pt: field holding a document's text in .jsonl/.json/.parquet files."""
    prompt_key: str = "prompt"
    """Field holding the prompt text."""
    response_key: str = "response"
    """SFT: field holding the target response text."""
    messages_key: str = "messages"
    """Field holding a chat (list of {role, content}); used when present instead of prompt/response."""
    answer_key: str = "answer"
    """RL: field holding the ground-truth answer passed to the reward function."""
    val_files: list[str] = Field(default_factory=list)
    """Held-out files in the training files' format, evaluated before the first step
    (trainer.val_before_train), every trainer.val_interval steps and after the last step: SFT logs the
    loss over all their samples (`val/loss`), RL the mean reward of one greedy response per prompt
    (`val/reward_mean`, pass@1). Empty: no evaluation."""
    chosen_key: str = "chosen"
    """dpo: field holding the preferred response (a string, or a list of chat messages ending with the
    assistant's answer)."""
    rejected_key: str = "rejected"
    """dpo: field holding the dispreferred response (same form as chosen_key)."""
    seq_length: int = Field(default=1024, ge=8)
    """SFT and pt: tokens per training row (samples are packed into or padded to this length). dpo:
    tokens per sequence (prompt + chosen or prompt + rejected, each padded to it; longer ones truncated)."""
    packing: bool = True
    """SFT: pack several samples per row with per-document attention masks instead of padding. On CUDA our
    layer spec runs flash attention over the document boundaries (no [b, 1, s, s] mask); TransformerEngine
    and CPU layers use the dense block mask. pt: default false (documents concatenated with EOS and cut
    into rows, attention across documents, no padding: Megatron-LM's default); true packs documents
    whole (split at seq_length) with per-document attention. dpo: false (one sequence per row)."""
    shuffle: bool = True
    """Shuffle rows each epoch (deterministically from trainer.seed)."""
    max_prompt_length: int = Field(default=256, ge=1)
    """RL: prompts longer than this (in tokens) are truncated from the left."""
    train_batch_size: int = Field(default=8, ge=1)
    """RL: prompts per training step (each gets rollout.n responses)."""

    @model_validator(mode="before")
    @classmethod
    def _split_blend(cls, data: Any) -> Any:
        """Weighted forms of train_files -> paths + train_weights (a malformed value is left for the
        field check below, which names data.train_files)."""
        if not isinstance(data, dict) or "train_files" not in data:
            return data
        try:
            paths, weights = split_train_files(data["train_files"])
        except ValueError:
            return data
        data = {**data, "train_files": paths}
        if weights is not None:
            data["train_weights"] = weights
        return data

    @field_validator("train_files", mode="before")
    @classmethod
    def _check_train_files(cls, value: Any) -> Any:
        try:
            return split_train_files(value)[0]
        except ValueError as exc:
            raise PydanticCustomError("train_files", str(exc)) from None


class ClusterConfig(StrictModel):
    """Where the job runs; matches torchrun's options."""

    device: Literal["cuda", "cpu"] = "cuda"
    """`cuda` (NCCL, bf16) or `cpu` (gloo, fp32; for tiny jobs and debugging configs)."""
    nnodes: int = Field(default=1, ge=1)
    """Number of nodes (one `trinity run` per node)."""
    nproc_per_node: int = Field(default=1, ge=1)
    """Processes per node: one per GPU on cuda."""
    node_rank: int = Field(default=0, ge=0)
    """This node's rank in [0, nnodes)."""
    master_addr: str = "127.0.0.1"
    """Address of node 0 (multi-node)."""
    master_port: int = Field(default=29500, ge=1, le=65535)
    """Port on node 0 for the rendezvous."""
    rdzv_endpoint: str | None = None
    """Optional `host:port` of a c10d rendezvous (elastic); replaces master_addr/master_port."""
    max_restarts: int = Field(default=0, ge=0)
    """Times torchrun restarts the workers after a failure."""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


class OptimConfig(StrictModel):
    """Adam optimizer and learning-rate schedule of a trained role."""

    lr: float = Field(default=1e-5, gt=0)
    """Peak learning rate."""
    min_lr: float = Field(default=0.0, ge=0)
    """Learning rate at the end of the cosine decay."""
    lr_warmup_steps: int = Field(default=0, ge=0)
    """Linear warm-up steps from 0 to lr."""
    lr_scheduler: Literal["cosine", "constant"] = "constant"
    """Schedule after warm-up."""
    weight_decay: float = Field(default=0.01, ge=0)
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    """Adam beta1."""
    adam_beta2: float = Field(default=0.999, ge=0, lt=1)
    """Adam beta2."""
    adam_eps: float = Field(default=1e-8, gt=0)
    """Adam epsilon."""
    clip_grad: float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this value (0 disables)."""


class TrainerConfig(StrictModel):
    """Steps, batch sizes, checkpoints and logging."""

    total_steps: int | None = Field(default=None, ge=1)
    """Optimizer steps to run; unset means total_epochs over the data."""
    total_epochs: int = Field(default=1, ge=1)
    """Epochs over the data when total_steps is unset."""
    global_batch_size: int = Field(default=8, ge=1)
    """SFT and pt: rows per optimizer step across all data-parallel ranks. dpo: preference pairs per step."""
    micro_batch_size: int = Field(default=1, ge=1)
    """Rows per forward pass on one GPU (gradient accumulation covers the rest). dpo: pairs per forward
    pass (both sequences of a pair run in the same micro batch: 2 x micro_batch_size rows)."""
    output_dir: str = "runs/job"
    """Run folder: resolved config, logs, metrics.jsonl, checkpoints, HF export."""
    save_interval: int | None = Field(default=None, ge=1)
    """Save a checkpoint every N steps (unset: only at the end)."""
    keep_last: int = Field(default=2, ge=1)
    """Checkpoints to keep; older ones are deleted after a newer one is complete."""
    resume: str = "auto"
    """`auto` (newest complete checkpoint in output_dir), `disable`, or a checkpoint folder."""
    export_hf: bool = True
    """Export HF safetensors of the trained actor at the end (<output_dir>/hf)."""
    log_interval: int = Field(default=1, ge=1)
    """Print a step line every N steps (metrics.jsonl gets every step)."""
    seed: int = 1234
    """Seed of data order and sampling."""
    tensorboard: bool | None = None
    """Write TensorBoard events to <output_dir>/tensorboard when tensorboard is installed (unset: true).
    The older switch: with trainer.logger set, list `tensorboard` there instead."""
    logger: list[Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]] | None = None
    """Where metrics go (as verl's trainer.logger). The console line and <output_dir>/metrics.jsonl are
    always written; `tensorboard` writes <output_dir>/tensorboard, `wandb` a run named after output_dir
    (WANDB_MODE=offline keeps it in <output_dir>/wandb; WANDB_PROJECT names the project, default trinity),
    `mlflow` a run named after output_dir in MLFLOW_TRACKING_URI (default file:<output_dir>/mlruns). Each
    gets the job config and every step's metrics. Unset: console, jsonl and trainer.tensorboard's choice."""
    val_interval: int | None = Field(default=None, ge=1)
    """Evaluate on data.val_files every N steps (verl's trainer.test_freq); unset: only before the first
    step (trainer.val_before_train) and after the last."""
    val_before_train: bool = True
    """Evaluate on data.val_files before the first step (of this run: a resumed run evaluates at its start)."""
    log_samples: int | None = Field(default=None, ge=0)
    """RL: (prompt, response, reward) triples printed after each step line (unset: 2; the steps
    trainer.log_interval prints); every step's responses go to
    <output_dir>/samples/step_N.jsonl (val ones to val_step_N.jsonl). 0 prints none and writes no files."""
    profile_step: int | None = Field(default=None, ge=1)
    """Profile this step with torch.profiler on every rank: a Chrome trace per rank in
    <output_dir>/profile and GPU time per kind of kernel printed; pick a step after the first
    (which compiles and warms up). Unset: no profiling."""

    def trackers(self) -> list[str]:
        """The metric sinks beyond the console and metrics.jsonl that this job writes to."""
        if self.logger is None:
            return [] if self.tensorboard is False else ["tensorboard"]
        return [name for name in ("tensorboard", "wandb", "mlflow") if name in self.logger]

    def samples_per_step(self, is_rl: bool) -> int:
        """log_samples with its default: 2 for RL, none for SFT (which generates nothing)."""
        return (2 if self.log_samples is None else self.log_samples) if is_rl else 0


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
    """Tokens per packed micro batch of the ref log-prob pass; unset: as actor.ppo_max_token_len_per_gpu's
    default. Must hold the longest sequence (data.max_prompt_length + rollout.response_length)."""


class RolloutConfig(StrictModel):
    """Generation with the actor's own megatron-core model."""

    n: int = Field(default=4, ge=1)
    """Responses per prompt (the GRPO group size)."""
    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature (0 = greedy)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    top_k: int = Field(default=0, ge=0)
    """Keep only the k most likely tokens (0 = off)."""
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


class ActorRolloutRefConfig(StrictModel):
    """The policy roles that share GPUs: actor (trained), ref (frozen), rollout (generation)."""

    actor: ActorConfig = Field(default_factory=ActorConfig)
    """The trained policy."""
    ref: RefConfig = Field(default_factory=RefConfig)
    """The reference policy (GRPO/PPO with KL)."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Generation settings."""


class CriticConfig(StrictModel):
    """The PPO value model (same backbone as the actor, scalar head)."""

    strategy: str | None = None
    """Training backend, kept so that Trinity-RFT / verl configs paste in unchanged: only `megatron` is
    accepted (this toolkit trains with megatron-core only); unset means megatron."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """Parallelism and memory options of the critic."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer of the critic."""
    cliprange_value: float = Field(default=0.5, ge=0)
    """Value clipping range around the old values."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over each rollout batch."""
    warmup_steps: int = Field(default=0, ge=0)
    """Steps during which only the critic trains."""
    use_dynamic_bsz: bool = True
    """Pack the critic's sequences (values pass and update) into rows of ppo_max_token_len_per_gpu tokens
    (as actor.use_dynamic_bsz); false: padded rows of trainer.micro_batch_size sequences."""
    ppo_max_token_len_per_gpu: int | None = Field(default=None, ge=1)
    """Tokens per packed micro batch of the critic; unset: as actor.ppo_max_token_len_per_gpu's default.
    Must hold the longest sequence (data.max_prompt_length + rollout.response_length)."""


class RewardConfig(StrictModel):
    """How responses are scored in RL."""

    function: str = "math_exact_match"
    """A built-in reward (`math_exact_match`, `math_verify`, `format`) or a user function `module.path:function`."""
    extractor: Literal["last_number", "boxed", "after_marker"] = "last_number"
    """How math_exact_match and math_verify find the answer in a response (math_verify: `last_number` takes
    the last `\\boxed{...}` when there is one)."""
    marker: str = "####"
    """Marker for the after_marker extractor."""
    format_pattern: str | None = None
    """Regex for the `format` reward (full match scores 1)."""


class OverlongBufferConfig(StrictModel):
    """DAPO's soft overlong punishment (verl's `reward_model.overlong_buffer`)."""

    enable: bool = False
    """dapo: add a penalty to the score of responses longer than rollout.response_length - len tokens."""
    len: int = Field(default=0, ge=0)
    """Tokens of the buffer: the penalty grows linearly from 0 at response_length - len tokens to
    penalty_factor at response_length; must be in [1, response_length) when enabled."""
    penalty_factor: float = Field(default=1.0, ge=0)
    """Penalty of a response of rollout.response_length tokens."""


class RewardModelConfig(StrictModel):
    """verl's `reward_model` block: here only DAPO's overlong reward shaping (the reward itself is `reward`)."""

    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig)
    """dapo: overlong reward shaping."""


class JobConfig(StrictModel):
    """A trinity job: what to train, on what data, where, with which parallel layout."""

    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Algorithm and its advantage/KL settings."""
    model: ModelConfig
    """The HF model to fine-tune."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Training data."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Devices, nodes and processes."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Steps, batches, checkpoints, logging."""
    actor_rollout_ref: ActorRolloutRefConfig = Field(default_factory=ActorRolloutRefConfig)
    """Actor, reference and rollout."""
    critic: CriticConfig | None = None
    """PPO critic; required for ppo, not allowed for sft and grpo."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """RL reward function."""
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    """dapo: overlong reward shaping (verl's reward_model.overlong_buffer)."""

    def roles(self) -> dict[str, MegatronConfig]:
        """Megatron blocks of the roles that exist in this job, keyed by their config path."""
        out = {"actor_rollout_ref.actor": self.actor_rollout_ref.actor.megatron}
        # with LoRA the reference policy is the actor with its adapters off: no ref model is built
        if self.needs_ref and self.actor_rollout_ref.actor.lora.rank == 0:
            out["actor_rollout_ref.ref"] = self.actor_rollout_ref.ref.megatron
        if self.critic is not None:
            out["critic"] = self.critic.megatron
        return out

    @model_validator(mode="before")
    @classmethod
    def _pt_concatenates(cls, data: Any) -> Any:
        """data.packing defaults to false for pt and dpo (see its docstring); an explicit value stands."""
        if not isinstance(data, dict):
            return data
        algo, section = data.get("algorithm"), data.get("data")
        name = algo.get("name") if isinstance(algo, dict) else None
        # dpo pads each sequence to its own row (a pair's log-probs are per-sequence sums): false too, and
        # an explicit true is refused (trinity.config.rules)
        if name in (AlgorithmName.pt, "pt", AlgorithmName.dpo, "dpo") \
                and (section is None or (isinstance(section, dict) and "packing" not in section)):
            data = {**data, "data": {**(section or {}), "packing": False}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _reinforce_pp_kl_in_reward(cls, data: Any) -> Any:
        """algorithm.use_kl_in_reward defaults to true for reinforce_plus_plus: the per-token KL penalty in
        the reward is part of REINFORCE++ (the paper, and verl's example); an explicit value stands."""
        if not isinstance(data, dict):
            return data
        algo = data.get("algorithm")
        if isinstance(algo, dict) and algo.get("name") in (AlgorithmName.reinforce_plus_plus, "reinforce_plus_plus") \
                and "use_kl_in_reward" not in algo:
            data = {**data, "algorithm": {**algo, "use_kl_in_reward": True}}
        return data

    @property
    def needs_ref(self) -> bool:
        """The reference model exists for RL jobs that use KL, and for dpo (the frozen initial policy)."""
        return self.algorithm.name == AlgorithmName.dpo or self.is_rl and (
            self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward
        )

    @property
    def is_rl(self) -> bool:
        """Whether the job generates rollouts (dpo trains offline on pairs, like SFT: not RL here)."""
        return self.algorithm.name not in (AlgorithmName.sft, AlgorithmName.pt, AlgorithmName.dpo)
