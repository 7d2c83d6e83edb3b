"""Rules of the evaluation, samples and tracker options (data.val_files, trainer.val_interval,
trainer.log_samples, trainer.logger), checked with the rest of the job before any process starts."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from trinity.config.rules.data import check_text_file
from trinity.config.schema import JobConfig

# tracker -> (module that must import, pip command that installs it)
TRACKER_PACKAGES = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install wandb"),
    "mlflow": ("mlflow", "pip install mlflow-skinny"),
}


def check_evaluation(cfg: JobConfig, problems: list[str], check_paths: bool) -> None:
    data, trainer = cfg.data, cfg.trainer
    for i, f in enumerate(data.val_files):
        if not f.endswith((".jsonl", ".json", ".parquet")):
            problems.append(f"data.val_files.{i}: {f} is neither .jsonl, .json nor .parquet")
        elif check_paths and not Path(f).is_file():
            problems.append(f"data.val_files.{i}: {f} does not exist")
        elif check_paths and not f.endswith(".parquet"):
            check_text_file(f"data.val_files.{i}", f, problems)
    # (rules on values, not on which keys were written: `trinity run` hands workers a full resolved config)
    if not data.val_files and trainer.val_interval is not None:
        problems.append("trainer.val_interval: there is nothing to evaluate without data.val_files; "
                        "add data.val_files or remove the key")
    algo = cfg.spec.name
    if data.val_files and cfg.spec.evaluation is None:
        problems.append(f"data.val_files: evaluation during training is not available for {algo} jobs yet "
                        "(sft and the RL algorithms have it); remove data.val_files")
    _check_val_kwargs(cfg, problems)
    for key in ("log_samples", "log_samples_interval"):
        if not cfg.is_rl and getattr(trainer, key) is not None:
            problems.append(f"trainer.{key}: {algo} generates no samples (it applies to the RL algorithms); remove the key")
    if trainer.curves and importlib.util.find_spec("matplotlib") is None:
        problems.append('trainer.curves: drawing curves.png needs matplotlib, which is not installed; run '
                        '`pip install "trinity-mcore[plot]"` or remove the key')
    if trainer.logger is not None and trainer.tensorboard is not None:
        problems.append("trainer.tensorboard: set trainer.logger or trainer.tensorboard, not both; "
                        "list tensorboard in trainer.logger (or leave it out) and remove trainer.tensorboard")
    if trainer.logger is not None:
        for name in trainer.trackers():
            module, pip = TRACKER_PACKAGES[name]
            if importlib.util.find_spec(module) is None:
                problems.append(f"trainer.logger: {name} is not installed; run `{pip}` or remove {name} from trainer.logger")
            elif name == "wandb" and not _wandb_can_log():
                problems.append("trainer.logger: wandb has no API key here (WANDB_API_KEY unset, no `wandb login` in "
                                "~/.netrc); run `wandb login`, set WANDB_API_KEY, or set WANDB_MODE=offline to keep the "
                                "run in <output_dir>/wandb (`wandb sync` uploads it later)")


def _check_val_kwargs(cfg: JobConfig, problems: list[str]) -> None:
    """actor_rollout_ref.rollout.val_kwargs: sampling settings only where an RL evaluation samples."""
    from trinity.config.schema.actor_rollout_ref import ValKwargs

    vk = cfg.actor_rollout_ref.rollout.val_kwargs
    if vk == ValKwargs():
        return
    key = "actor_rollout_ref.rollout.val_kwargs"
    if not cfg.is_rl:
        problems.append(f"{key}: {cfg.spec.name} evaluates without generating (it applies to the RL algorithms); remove the key")
    elif not cfg.data.val_files:
        problems.append(f"{key}: there is no evaluation without data.val_files; add data.val_files or remove the key")
    elif not vk.do_sample:
        # verl drops these silently without do_sample; here a setting that cannot take effect is refused
        unused = [f for f in ("temperature", "top_p", "top_k", "n") if getattr(vk, f) != getattr(ValKwargs(), f)]
        problems.append(f"{key}.{unused[0]}: the evaluation decodes greedily (one response per prompt) unless "
                        f"{key}.do_sample is true; set do_sample: true or remove "
                        + ", ".join(unused))


def _wandb_can_log() -> bool:
    """Whether wandb.init will start without asking for a key (a worker has no terminal to ask on)."""
    if os.environ.get("WANDB_MODE", "").strip().lower() in ("offline", "disabled", "dryrun"):
        return True
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text() or bool(os.environ.get("WANDB_BASE_URL"))
    except OSError:
        return bool(os.environ.get("WANDB_BASE_URL"))
