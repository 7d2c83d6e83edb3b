"""megatron-core's DistributedOptimizer checkpoint methods, replaced on given instances for one call: a DP=1 save 12.9 -> 6.2 s, resume 8.3 -> 3.3 s (SmolLM2-135M, 2 CPU cores); torch AdamW resumes at all.

- `own_model_space_state`: at DP=1 the `fully_reshardable` state as views of the rank's own main params
  and Adam moments, instead of megatron-core's host buffers of the whole state (`_own_model_space_state`);
- `step_among_loaded_states`: without apex/TE torch AdamW keeps a `step` in each param's state, which
  megatron-core 0.16.1 restores from the param groups but then also expects among the loaded per-param
  tensors (KeyError: 'step' in `_set_main_param_and_optimizer_states`); the already restored step is
  supplied there.
Both are instance attributes over the class's methods for the `with` block only
(trinity.trainer.engine.optimizer_state uses them), each checked first (`trinity.compat.checks`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from trinity.compat.checks import require


def own_model_space_state(opts: list[Any]) -> contextlib.AbstractContextManager[None]:
    """For the block, each of `opts` (DistributedOptimizers whose DP group is this rank alone) returns its
    `fully_reshardable` state as views of its own tensors (`_own_model_space_state`)."""
    return _instance_methods(opts, "optimizer_state (checkpoint at DP=1)", "sharded_param_state_fully_reshardable",
                             lambda opt: _own_model_space_state.__get__(opt),
                             needs=("gbuf_ranges", "buffers", "_get_main_param_and_optimizer_states"))


def step_among_loaded_states(opts: list[Any]) -> contextlib.AbstractContextManager[None]:
    """For the block, each of `opts` (DistributedOptimizers) gets the restored `step` among the per-param
    tensors it loads."""
    return _instance_methods(opts, "optimizer_state (resume)", "_set_main_param_and_optimizer_states",
                             lambda opt: _keep_step(opt, opt._set_main_param_and_optimizer_states),
                             needs=("model_param_group_index_map",))


@contextlib.contextmanager
def _instance_methods(opts: list[Any], patch: str, name: str, make: Callable[[Any], Any],
                      needs: tuple[str, ...] = ()) -> Iterator[None]:
    """For the `with` block, each of `opts` has `make(opt)` as its method `name` (an instance attribute over
    the class's); first checks that megatron-core still has `name` and `needs` (patches.require)."""
    for opt in opts:
        require(patch, opt, name, *needs)
    for opt in opts:
        setattr(opt, name, make(opt))
    try:
        yield
    finally:
        for opt in opts:
            delattr(opt, name)  # back to the class method


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


def _own_model_space_state(opt: Any, model_sharded_state_dict: Any, is_loading: bool, metadata: Any) -> Any:
    """`fully_reshardable` param state of a DistributedOptimizer whose DP group is this rank alone: the
    same ShardedTensors (keys, shapes, replica ids) as megatron-core's `sharded_param_state_fully_reshardable`,
    whose data are views of the rank's own main params and Adam moments.

    Why: megatron-core gathers the DP ranks' flat shards into buffers of the whole state on the host,
    zero-filled, for a save (the shards copied in, gathered, concatenated and copied again) and for a load (the buffers only give the shapes; the load
    then copies out of fresh tensors): with one DP rank those are host copies of what the rank holds, 12
    bytes per parameter each (84 GB for 7e9 parameters). Loading into the views fills the states in place;
    megatron-core's `load_parameter_state_from_fully_reshardable` then copies each onto itself. SmolLM2-135M
    on 2 CPU cores: save 12.9 -> 6.2 s, resume 8.3 -> 3.3 s (docs/performance.md, "Checkpoint save at DP=1")."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    meta_of = {sh.data: sh for sh in nested_values(sharded)}
    state: dict[int, dict[str, Any]] = {}
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        for _dtype in gbuf_range_maps:  # one dtype per buffer (as megatron-core asserts)
            for model_param in opt.buffers[gbuf_idx].param_index_map:
                meta = meta_of[model_param]
                tensors = opt._get_main_param_and_optimizer_states(model_param)
                entry = {}
                for key in ("param", "exp_avg", "exp_avg_sq"):
                    data = tensors[key].detach().float().reshape(meta.data.shape)  # megatron-core's buffers are fp32
                    kwargs: dict[str, Any] = dict(key=f"optimizer.state.{key}.{meta.key}", data=data,
                                                  dtype=data.dtype, replica_id=meta.replica_id)
                    if isinstance(meta, ShardedTensorFactory):
                        kwargs.pop("dtype")
                    entry[key] = replace(meta, **kwargs)
                    entry[key].validate_metadata_integrity()
                state[len(state)] = entry
    return state
