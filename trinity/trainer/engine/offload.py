"""Move a role's parameters / gradient buffers / optimizer states off the device between phases.

The three flags of a role's `megatron:` block (`param_offload`, `grad_offload`, `optimizer_offload`)
each name a set of tensor storages; `RoleOffloader.need(params=, grads=, optim=)` is called at the
start of every phase and frees what the phase does not use (for the flags that are on) and brings
back what it does.

How each part moves, and why not always with megatron-core 0.16.1's own functions:
- grads: megatron's `_ParamAndGradBuffer.offload_to_cpu(move_params=False)` / `reload_from_cpu` on
  every DDP buffer: the flat grad storage is resized to 0 (all `main_grad` views stay valid) and
  re-allocated zeroed. Nothing needs copying: every training step starts from zeroed grads.
- params: a storage-level move we do ourselves: each distinct parameter storage (the DDP param
  buffer under the distributed optimizer, else each parameter) is copied into a host buffer
  allocated once (pinned on CUDA) and resized to 0; reload resizes and copies back, so every view
  (param -> buffer, tied embeddings, optimizer shards that alias params) stays valid. megatron's buffer
  param offload only covers the distributed-optimizer buffer and builds its host copy with
  `.cpu().pin_memory()`, a 2x host-memory peak per buffer (and pinning fails without CUDA). The
  frozen ref has no DDP; the same code moves its parameters.
- optimizer: the same storage-level move over the optimizer state tensors (Adam moments, step) and
  the fp32 main parameters when they are not the model's own storages. megatron's
  `MegatronOptimizer.offload_to_cpu` re-points `p.data` (for fp32 training that detaches model params
  from the DDP param buffer), does nothing for a ChainedOptimizer, and leaves the `.grad` of fp32
  master weights allocated; we also drop those `.grad`s (they alias or copy the grad buffer and are
  rebuilt by the next step).
On a CPU device the "device" storages are CPU storages: offload still frees them (resize to 0) and
keeps the host copy, which is what the CPU tests check.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    # The StorageImpl's address: stable across resize_ (data_ptr changes when a storage is re-allocated).
    return (str(t.device), t.untyped_storage()._cdata)


def _byte_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


@dataclass
class _Moved:
    """One device storage and its host copy (allocated at the first offload, reused after)."""

    tensor: torch.Tensor  # any tensor on the storage (keeps it alive and tells its device)
    nbytes: int
    host: torch.Tensor | None = None

    def offload(self) -> None:
        storage = self.tensor.untyped_storage()
        if storage.nbytes() == 0:
            return
        self.nbytes = storage.nbytes()
        if self.host is None:
            pin = self.tensor.device.type == "cuda"
            self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        self.host.copy_(_byte_view(storage, self.tensor.device), non_blocking=False)
        storage.resize_(0)

    def reload(self) -> None:
        storage = self.tensor.untyped_storage()
        if storage.nbytes() != 0 or self.host is None:
            return
        storage.resize_(self.nbytes)
        _byte_view(storage, self.tensor.device).copy_(self.host, non_blocking=False)


def _distinct(tensors: Iterable[torch.Tensor], skip: set[tuple[str, int]]) -> list[_Moved]:
    out: dict[tuple[str, int], _Moved] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
            continue
        key = _storage_key(t)
        if key not in skip and key not in out:
            out[key] = _Moved(t, t.untyped_storage().nbytes())
    return list(out.values())


def _inner_optimizers(optimizer: Any) -> list[Any]:
    if optimizer is None:
        return []
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """Every tensor the optimizer owns: state (moments, step) and the parameters it steps."""
    for inner in _inner_optimizers(optimizer):
        torch_opt = getattr(inner, "optimizer", None)
        if torch_opt is None:
            continue
        for state in torch_opt.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        for group in torch_opt.param_groups:
            yield from group["params"]


def _ddp_buffers(model: list[Any]) -> list[Any]:
    """megatron DDP's param/grad buffers (a plain module's `buffers` is nn.Module's method: none)."""
    out: list[Any] = []
    for chunk in model:
        for name in ("buffers", "expert_parallel_buffers"):
            value = getattr(chunk, name, None)
            if isinstance(value, list):
                out.extend(value)
    return out


@dataclass
class RoleOffloader:
    """Offload state of one role. `model`: DDP chunks (trained) or plain modules (frozen)."""

    model: list[Any]
    optimizer: Any = None
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    on_params: bool = True
    on_grads: bool = True
    on_optim: bool = True
    _params: list[_Moved] = field(default_factory=list)
    _param_keys: set[tuple[str, int]] = field(default_factory=set)
    _optim: dict[tuple[str, int], _Moved] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._params = _distinct((p for chunk in self.model for p in chunk.parameters()), set())
        self._param_keys = {_storage_key(m.tensor) for m in self._params}

    def _optim_storages(self, offloading: bool) -> list[_Moved]:
        # Adam's moments appear at the first step, after the first offload may already have run:
        # rescan at every offload (everything is resident then) and keep the storages already known
        # with their host buffers; a reload moves back exactly what was offloaded.
        if offloading:
            for m in _distinct(optimizer_tensors(self.optimizer), self._param_keys):
                self._optim.setdefault(_storage_key(m.tensor), m)
        return list(self._optim.values())

    def _drop_main_grads(self) -> None:
        for inner in _inner_optimizers(self.optimizer):
            torch_opt = getattr(inner, "optimizer", None)
            for group in getattr(torch_opt, "param_groups", []):
                for p in group["params"]:
                    p.grad = None

    def need(self, *, params: bool, grads: bool = False, optim: bool = False) -> None:
        """Make the parts a phase needs resident; offload the others whose flag is on. Everything going
        off goes first and the allocator's cache is emptied before anything comes back: a 7B actor's
        fp32 grad buffer (28 GiB) reloaded while the rollout's freed KV cache still sat in the cache ran
        out of memory with 15 GiB reserved and unused."""
        self.release(params=params, grads=grads, optim=optim)
        self._set_params(params or not self.param_offload)
        self._set_grads(grads or not self.grad_offload)
        self._set_optim(optim or not self.optimizer_offload)

    def release(self, *, params: bool, grads: bool = False, optim: bool = False) -> None:
        """Offload only: the parts the phase does not need, of the flags that are on (`Phases.run` releases
        every role's before any role reloads its own)."""
        moved = False
        for resident, on, flag, move in ((params, self.on_params, self.param_offload, self._set_params),
                                         (grads, self.on_grads, self.grad_offload, self._set_grads),
                                         (optim, self.on_optim, self.optimizer_offload, self._set_optim)):
            if on and flag and not resident:
                move(False)
                moved = True
        device = next((m.tensor.device for m in self._params), None)
        if moved and device is not None and device.type == "cuda":
            torch.cuda.empty_cache()  # resized storages return to the caching allocator, not the GPU

    @contextlib.contextmanager
    def optimizer_step(self) -> Iterator[None]:
        """The optimizer states on the device for one optimizer step. With `optimizer_offload` they come back
        after the step's micro batches have freed their activations and go again right after it, so that
        they never share the GPU with activations: a 7B actor's Adam states (21 GiB at DP=4) beside an
        update's weights, fp32 grads and activations ran out of memory on an 80 GB GPU. A phase with one
        optimizer step moves them once each way, as bringing them back at the phase's start did."""
        if not self.optimizer_offload:
            yield
            return
        self._set_optim(True)
        try:
            yield
        finally:
            self.release(params=True, grads=True, optim=False)

    def _set_params(self, resident: bool) -> None:
        if resident != self.on_params:
            for m in self._params:
                m.reload() if resident else m.offload()
            self.on_params = resident

    def _set_grads(self, resident: bool) -> None:
        buffers = _ddp_buffers(self.model)
        if resident != self.on_grads and buffers:
            if not resident:
                self._drop_main_grads()
            for b in buffers:
                b.reload_from_cpu(move_params=False, move_grads=True) if resident else b.offload_to_cpu(
                    move_params=False, move_grads=True
                )
        self.on_grads = resident

    def _set_optim(self, resident: bool) -> None:
        if resident != self.on_optim and self.optimizer is not None:
            if not resident:
                self._drop_main_grads()
            for m in self._optim_storages(offloading=not resident):
                m.reload() if resident else m.offload()
        self.on_optim = resident

    def device_bytes(self) -> dict[str, int]:
        """Bytes each part holds in its device storages now (0 when offloaded)."""
        grads = sum(b.grad_data.untyped_storage().nbytes() for b in _ddp_buffers(self.model) if b.grad_data is not None)
        optim = sum(m.tensor.untyped_storage().nbytes() for m in _distinct(optimizer_tensors(self.optimizer), self._param_keys))
        return {
            "params": sum(m.tensor.untyped_storage().nbytes() for m in self._params),
            "grads": grads,
            "optim": optim,
        }


def memory_gib(device: torch.device) -> float:
    """Memory in use now: allocated CUDA memory, or this process's resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30
    import os

    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**30
