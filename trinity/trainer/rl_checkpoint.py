"""RL checkpoints: one dist checkpoint per trained role under the SFT checkpoints' atomic scheme.

    checkpoints/step_N/actor/    model + optimizer (trinity dist checkpoint, reshardable) + extra
    checkpoints/step_N/critic/   the same for the PPO critic
    checkpoints/step_N/rng/rank_<r>.pt
    checkpoints/step_N/complete

Everything is written into `step_N.tmp/`, then rank 0 writes `complete` and renames the folder, so
`resume: auto` only sees checkpoints that were fully written (`CheckpointManager` rules). The frozen
ref is not saved: it is the initial model, reloaded from the job's source on resume.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from trinity.errors import UserError
from trinity.trainer.checkpoint import (
    COMPLETE, CheckpointManager, ReshardableOptimizer, _barrier, _cpu_mode, _pause_s, _rank, _world, _write_synced,
    rng_state, set_rng_state,
)

TRAINED_ROLES = ("actor", "critic")


class RLCheckpointManager(CheckpointManager):
    def save_roles(self, step: int, job: Any) -> Path:
        from trinity.convert.dist_ckpt import save_model_checkpoint

        final = self.root / f"step_{step}"
        tmp = self.root / f"step_{step}.tmp"
        if self.is_rank0 and tmp.exists():
            shutil.rmtree(tmp)
        _barrier()
        extra = {
            "step": step, "data": job.data.state_dict(), "world_size": _world(),
            "schedulers": {name: job.roles[name].state.scheduler.state_dict() for name in TRAINED_ROLES if name in job.roles},
        }
        for name in TRAINED_ROLES:
            role = job.roles.get(name)
            if role is None:
                continue
            with _cpu_mode():
                save_model_checkpoint(
                    role.state.model, tmp / name, hf_dir=self.hf_dir, extra_common=extra,
                    optimizer=ReshardableOptimizer(role.state.optimizer), force=True,
                    meta={"kind": "training", "role": name, "step": step},
                )
        if self.is_rank0:
            (tmp / "rng").mkdir(exist_ok=True)
        _barrier()
        torch.save(rng_state(), tmp / "rng" / f"rank_{_rank()}.pt")
        _barrier()
        time.sleep(_pause_s(step))
        if self.is_rank0:
            _write_synced(tmp / COMPLETE, json.dumps({"step": step, "time": time.time()}) + "\n")
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            self._prune()
        _barrier()
        return final

    def load_roles(self, path: Path, job: Any) -> int:
        from trinity.convert.dist_ckpt import load_model_checkpoint

        extra: dict[str, Any] = {}
        for name in TRAINED_ROLES:
            role = job.roles.get(name)
            if role is None:
                continue
            if not (path / name).is_dir():
                raise UserError(f"trainer.resume: {path} has no {name}/ checkpoint (was it written by another algorithm?)")
            with _cpu_mode():
                extra = load_model_checkpoint(role.state.model, path / name, optimizer=ReshardableOptimizer(role.state.optimizer))
            role.state.scheduler.load_state_dict(extra["schedulers"][name])
        try:
            step = int(extra["step"])
            job.data.load_state_dict(extra["data"])
        except KeyError as exc:
            raise UserError(f"trainer.resume: {path} is not an RL training checkpoint (no {exc} in it)") from None
        rng_file = path / "rng" / f"rank_{_rank()}.pt"
        if int(extra.get("world_size", -1)) == _world() and rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=False))
        return step
