"""Training checkpoints: atomic, keep-last-K, resumable.

A checkpoint is a trinity dist checkpoint (`trinity.convert.dist_ckpt`: model + optimizer in
megatron-core dist_checkpointing, reshardable to any layout, with the HF config/tokenizer under hf/)
plus what resuming needs:
- in `extra` (saved once by rank 0): step, data position, LR-schedule state, world size;
- `rng/rank_<r>.pt`: each rank's RNG states (dropout streams differ per TP/PP rank).

Protocol: everything is written into `step_N.tmp/`; then rank 0 writes the `complete` marker and
renames the folder to `step_N/`. `resume: auto` only considers `step_N/` folders with the marker, so a
run killed at any moment resumes from the last checkpoint that was fully written. Older checkpoints
beyond `keep_last` are deleted only after a newer one is complete.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trinity.distributed import cpu_compat
from trinity.errors import UserError
from trinity.trainer import fused_optimizer

COMPLETE = "complete"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Fault injection for tests, `<step>:<seconds>`: sleep after checkpoint <step>'s data is written,
# before it is marked complete (a test kills the job in that window).
PAUSE_ENV = "TRINITY_TEST_CKPT_PAUSE_S"


def _pause_s(step: int) -> float:
    at, _, seconds = os.environ.get(PAUSE_ENV, "").partition(":")
    return float(seconds) if at.strip() == str(step) and seconds else 0.0


# The CPU accommodation of checkpoint I/O (a no-op off CPU); the name rl_checkpoint imports.
_cpu_mode = cpu_compat.checkpoint_io


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class ReshardableOptimizer:
    """The optimizer as dist_ckpt sees it: its sharded state in the `fully_reshardable` format.

    megatron-core 0.16's default for the distributed optimizer (`fully_sharded_model_space`) uses
    flattened ranges that the torch_dist writer refuses; `fully_reshardable` saves each parameter's
    state in its model shape, so a checkpoint resumes under any TP/PP/DP layout.
    """

    METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer

    def sharded_state_dict(self, model_sharded_state_dict: Any, is_loading: bool = False) -> Any:
        if is_loading:
            _init_empty_adam_states(self.optimizer)
        return self.optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, metadata=self.METADATA)

    def load_state_dict(self, state_dict: Any) -> None:
        """Without apex/TE, torch AdamW keeps a `step` in each param's state, which megatron-core
        0.16.1 restores from the param groups but then also expects among the loaded per-param
        tensors (KeyError: 'step' in _set_main_param_and_optimizer_states). Supply the already
        restored step there, for the duration of this call only."""
        fused = any(g.get("fused") for inner in fused_optimizer.torch_adams(self.optimizer) for g in inner.param_groups)
        patched = [o for o in _chain(self.optimizer) if hasattr(o, "_set_main_param_and_optimizer_states")]
        for opt in patched:
            opt._set_main_param_and_optimizer_states = _keep_step(opt, opt._set_main_param_and_optimizer_states)
        try:
            self.optimizer.load_state_dict(state_dict)
        finally:
            for opt in patched:
                del opt._set_main_param_and_optimizer_states  # back to the class method
        _unshare_steps(self.optimizer)
        if fused:  # torch's load_state_dict took the saved groups' flags
            fused_optimizer.use_fused_adamw(self.optimizer)


def _unshare_steps(optimizer: Any) -> None:
    """megatron-core restores torch AdamW's per-param `step` as ONE tensor object shared by every
    param; torch then increments it once per param per step, corrupting the bias correction of all
    steps after a resume. Give each param its own copy."""
    for opt in _chain(optimizer):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            for state in inner.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()


def _chain(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _keep_step(opt: Any, original: Any) -> Any:
    def set_states(model_param: Any, tensors: dict[str, Any]) -> None:
        if "step" not in tensors:
            group, order = opt.model_param_group_index_map[model_param]
            main_param = opt.optimizer.param_groups[group]["params"][order]
            step = opt.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = {**tensors, "step": step.clone()}
        original(model_param, tensors)

    return set_states


def _init_empty_adam_states(optimizer: Any) -> None:
    """Give a fresh torch Adam(W) zero states, `step` included, before a checkpoint is loaded into it.

    Without apex/TE, megatron-core's DistributedOptimizer.state_dict() reads `step` from every
    param's state, but its init_state_fn only creates exp_avg/exp_avg_sq; the loaded checkpoint
    overwrites all of these values.
    """
    for opt in _chain(optimizer):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if not state:  # fused Adam keeps its step as a float32 tensor beside the param
                    state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if group.get("fused")
                                     else torch.tensor(0.0))
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of the complete checkpoints under root, oldest first."""
    found = []
    if root.is_dir():
        for child in root.iterdir():
            m = _STEP_DIR.match(child.name)
            if m and child.is_dir() and (child / COMPLETE).is_file():
                found.append((int(m.group(1)), child))
    return sorted(found)


class CheckpointManager:
    """Saves and finds the checkpoints of one run under `root` (<output_dir>/checkpoints)."""

    def __init__(self, root: Path, *, keep_last: int, is_rank0: bool, hf_dir: str | Path | None = None):
        self.root, self.keep_last, self.is_rank0, self.hf_dir = Path(root), keep_last, is_rank0, hf_dir

    def resume_path(self, resume: str) -> Path | None:
        """The checkpoint to resume from: `auto` (newest complete one, or none), `disable`, or a folder."""
        if resume == "disable":
            return None
        if resume == "auto":
            found = complete_checkpoints(self.root)
            return found[-1][1] if found else None
        path = Path(resume)
        if not (path / COMPLETE).is_file():
            raise UserError(f"trainer.resume: {path} is not a complete training checkpoint (no {COMPLETE} marker)")
        return path

    def save(self, step: int, state: Any, data: Any) -> Path:
        """Write checkpoint `step` (all ranks call); returns its final folder."""
        from trinity.convert.dist_ckpt import save_model_checkpoint

        final = self.root / f"step_{step}"
        tmp = self.root / f"step_{step}.tmp"
        extra = {
            "step": step,
            "data": data.state_dict(),
            "scheduler": state.scheduler.state_dict(),
            "world_size": _world(),
        }
        with cpu_compat.checkpoint_io():
            save_model_checkpoint(
                state.model, tmp, hf_dir=self.hf_dir, extra_common=extra, optimizer=ReshardableOptimizer(state.optimizer), force=True,
                meta={"kind": "training", "step": step},
            )
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(rng_state(), tmp / "rng" / f"rank_{_rank()}.pt")
        _barrier()
        time.sleep(_pause_s(step))
        if self.is_rank0:
            _write_synced(tmp / COMPLETE, json.dumps({"step": step, "time": time.time()}) + "\n")
            if final.exists():  # a checkpoint of the same step from an earlier attempt
                shutil.rmtree(final)
            os.rename(tmp, final)
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        for _, path in complete_checkpoints(self.root)[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)

    def load(self, path: Path, state: Any, data: Any) -> int:
        """Restore model, optimizer, schedule, data position and RNG from `path`; returns its step."""
        from trinity.convert.dist_ckpt import load_model_checkpoint

        with cpu_compat.checkpoint_io():
            extra = load_model_checkpoint(state.model, path, optimizer=ReshardableOptimizer(state.optimizer))
        try:
            step = int(extra["step"])
            data.load_state_dict(extra["data"])
            state.scheduler.load_state_dict(extra["scheduler"])
        except KeyError as exc:
            raise UserError(f"trainer.resume: {path} is not a training checkpoint (no {exc} in it)") from None
        rng_file = path / "rng" / f"rank_{_rank()}.pt"
        if int(extra.get("world_size", -1)) == _world() and rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=False))
        return step


def _write_synced(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
