"""Experiment trackers beyond metrics.jsonl and TensorBoard (trainer.logger): Weights & Biases and MLflow.

Each gets the job config once and every metrics row (finite numbers only), on rank 0. The run is named
after the output folder, so runs of one project tell apart as their folders do. Which ones run, and
that their package is installed, is decided at validation (trinity.config.rules.evaluation).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class WandbTracker:
    """A wandb run in <output_dir>/wandb (offline with WANDB_MODE=offline; WANDB_PROJECT, default trinity)."""

    def __init__(self, output_dir: Path, config: dict[str, Any]):
        import wandb

        self._wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "trinity"), name=output_dir.resolve().name,
                              dir=str(output_dir), config=config, reinit="finish_previous")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(_numbers(metrics), step=step)

    def where(self) -> tuple[str, str]:
        """The run's page, or its folder when offline (`wandb sync` uploads it)."""
        return "wandb", self.run.url or str(Path(self.run.dir).parent)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run in MLFLOW_TRACKING_URI, default the file store file:<output_dir>/mlruns (experiment
    MLFLOW_EXPERIMENT_NAME, default trinity); the config as flattened params."""

    def __init__(self, output_dir: Path, config: dict[str, Any]):
        import mlflow

        self._mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # A folder, like the rest of the run (no database server or SQLAlchemy needed); MLflow 3
            # refuses new file stores unless told that this is wanted.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri(f"file:{(output_dir / 'mlruns').resolve()}")
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "trinity"))
        self.run = mlflow.start_run(run_name=output_dir.resolve().name)
        params = _flatten(config)
        keys = list(params)
        for i in range(0, len(keys), 100):  # log_params takes at most 100 per call
            mlflow.log_params({k: params[k] for k in keys[i:i + 100]})

    def where(self) -> tuple[str, str]:
        """The tracking store and the run's id (`mlflow ui --backend-store-uri <store>` shows it)."""
        return "mlflow", f"{self._mlflow.get_tracking_uri()} (run {self.run.info.run_id})"

    def log(self, metrics: dict[str, Any], step: int) -> None:
        values = _numbers(metrics)
        if values:
            self._mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = str(value)[:500]
    return out


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def build_trackers(names: list[str], output_dir: Path, config: dict[str, Any], enabled: bool) -> list[Any]:
    """The trackers named in `names` that live here (TensorBoard is the metrics logger's), rank 0 only."""
    if not enabled:
        return []
    output_dir.mkdir(parents=True, exist_ok=True)
    return [TRACKERS[name](output_dir, config) for name in names if name in TRACKERS]
