"""`optimizer_offload` in single-phase recipes (SFT, pt): the optimizer lives in host memory and steps there.

In an RL job `optimizer_offload` moves the optimizer's tensors off the GPU while other phases run
(`trinity.trainer.engine.offload`). An SFT step has no other phase, so that move would free nothing
at the peak; what frees memory there is never having the optimizer on the GPU: the fp32 master
weights and both Adam moments (12 bytes per parameter with bf16 weights, 8 with fp32) stay in host
memory for the whole run, and the optimizer step runs on the CPU:

1. the global gradient norm is computed on the GPU from the fp32 gradient buffer (megatron-core's own
   `get_grad_norm_fp32`, so the value and its reduction over ranks are those of the GPU optimizer);
2. bucket by bucket (`BUCKET_BYTES`, at least one whole tensor): the bucket's gradients are copied
   device -> host into a pinned staging buffer, scaled by the clip coefficient, torch's AdamW
   (fused CPU kernel) steps the bucket's host master weights, and the new weights are cast to the
   model's dtype on the host and copied host -> device into the model's parameters (or, with the
   distributed optimizer, into this rank's shard of the parameter buffer, which is then all-gathered
   as megatron-core does).

The optimizer object stays megatron-core's own (Float16OptimizerWithFloat16Params, FP32Optimizer or
DistributedOptimizer, chained or not): its parameter groups, LR schedule, `state_dict` /
`sharded_state_dict` and checkpoint format are unchanged, only the storages of the tensors it steps
are host storages. Master weights that are the model's own fp32 parameters (fp32 training) get a
host copy, and the optimizer's parameter object points at it (`.data`) only for the duration of the
inner step. On a CPU device "host" and "device" are both CPU memory, but every copy still happens,
which is what the CPU tests check (same losses as the optimizer without offload).

GPU memory freed: 12 bytes per parameter (bf16) held by this rank's optimizer. Host memory used:
the same 12 (8 for fp32), plus pinned staging buffers of one bucket (fp32 gradients + model-dtype
weights). Time: one device -> host copy of the fp32 gradients, one host -> device copy of the
weights, and AdamW on the CPU's cores (torch's intra-op threads) per step.
"""

from __future__ import annotations

import contextlib
import math
import time
from functools import partial
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

BUCKET_BYTES = 256 * 2**20  # fp32 gradient bytes per host step (raised to the largest tensor)


@dataclass
class _Entry:
    """One tensor the optimizer steps."""

    opt: torch.optim.Optimizer  # the torch AdamW that holds its state
    master: torch.Tensor  # the tensor object in `opt.param_groups` (key of `opt.state`)
    grad_of: Callable[[], torch.Tensor]  # its gradient on the device: a view of the DDP fp32 grad buffer
    target: torch.Tensor  # where the new weights go on the device (model param, or param-buffer shard)
    swap: bool  # `master` is the model's own storage: point it at `host` only while stepping
    host: torch.Tensor | None = None  # the host fp32 master weights (== master.data unless swap)
    _grad: torch.Tensor | None = None

    @property
    def grad(self) -> torch.Tensor:
        # Made at the first step: the optimizer is built while the grad buffers are released
        # (`grad_buffers_released`), when no view of them can be made.
        if self._grad is None:
            self._grad = self.grad_of()
        return self._grad


def _inner_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _main_grad(param: torch.Tensor) -> torch.Tensor:
    return param.main_grad


def _entries(inner: Any) -> list[_Entry]:
    """The (master, grad, target) triples of one megatron-core optimizer, as its own step pairs them
    (`_copy_model_grads_to_main_grads` / `_copy_main_params_to_model_params`)."""
    from megatron.core.optimizer import DistributedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer

    from trinity.compat import checks as patches

    opt = getattr(inner, "optimizer", None)
    if opt is None or getattr(inner, "is_stub_optimizer", False):
        return []
    out: list[_Entry] = []
    if isinstance(inner, DistributedOptimizer):  # this rank's shards
        patches.require("host optimizer", DistributedOptimizer, "_get_model_param_range_map")
        for name in ("model_param_gbuf_map", "buffers", "model_float16_groups", "shard_fp32_from_float16_groups",
                     "model_fp32_groups", "shard_fp32_groups"):
            patches.require("host optimizer", inner, name)
        def shards(model_groups: list, main_groups: list, swap: bool) -> None:
            for model_group, main_group in zip(model_groups, main_groups):
                for model_param, main in zip(model_group, main_group):
                    ranges = inner._get_model_param_range_map(model_param)
                    r, world = ranges["param"], ranges["gbuf_world_in_bucket"]
                    gbuf, _, bucket = inner.model_param_gbuf_map[model_param]
                    target = inner.buffers[gbuf].buckets[bucket].param_data.view(-1)[world.start:world.end]
                    grad = partial(lambda p, a, b: p.main_grad.view(-1)[a:b], model_param, r.start, r.end)
                    out.append(_Entry(opt, main, grad, target, swap))

        shards(inner.model_float16_groups, inner.shard_fp32_from_float16_groups, swap=False)
        shards(inner.model_fp32_groups, inner.shard_fp32_groups, swap=True)
    elif isinstance(inner, Float16OptimizerWithFloat16Params):
        for name in ("float16_groups", "fp32_from_float16_groups", "fp32_from_fp32_groups"):
            patches.require("host optimizer", inner, name)
        for model_group, main_group in zip(inner.float16_groups, inner.fp32_from_float16_groups):
            for model_param, main in zip(model_group, main_group):
                out.append(_Entry(opt, main, partial(_main_grad, model_param), model_param.data, swap=False))
        for group in inner.fp32_from_fp32_groups:
            out.extend(_Entry(opt, p, partial(_main_grad, p), p.data, swap=True) for p in group)
    elif isinstance(inner, FP32Optimizer):  # the model's fp32 parameters are the master weights
        for group in opt.param_groups:
            out.extend(_Entry(opt, p, partial(_main_grad, p), p.data, swap=True) for p in group["params"])
    else:
        raise RuntimeError(f"optimizer_offload: no host step for megatron-core's {type(inner).__name__}")
    return out


class HostOptimizer:
    """Keeps a megatron-core optimizer's master weights and Adam states in host memory and steps it
    there. `grad_norm()` then `apply(norm)` replace the optimizer's own `step()`; call `relocate()`
    after anything that may have put optimizer tensors on the device (a checkpoint load)."""

    def __init__(self, optimizer: Any, bucket_bytes: int | None = None):
        self.optimizer = optimizer
        self.inners = _inner_optimizers(optimizer)
        for inner in self.inners:
            if getattr(inner, "grad_scaler", None) is not None:
                raise RuntimeError("optimizer_offload: fp16 loss scaling is not supported (validate refuses fp16)")
        self.entries = [e for inner in self.inners for e in _entries(inner)]
        self.device = self.entries[0].target.device if self.entries else torch.device("cpu")
        self.pin = self.device.type == "cuda"
        # Buckets of consecutive entries, each with its staging views.
        limit = max([bucket_bytes or BUCKET_BYTES] + [e.master.numel() * 4 for e in self.entries])
        self.buckets: list[list[_Entry]] = []
        size = limit
        for e in self.entries:
            if size + e.master.numel() * 4 > limit:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(e)
            size += e.master.numel() * 4
        largest = max((sum(e.master.numel() for e in b) for b in self.buckets), default=0)
        self._grad_stage = torch.empty(largest, dtype=torch.float32, pin_memory=self.pin)
        dtypes = {e.target.dtype for e in self.entries}
        self._param_stage = {d: torch.empty(largest, dtype=d, pin_memory=self.pin) for d in dtypes}
        self.last_step_s = 0.0  # wall time of the last step, both halves (the SFT metrics row shows it)
        self._t0 = 0.0  # when the last grad_norm() began: a step's time spans both halves
        self.relocate()

    # ------------------------------------------------------------------ where the tensors live

    def relocate(self) -> None:
        """Master weights and every optimizer state tensor to host memory (idempotent). Fresh: at
        construction; after a checkpoint load: torch's `load_state_dict` puts states on their
        parameter's device, which for swapped masters is the GPU."""
        host = torch.device("cpu")
        for e in self.entries:
            if e.swap:
                if e.host is None:
                    e.host = torch.empty(e.master.shape, dtype=torch.float32, device=host)
                e.host.copy_(e.master.data)  # the model's (possibly just loaded) fp32 weights
            else:
                if e.master.device != host:
                    e.master.data = e.master.data.to(host)
                e.host = e.master.data
            e.master.grad = None
            state = e.opt.state.get(e.master)
            for key, value in (state or {}).items():
                if isinstance(value, torch.Tensor) and value.device != host:
                    state[key] = value.to(host)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def host_tensors(self) -> Iterator[torch.Tensor]:
        """The host master weights and optimizer states (what the tests check the location of)."""
        for e in self.entries:
            yield e.host
            yield from (v for v in e.opt.state.get(e.master, {}).values() if isinstance(v, torch.Tensor))

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def grad_norm(self) -> float:
        """The first half of megatron-core's `optimizer.step()` (as `trinity.trainer.engine.optimizer_step`):
        the global norm of the gradients, the same on every rank."""
        from megatron.core import tensor_parallel
        from megatron.core.optimizer import clip_grads
        from megatron.core.transformer.module import param_is_not_shared

        self._t0 = time.perf_counter()

        def for_norm(inner: Any) -> list[torch.Tensor]:
            tp_group = getattr(inner, "tp_group", None) or getattr(self.optimizer, "tp_group", None)
            return [e.grad for e in self.entries if e.opt is getattr(inner, "optimizer", None)
                    and param_is_not_shared(e.master)
                    and tensor_parallel.param_is_not_tensor_parallel_duplicate(e.master, tp_group)]

        # As megatron-core's (chained) optimizer: one norm over every gradient when the optimizers reduce
        # their statistics over the same group, else the root of the sum of each one's squared norm (MoE
        # expert parameters under the distributed optimizer). Looked up at call time: trinity's CPU shims
        # patch the module attribute.
        groups = [inner.get_grad_stats_parallel_group() for inner in self.inners]
        if all(g is groups[0] for g in groups):
            grads = [g for inner in self.inners for g in for_norm(inner)]
            return float(clip_grads.get_grad_norm_fp32(grads, grad_stats_parallel_group=groups[0]))
        norms = [clip_grads.get_grad_norm_fp32(for_norm(inner), grad_stats_parallel_group=group)
                 for inner, group in zip(self.inners, groups)]
        return math.sqrt(sum(n**2 for n in norms if n))

    @torch.no_grad()
    def apply(self, norm: float) -> None:
        """The second half: clip by `norm` and step every bucket on the host (the engine calls it only for
        a finite update)."""
        clip = self.inners[0].config.clip_grad
        coeff = clip / (norm + 1.0e-6) if clip > 0.0 else 1.0  # as clip_grad_by_total_norm_fp32
        for bucket in self.buckets:
            self._step_bucket(bucket, coeff if coeff < 1.0 else None)
        for inner in self.inners:  # DistributedOptimizer: all-gather the updated shards, as its own step does
            if hasattr(inner, "model_param_gbuf_map") and not inner.ddp_config.overlap_param_gather:
                for chunk in inner.model_chunks:
                    chunk.start_param_sync()
        self._sync()
        self.last_step_s = time.perf_counter() - self._t0

    def _step_bucket(self, bucket: list[_Entry], coeff: float | None) -> None:
        grads, offset = [], 0
        for e in bucket:
            n = e.master.numel()
            view = self._grad_stage[offset:offset + n].view(e.master.shape)
            view.copy_(e.grad.view(e.master.shape), non_blocking=self.pin)
            grads.append(view)
            offset += n
        self._sync()  # the gradients are on the host
        if coeff is not None:
            torch._foreach_mul_(grads, coeff)
        with self._on_host(bucket, grads):
            for opt in dict.fromkeys(e.opt for e in bucket):  # each torch AdamW steps the params with a grad
                opt.step()
        offset = 0
        for e in bucket:
            n = e.host.numel()
            stage = self._param_stage[e.target.dtype][offset:offset + n].view(e.target.shape)
            stage.copy_(e.host.view(e.target.shape))  # cast on the host: half the bytes cross for bf16
            e.target.copy_(stage, non_blocking=self.pin)
            offset += n
        self._sync()  # the staging buffers are reused by the next bucket

    @contextlib.contextmanager
    def _on_host(self, bucket: list[_Entry], grads: list[torch.Tensor]) -> Iterator[None]:
        saved = []
        try:
            for e, g in zip(bucket, grads):
                if e.swap:
                    saved.append((e, e.master.data))
                    e.master.data = e.host
                e.master.grad = g
            yield
        finally:
            for e in bucket:
                e.master.grad = None
            for e, data in saved:
                e.master.data = data

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


@contextlib.contextmanager
def grad_buffers_released(model: list[Any]) -> Iterator[None]:
    """Free the DDP fp32 gradient buffers (all zero before the first step) while megatron-core builds
    the optimizer: its constructor makes the fp32 master weights on the GPU before `HostOptimizer`
    moves them to the host, and without this the build would peak at weights + grads + masters
    (16 bytes per parameter with bf16 weights) on the GPU."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer

    from trinity.compat import checks as patches
    from trinity.trainer.engine.offload import _ddp_buffers

    patches.require("host optimizer", _ParamAndGradBuffer, "offload_to_cpu", "reload_from_cpu")
    buffers = [b for b in _ddp_buffers(model) if b.grad_data is not None]
    for b in buffers:
        b.offload_to_cpu(move_params=False, move_grads=True)
    try:
        yield
    finally:
        for b in buffers:
            b.reload_from_cpu(move_params=False, move_grads=True)


__all__ = ["BUCKET_BYTES", "HostOptimizer", "grad_buffers_released"]
