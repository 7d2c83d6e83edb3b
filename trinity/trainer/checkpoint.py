"""Training checkpoints of any recipe: atomic, keep-last-K, resumable. One manager for every
algorithm, over a dict of role engines plus the data position.

    checkpoints/step_N/<role>/   each trained role's model + optimizer (a trinity dist checkpoint,
                                 reshardable to any layout, HF config/tokenizer under hf/); a recipe with
                                 one trained role may put it at step_N/ itself (SFT: the step folder is
                                 then what `trinity convert mcore-to-hf` reads)
    checkpoints/step_N/rng/rank_<r>.pt   each rank's RNG states, as tensors (dropout streams differ per
                                 TP/PP rank), loaded with torch.load(weights_only=True)
    checkpoints/step_N/resolved_config.yaml   the job config that wrote it (resume compares it)
    checkpoints/step_N/complete

In the `extra` of every role's checkpoint (saved once by rank 0): step, data position, LR-schedule
state of every trained role, world size. Where the data has a per-rank state (`data.rank_state`: partial
rollouts' data position and carried-over answers, trinity.trainer.recipes.rl_partial), each rank's goes to
checkpoints/step_N/rank_state/rank_<r>.pt (plain values and tensors, loaded with weights_only=True); it
restores only at the same world size. The frozen ref is not saved: it is the initial model,
reloaded from the job's weight source on resume.

Protocol: everything is written into `step_N.tmp/` (a stale one from a killed run is cleared first);
then rank 0 writes the `complete` marker and renames the folder to `step_N/`. `resume: auto` only
considers `step_N/` folders with the marker, so a run killed at any moment resumes from the last
checkpoint that was fully written. Older checkpoints beyond `keep_last` are deleted only after a newer
one is complete.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import yaml

from trinity.distributed import collectives
from trinity.errors import UserError
from trinity.launch.run_folder import COMPLETE, CONFIG_FILE, STEP_DIR, complete_checkpoints

if TYPE_CHECKING:
    from trinity.trainer.engine import RoleEngine
    from trinity.trainer.recipes import TrainData


RANK_STATE = "rank_state"


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _barrier() -> None:
    collectives.barrier()


def rng_state() -> dict[str, Any]:
    """Every RNG stream of this rank as tensors and plain values, so that loading it needs no
    unpickling of arbitrary objects (torch.load(weights_only=True))."""
    from megatron.core import tensor_parallel

    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    py, npy = state["python"], state["numpy"]
    if isinstance(py, dict):
        py = (py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"])
    random.setstate(py)  # a tuple: a checkpoint of an earlier version (random.getstate() itself)
    if isinstance(npy, dict):
        npy = (npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    np.random.set_state(npy)
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_rng(path: Path) -> None:
    torch.save(rng_state(), path)


def load_rng(path: Path) -> None:
    """Restore this rank's RNG from `path`. A file that holds anything beyond tensors and plain values
    is refused (one line naming it), never unpickled: that could run code."""
    from trinity.convert.safe_pickle import load_tensor_dict

    try:
        state = load_tensor_dict(path)
    except (RuntimeError, EOFError, OSError, ValueError) as exc:  # a cut or garbled archive
        raise UserError(f"{path}: corrupt or truncated RNG state file ({type(exc).__name__}: "
                        f"{' '.join(str(exc).split())[:200]})") from None
    set_rng_state(state)


class CheckpointManager:
    """Saves and finds the checkpoints of one run under `root` (<output_dir>/checkpoints).

    `engines`: the recipe's role engines by name (only trained ones are saved); `data`: the data
    position (state_dict / load_state_dict); `flat`: the single trained role's checkpoint is the step
    folder itself; `config`: the job config as a plain dict, stored beside each checkpoint."""

    def __init__(
        self, root: Path, *, keep_last: int, is_rank0: bool, engines: dict[str, RoleEngine], data: TrainData,
        hf_dir: str | Path | None = None, flat: bool = False, config: dict[str, object] | None = None,
    ):
        self.root, self.keep_last, self.is_rank0, self.hf_dir = Path(root), keep_last, is_rank0, hf_dir
        self.engines = {name: e for name, e in engines.items() if e.trained}
        self.data, self.config = data, config
        self.flat = flat
        if flat and len(self.engines) != 1:
            raise ValueError("a flat checkpoint holds exactly one trained role")

    def _role_dir(self, step_dir: Path, name: str) -> Path:
        return step_dir if self.flat else step_dir / name

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

    def save(self, step: int) -> Path:
        """Write checkpoint `step` (all ranks call); returns its final folder."""
        final = self.root / f"step_{step}"
        tmp = self.root / f"step_{step}.tmp"
        if self.is_rank0 and tmp.exists():  # left by a run killed while saving
            shutil.rmtree(tmp)
        _barrier()
        extra = {
            "step": step, "data": self.data.state_dict(), "world_size": _world(),
            "schedulers": {name: e.scheduler.state_dict() for name, e in self.engines.items()},
        }
        for name, engine in self.engines.items():
            engine.save(self._role_dir(tmp, name), hf_dir=self.hf_dir, extra=extra,
                        meta={"kind": "training", "role": name, "step": step})
            if engine.lora is not None:  # a LoRA actor: its adapters as a PEFT folder too
                from trinity.models.facts import ModelFacts
                from trinity.trainer.export import ADAPTER_DIR, write_adapter_folder

                write_adapter_folder(engine.modules, engine.lora, ModelFacts.from_hf_dir(self.hf_dir), self.hf_dir,
                                     tmp / ADAPTER_DIR)
        rank_state = getattr(self.data, "rank_state", None)
        if self.is_rank0:
            (tmp / "rng").mkdir(exist_ok=True)
            if rank_state is not None:
                (tmp / RANK_STATE).mkdir(exist_ok=True)
            if self.config is not None:
                (tmp / CONFIG_FILE).write_text(yaml.safe_dump(self.config, sort_keys=False), encoding="utf-8")
        _barrier()
        save_rng(tmp / "rng" / f"rank_{_rank()}.pt")
        if rank_state is not None:
            torch.save(rank_state.state_dict(), tmp / RANK_STATE / f"rank_{_rank()}.pt")
        _barrier()
        if self.is_rank0:
            _write_synced(tmp / COMPLETE, json.dumps({"step": step, "time": time.time()}) + "\n")
            if final.exists():  # a checkpoint of the same step from an earlier attempt
                shutil.rmtree(final)
            os.rename(tmp, final)
            self._prune()
        _barrier()
        return final

    def _check_readable(self, path: Path, role_dir: Path) -> None:
        """A damaged checkpoint (cut by a crash, a full disk, a partial copy) is one line naming the file
        and the next older complete checkpoint to resume from instead, before any rank reads it."""
        from trinity.convert.dist_ckpt import check_readable

        try:
            check_readable(role_dir)
        except UserError as exc:
            m = STEP_DIR.match(path.name)
            older = [p for s, p in complete_checkpoints(path.parent) if m and s < int(m.group(1))]
            hint = (f"use trainer.resume={older[-1]}" if older
                    else "no older complete checkpoint is left: use trainer.resume=disable to start over")
            raise UserError(f"trainer.resume: {exc}; {hint}") from None

    def _prune(self) -> None:
        for _, path in complete_checkpoints(self.root)[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)

    def load(self, path: Path) -> int:
        """Restore every trained role (model, optimizer, schedule), the data position and the RNG from
        `path`; returns its step."""
        extra: dict[str, object] = {}
        for name in self.engines:
            if not self._role_dir(path, name).is_dir():
                raise UserError(f"trainer.resume: {path} has no {name}/ checkpoint (was it written by another algorithm?)")
            self._check_readable(path, self._role_dir(path, name))
        for name, engine in self.engines.items():
            extra = engine.load(self._role_dir(path, name))
            schedulers = extra.get("schedulers") or ({name: extra["scheduler"]} if "scheduler" in extra else {})
            if name not in schedulers:
                raise UserError(f"trainer.resume: {path} is not a training checkpoint of this job (no {name} schedule in it)")
            engine.scheduler.load_state_dict(schedulers[name])
        try:
            step = int(extra["step"])
            self.data.load_state_dict(extra["data"])
        except KeyError as exc:
            raise UserError(f"trainer.resume: {path} is not a training checkpoint (no {exc} in it)") from None
        rank_state = getattr(self.data, "rank_state", None)
        if rank_state is not None:
            _load_rank_state(path, extra, rank_state)
        rng_file = path / "rng" / f"rank_{_rank()}.pt"
        if int(extra.get("world_size", -1)) == _world() and rng_file.is_file():
            load_rng(rng_file)
        return step


def _load_rank_state(path: Path, extra: dict[str, object], rank_state: Any) -> None:
    """This rank's own data state (module doc) from `path`."""
    file = path / RANK_STATE / f"rank_{_rank()}.pt"
    if not file.is_file():
        raise UserError(f"trainer.resume: {path} has no {RANK_STATE}/{file.name} (partial rollouts' data position "
                        "and carried-over answers of this rank); it was written without "
                        "actor_rollout_ref.rollout.partial.enable: resume with it off, or start over")
    if int(str(extra.get("world_size", -1))) != _world():
        raise UserError(f"trainer.resume: {path} was written by {extra.get('world_size')} ranks; partial rollouts' "
                        f"per-rank state resumes only on the same number of ranks ({_world()} now)")
    try:
        state = torch.load(file, weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise UserError(f"{file}: corrupt or truncated rank state ({type(exc).__name__})") from None
    rank_state.load_state_dict(state)


def _write_synced(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
