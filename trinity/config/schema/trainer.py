"""The `trainer:` block: steps, batch sizes, checkpoints, logging, evaluation and profiling."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trinity.config.megatron import StrictModel


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
    """Save a checkpoint every N steps (unset: only at the end, see save_last)."""
    save_last: bool = True
    """Save a checkpoint after the last step (model, optimizer and RNG state: what resuming or continuing
    the run needs). false: only save_interval's checkpoints are written; the HF export (export_hf) does
    not need one. verl's `trainer.save_freq: -1` (no checkpoints) is `save_last: false` without save_interval."""
    keep_last: int = Field(default=2, ge=1)
    """Checkpoints to keep; older ones are deleted after a newer one is complete."""
    resume: str = "auto"
    """`auto` (newest complete checkpoint in output_dir), `disable`, or a checkpoint folder."""
    export_hf: bool = True
    """Export HF safetensors of the trained actor at the end (<output_dir>/hf)."""
    skip_nonfinite_steps: int = Field(default=0, ge=0)
    """Steps whose loss or gradient norm is inf or nan that the run skips before it stops. Such an update is
    never applied (the weights stay those of the last finite one) and, by default (0), the first one stops
    the run with one line naming the step and the phase (`step 7, update_actor: the loss is nan; ...`),
    before anything of it is saved or exported. N > 0: the optimizer step of up to N such steps is skipped
    (a line says so; metrics.jsonl counts them as `skipped_nonfinite_steps`) and the next one stops the run.
    Counted per run: a resumed run starts from 0."""
    log_interval: int = Field(default=1, ge=1)
    """Print a step line at the first step, every N steps and the last (metrics.jsonl gets every step). On
    a terminal a progress bar (step, rate, ETA) moves at every step; in a pipe, a file or under CI (the CI
    variable set) only the lines are printed."""
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
    """RL: how many of a step's (prompt, response, reward) samples are printed, on the steps
    log_samples_interval says, escaped and shortened (unset: 2); each evaluation prints as many of its own.
    Every step's samples go to <output_dir>/samples/step_N.jsonl (val ones to val_step_N.jsonl). 0 prints
    none and writes no files."""
    log_samples_interval: int | None = Field(default=None, ge=1)
    """RL: print samples at the first step, every N steps and the last (unset: log_interval's steps)."""
    curves: bool | None = None
    """Draw <output_dir>/curves.png (as `trinity plot` does) when the run ends. Unset: when matplotlib is
    installed (`pip install "trinity-mcore[plot]"`); true: always (refused where matplotlib is missing);
    false: never."""
    profile_step: int | None = Field(default=None, ge=1)
    """Profile this step with torch.profiler on every rank: a Chrome trace per rank in
    <output_dir>/profile and GPU time per kind of kernel printed (an RL step also times its rollout's
    decode steps per batch bucket); pick a step after the first (which compiles and warms up). Unset:
    no profiling."""

    def trackers(self) -> list[str]:
        """The metric sinks beyond the console and metrics.jsonl that this job writes to."""
        if self.logger is None:
            return [] if self.tensorboard is False else ["tensorboard"]
        return [name for name in ("tensorboard", "wandb", "mlflow") if name in self.logger]

    def samples_interval(self) -> int:
        """log_samples_interval with its default: the step lines' interval."""
        return self.log_samples_interval or self.log_interval

    def samples_per_step(self, is_rl: bool) -> int:
        """log_samples with its default: 2 for RL, none for SFT (which generates nothing)."""
        return (2 if self.log_samples is None else self.log_samples) if is_rl else 0
