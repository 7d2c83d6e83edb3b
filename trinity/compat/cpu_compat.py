"""megatron-core 0.16.1 on CPU with gloo: without these, no CPU job (and no CPU test) runs at all.

`enable()` applies each accommodation once (idempotent); `disable()` undoes them (tests on a GPU
machine run CPU and CUDA cases in one process). Each patch names the megatron-core code that needs it
and is as narrow as found to work: module attributes of megatron-core, not torch-wide behaviour,
except `torch.cuda.current_device` / `torch.cuda.synchronize`, which megatron-core calls from dozens of
places. Calling `enable()` commits the process to CPU placement until `disable()`.

Not here, because it is not CPU-specific: torch norms under sequence parallel (no apex/TE on our GPUs
either) are handled by the norm class of our layer spec, `trinity.models.spec.TorchNorm`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from trinity.compat.checks import require

_patches: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) in the order applied


def is_enabled() -> bool:
    return bool(_patches)


def _patch(owner: Any, name: str, value: Any) -> None:
    require("cpu_compat", owner, name)  # a moved name fails here, at start, not mid-step
    # classes: keep the raw descriptor (a classmethod must be restored as one)
    original = vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)
    _patches.append((owner, name, original))
    setattr(owner, name, value)


# --- cuda device literals -------------------------------------------------------------------------


def _cpu_device(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):  # `device=0` means cuda:0
        return "cpu"
    return device


class CudaToCpuMode(TorchFunctionMode):
    """Maps `device="cuda"` to cpu, `.cuda()` to a no-op and reports CPU float tensors as cuda types.

    A torch function mode sees every torch call, which costs ~2x step time on tiny models, so it is
    only entered around the few megatron-core functions below that run once per optimizer step.
    """

    _TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor",
                   "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
                   "torch.HalfTensor": "torch.cuda.HalfTensor"}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return self._TYPE_NAMES.get(name, name)
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


def cuda_to_cpu(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run inside CudaToCpuMode."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with CudaToCpuMode():
            return fn(*args, **kwargs)

    wrapper.__trinity_cpu_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


class _CpuStream:
    """One stand-in for every CUDA stream and event: CPU work is already ordered."""

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_CpuStream":
        return self

    def synchronize(self) -> None:
        pass


_CPU_STREAM = _CpuStream()


class _CpuCuda:
    """`torch.cuda` as one megatron-core module sees it: streams are the no-op stand-in."""

    def Stream(self, *args: Any, **kwargs: Any) -> _CpuStream:  # noqa: N802 (torch's name)
        return _CPU_STREAM

    def current_stream(self, device: Any = None) -> _CpuStream:
        return _CPU_STREAM

    def default_stream(self, device: Any = None) -> _CpuStream:
        return _CPU_STREAM

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _CpuFactoryTorch:
    """The `torch` module as one megatron-core module sees it, with cuda factory devices mapped to
    cpu and CUDA streams stubbed. Costs nothing per op, unlike the function mode; used where the
    literal sits in a hot path."""

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange")
    cuda = _CpuCuda()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name not in self._FACTORIES:
            return attr

        def factory(*args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return attr(*args, **kwargs)

        return factory


# --- checkpoint I/O -------------------------------------------------------------------------------


@contextlib.contextmanager
def checkpoint_io() -> Iterator[None]:
    """The block that saves or loads a training checkpoint (model + optimizer through dist_checkpointing).

    optimizer/distrib_optimizer.py: the distributed optimizer's `fully_reshardable` state (the format
    trinity's checkpoints use) is gathered by `get_parameter_state_dp_zero(use_gloo_comm=False)`,
    which moves each shard to the GPU with `send_tensor.cuda()` before the all-gather, on save and
    on load (`sharded_param_state_fully_reshardable`). Runs once per save/load, so the function mode
    is affordable here. A no-op when CPU mode is off.
    """
    if not is_enabled():
        yield
        return
    with CudaToCpuMode():
        yield


# --- RNG ------------------------------------------------------------------------------------------


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_tracker_class() -> type:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """megatron's tracker with its named states held for the CPU generator."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

    return CpuRNGStatesTracker


class _DropForkWarning(logging.Filter):
    # CudaRNGStatesTracker.fork warns when the CPU RNG changed inside a fork; on CPU the forked state
    # *is* the CPU generator, so every dropout inside a fork would log it.
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_FORK_FILTER = _DropForkWarning()


def model_parallel_seed(seed: int) -> None:
    """CPU twin of megatron's `model_parallel_cuda_manual_seed`: the same three named streams with the
    same per-rank seeds, held for the CPU generator. Call after initialize_model_parallel."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    if not is_enabled():
        raise RuntimeError("cpu_compat.enable() must run before model_parallel_seed()")
    torch.manual_seed(seed)
    mrandom.initialize_rng_tracker(force_reset=True)
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + ps.get_tensor_model_parallel_rank())
    expert_seed = seed + 1024 + 100 * ps.get_expert_model_parallel_rank() + ps.get_expert_tensor_parallel_rank()
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, expert_seed)


# --- causal masks ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


@functools.lru_cache(maxsize=32)
def _cpu_sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    ml = torch.tril(mu, diagonal=skv - sq + window_size[1])
    return ~ml


# --- enable / disable -----------------------------------------------------------------------------


def _host_splits(original: Callable[..., Any]) -> Callable[..., Any]:
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        out = original(tensor, as_numpy=as_numpy, record_stream=record_stream)
        return out.numpy() if as_numpy and torch.is_tensor(out) else out

    return maybe_move_tensor_to_cpu


def _uneven_gather(original: Callable[..., Any]) -> Callable[..., Any]:
    def gather(input_: torch.Tensor, group: Any, output_split_sizes: Any = None, use_global_buffer: bool = False) -> torch.Tensor:
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        rows = max(sizes)
        padded = input_.new_zeros((rows, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        # megatron-core's own equal-size gather (all_gather_into_tensor, which gloo runs)
        full = original(padded.detach(), group)
        return torch.cat([part[:n] for part, n in zip(full.split(rows), sizes)])

    return gather


def _uneven_reduce_scatter(original: Callable[..., Any], reduce: Callable[..., Any]) -> Callable[..., Any]:
    def reduce_scatter(input_: torch.Tensor, group: Any, input_split_sizes: Any = None, use_global_buffer: bool = False) -> torch.Tensor:
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        total = reduce(input_.detach().clone(), group)  # megatron-core's all-reduce, on a copy (it reduces in place)
        return list(torch.split(total, [int(n) for n in input_split_sizes], dim=0))[group.rank()].contiguous()

    return reduce_scatter


def _cpu_synchronize(real: Any) -> Any:
    def synchronize(device: Any = None) -> None:
        # megatron-core's device-less calls: nothing of a CPU-mode process runs on a GPU
        return None if device is None else real(device)

    return synchronize


def enable() -> None:
    """Apply every CPU accommodation once; later calls do nothing."""
    if _patches:
        return
    import megatron.core.distributed.distributed_data_parallel as distributed_data_parallel
    import megatron.core.distributed.param_and_grad_buffer as param_and_grad_buffer
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    import megatron.core.transformer.utils as transformer_utils
    from megatron.core.tensor_parallel import random as mrandom

    # tensor_parallel/random.py: CudaRNGStatesTracker.fork and CheckpointFunction (recompute) save and
    # restore the RNG through _get/_set_cuda_rng_state, and attention always enters fork().
    _patch(mrandom, "_get_cuda_rng_state", _get_cpu_rng_state)
    _patch(mrandom, "_set_cuda_rng_state", _set_cpu_rng_state)
    # tensor_parallel/random.py: CudaRNGStatesTracker.add seeds through torch.cuda.get_rng_state;
    # initialize_rng_tracker looks the class up as a module global.
    _patch(mrandom, "CudaRNGStatesTracker", _cpu_tracker_class())
    logging.getLogger(mrandom.__name__).addFilter(_FORK_FILTER)
    # torch.cuda.current_device(): RoPE (rotary_pos_embedding.py), tensor_parallel/mappings.py (sequence
    # parallel gathers), tensor_parallel/layers.py, moe/router.py, pipeline p2p_communication.py.
    _patch(torch.cuda, "current_device", lambda: "cpu")
    # pipeline_parallel/p2p_communication.py calls torch.cuda.synchronize() around batched p2p (the shape
    # exchange of variable-length micro batches). Patched on machines with a GPU too: the real one looks
    # up the current device, "cpu" above, and raises "invalid argument to exchangeDevice" (seen on a
    # 2-GPU machine running the CPU tests). A call that names a device still reaches the real one.
    _patch(torch.cuda, "synchronize", _cpu_synchronize(torch.cuda.synchronize))
    # transformer/utils.py get_default_causal_mask / get_sliding_window_causal_mask build masks with
    # device="cuda" when DotProductAttention gets attention_mask=None (fused_softmax imports them).
    for module in (transformer_utils, fused_softmax):
        if hasattr(module, "get_default_causal_mask"):
            _patch(module, "get_default_causal_mask", _cpu_causal_mask)
        if hasattr(module, "get_sliding_window_causal_mask"):
            _patch(module, "get_sliding_window_causal_mask", _cpu_sliding_window_causal_mask)
    # pipeline_parallel/schedules.py: forward_backward_* create `total_num_tokens` with
    # device="cuda" (hot path: a module-local torch, no function mode).
    _patch(schedules, "torch", _CpuFactoryTorch())
    # transformer/moe/token_dispatcher.py: the alltoall dispatcher creates a torch.cuda.Stream at
    # construction and moves split sizes to the host on it; moe/moe_utils.py builds the aux-loss
    # tracker with device="cuda" (save_to_aux_losses_tracker).
    _patch(token_dispatcher, "torch", _CpuFactoryTorch())
    _patch(moe_utils, "torch", _CpuFactoryTorch())
    # token_dispatcher.py: the alltoall dispatcher's split sizes go through maybe_move_tensor_to_cpu(...,
    # as_numpy=True), which converts only CUDA tensors; a CPU tensor stays a tensor, and
    # all_to_all_single refuses tensor split sizes (EP > 1 on CPU raised TypeError in every MoE forward).
    _patch(token_dispatcher, "maybe_move_tensor_to_cpu", _host_splits(token_dispatcher.maybe_move_tensor_to_cpu))
    # tensor_parallel/mappings.py: with expert TP (MoE at TP > 1) the alltoall dispatcher gathers and
    # reduce-scatters rows of uneven sizes per rank (all_gather / reduce_scatter of tensor lists), which
    # gloo refuses ("invalid tensor size"); equal-size collectives do the same on the CPU.
    import megatron.core.tensor_parallel.mappings as mappings

    _patch(mappings, "_gather_along_first_dim", _uneven_gather(mappings._gather_along_first_dim))
    require("cpu_compat", mappings, "_reduce")
    _patch(mappings, "_reduce_scatter_along_first_dim",
           _uneven_reduce_scatter(mappings._reduce_scatter_along_first_dim, mappings._reduce))
    # optimizer/clip_grads.py: device='cuda' buffers and `param.grad.type() == 'torch.cuda.FloatTensor'`;
    # optimizer.py imports these three by name.
    for name in ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32", "count_zeros_fp32"):
        wrapped = cuda_to_cpu(getattr(clip_grads, name))
        _patch(clip_grads, name, wrapped)
        if hasattr(optimizer, name):
            _patch(optimizer, name, wrapped)
    # optimizer/optimizer.py: FP32Optimizer / MixedPrecisionOptimizer constructors make device='cuda'
    # scale buffers; restore_from_cpu (RL offload) moves state back with .cuda().
    _patch(optimizer, "torch", _CpuFactoryTorch())
    _patch(optimizer.MegatronOptimizer, "restore_from_cpu", cuda_to_cpu(optimizer.MegatronOptimizer.restore_from_cpu))
    # distributed/distributed_data_parallel.py + param_and_grad_buffer.py: with overlap_grad_reduce the
    # buffers communicate on a torch.cuda.Stream.
    # models/common/language_module/language_module.py setup_embeddings_and_output_layer moves the
    # tied embedding to `.cuda()` before its all-reduce between the first and last PP stage (PP>1
    # with tied embeddings; runs once, at construction).
    from megatron.core.models.common.language_module.language_module import LanguageModule

    _patch(LanguageModule, "setup_embeddings_and_output_layer",
           cuda_to_cpu(LanguageModule.setup_embeddings_and_output_layer))
    _patch(distributed_data_parallel, "torch", _CpuFactoryTorch())
    _patch(param_and_grad_buffer, "torch", _CpuFactoryTorch())
    # distrib_optimizer.py DistributedOptimizer._build_model_and_main_param_groups checks
    # `param.type() == 'torch.cuda.FloatTensor'` (runs once, at construction).
    _patch(
        distrib_optimizer.DistributedOptimizer,
        "_build_model_and_main_param_groups",
        classmethod(cuda_to_cpu(vars(distrib_optimizer.DistributedOptimizer)["_build_model_and_main_param_groups"].__func__)),
    )


def disable() -> None:
    """Undo enable() (restores every patched attribute)."""
    from megatron.core.tensor_parallel import random as mrandom

    while _patches:
        owner, name, original = _patches.pop()
        setattr(owner, name, original)
    logging.getLogger(mrandom.__name__).removeFilter(_FORK_FILTER)


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """enable() for the duration of a block, restoring the previous state after it."""
    was = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was:
            disable()
