"""The optimizer's part of a training checkpoint: megatron-core's sharded optimizer state in a
reshardable format, with the fixes megatron-core 0.16.1 needs on torch's AdamW (no TE / apex), and the
config's hyper-parameters kept over the checkpoint's on resume (`keep_config_hyperparams`)."""

from __future__ import annotations

from typing import Any

import torch

from trinity.compat import fused_optimizer
from trinity.compat import optimizer_state as optimizer_patches

# Param-group entries that come from the job's `optim:` block: on resume the config's values win
# (a changed optim.lr must apply, not the checkpoint's); `lr` itself follows from them at the next
# schedule step.
CONFIG_HYPERPARAMS = ("max_lr", "min_lr", "betas", "eps", "weight_decay")


def keep_config_hyperparams(optimizer: Any, load: Any) -> Any:
    """Run `load()` (which restores the optimizer's param groups from a checkpoint) and put the
    config's CONFIG_HYPERPARAMS back into every param group afterwards."""
    groups = [g for inner in _chain(optimizer) for g in _param_groups(inner)]
    before = [{k: g[k] for k in CONFIG_HYPERPARAMS if k in g} for g in groups]
    result = load()
    groups = [g for inner in _chain(optimizer) for g in _param_groups(inner)]
    for g, saved in zip(groups, before):
        g.update(saved)
    return result


def _param_groups(opt: Any) -> list[dict[str, Any]]:
    inner = getattr(opt, "optimizer", None)
    return list(inner.param_groups) if isinstance(inner, torch.optim.Optimizer) else []


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
        # An optimizer that has never stepped (a save during PPO's critic warm-up, when only the critic has
        # trained) has no Adam states, and megatron-core's state_dict asserts one common `step` among them;
        # a load needs them as targets. Adam's starting states are what it saves and what a load fills.
        _init_empty_adam_states(self.optimizer)
        alone = [o for o in _distributed(self.optimizer) if o.data_parallel_group.size() == 1]
        with optimizer_patches.own_model_space_state(alone):
            return self.optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, metadata=self.METADATA)

    def load_state_dict(self, state_dict: Any) -> None:
        """Without apex/TE, torch AdamW keeps a `step` in each param's state, which megatron-core
        0.16.1 restores from the param groups but then also expects among the loaded per-param
        tensors (KeyError: 'step' in _set_main_param_and_optimizer_states). Supply the already
        restored step there, for the duration of this call only."""
        fused = any(g.get("fused") for inner in fused_optimizer.torch_adams(self.optimizer) for g in inner.param_groups)
        with optimizer_patches.step_among_loaded_states(_distributed(self.optimizer)):
            self.optimizer.load_state_dict(state_dict)
        _unshare_steps(self.optimizer)
        if fused:  # torch's load_state_dict took the saved groups' flags
            fused_optimizer.use_fused_adamw(self.optimizer)


def _distributed(optimizer: Any) -> list[Any]:
    """The megatron-core DistributedOptimizers of `optimizer`'s chain."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [o for o in _chain(optimizer) if isinstance(o, DistributedOptimizer)]


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


def _init_empty_adam_states(optimizer: Any) -> None:
    """Give every param of a torch Adam(W) that has no state yet the states its first step would create:
    zero moments and `step` 0 (so a first step after them is a first step), before a save or a load.

    Without apex/TE, megatron-core's DistributedOptimizer.state_dict() reads `step` from every
    param's state, but its init_state_fn only creates exp_avg/exp_avg_sq; a loaded checkpoint
    overwrites all of these values. Params that have stepped keep their states.
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
