"""Every collective trinity makes goes through this module (a unit test scans the package for others).

NCCL, the CUDA backend, only moves tensors that live on the GPU; gloo, the CPU backend, accepts any host
tensor. A host tensor (a metric, a count, a flag) all-reduced over an NCCL group raises "No backend type
associated with device type cpu", and a CPU run never shows it. So the helpers here take a payload
wherever it lives, move it to the device the group's backend needs, run the collective and hand the
result back on the payload's own device, as a new tensor: the caller's tensor is never written.

The in-place helpers (`all_reduce_`, `broadcast_`, `send`, `recv`, `ring_shift`) serve the hot paths whose tensors
already live on the group's device (decode steps, pipeline hand-overs, CUDA graph captures); they check
the device instead of moving.

Strict mode (`TRINITY_STRICT_COLLECTIVES=1`, which the test suite sets): `install_strict_guard()` wraps
torch.distributed's collectives so that a call made from trinity code outside this module raises
`StrictCollectiveError`, also on gloo, where such a call would otherwise pass unnoticed.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup
Op = str | dist.ReduceOp

STRICT_ENV = "TRINITY_STRICT_COLLECTIVES"

# torch.distributed's functions that communicate: the unit test's scan and the strict guard use this list
COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all", "all_to_all_single",
    "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list", "gather", "gather_object", "irecv",
    "isend", "monitored_barrier", "recv", "recv_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "scatter", "scatter_object_list", "send", "send_object_list",
)

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}


class StrictCollectiveError(RuntimeError):
    """A torch.distributed collective called from trinity code outside trinity.distributed.collectives."""


def active() -> bool:
    """Whether a process group is up (outside one, every helper is the identity of a world of one)."""
    return dist.is_available() and dist.is_initialized()


def size(group: ProcessGroup | None = None) -> int:
    """The number of ranks of `group` (the world when None); 1 without a process group."""
    return dist.get_world_size(group) if active() else 1


def rank(group: ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if active() else 0


def group_device(group: ProcessGroup | None = None) -> torch.device:
    """The device a tensor must be on for `group`'s backend: the current GPU for NCCL, else the host."""
    if active() and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _op(op: Op) -> dist.ReduceOp:
    return _OPS[op] if isinstance(op, str) else op


def all_reduce(t: torch.Tensor, op: Op = "sum", group: ProcessGroup | None = None) -> torch.Tensor:
    """`t` reduced over `group`, as a new tensor on `t`'s device (`t` itself is left as it was)."""
    if size(group) == 1:
        return t.clone()
    buf = t.detach().to(group_device(group), copy=True).contiguous()
    dist.all_reduce(buf, op=_op(op), group=group)
    return buf.to(t.device)


def all_reduce_floats(values: Sequence[float], op: Op = "sum", group: ProcessGroup | None = None) -> list[float]:
    """Host numbers (metrics, counts) reduced over `group`, in float64."""
    if size(group) == 1:
        return [float(v) for v in values]
    return all_reduce(torch.tensor([float(v) for v in values], dtype=torch.float64), op, group).tolist()


def all_reduce_(t: torch.Tensor, op: Op = "sum", group: ProcessGroup | None = None) -> torch.Tensor:
    """In-place all-reduce of a tensor that already lives on the group's device (hot paths); returns `t`."""
    if size(group) > 1:
        _check_device(t, group)
        dist.all_reduce(t, op=_op(op), group=group)
    return t


def broadcast(t: torch.Tensor, src: int, group: ProcessGroup | None = None) -> torch.Tensor:
    """Global rank `src`'s `t` on every rank of `group`, as a new tensor on `t`'s device (same shape and
    dtype on every rank)."""
    if size(group) == 1:
        return t.clone()
    buf = t.detach().to(group_device(group), copy=True).contiguous()
    dist.broadcast(buf, src=src, group=group)
    return buf.to(t.device)


def broadcast_(t: torch.Tensor, src: int, group: ProcessGroup | None = None) -> torch.Tensor:
    """In-place broadcast of a tensor on the group's device (hot paths); returns `t`."""
    if size(group) > 1:
        _check_device(t, group)
        dist.broadcast(t, src=src, group=group)
    return t


def all_gather(t: torch.Tensor, group: ProcessGroup | None = None) -> list[torch.Tensor]:
    """Every rank's `t` (same shape on every rank), in group rank order, on `t`'s device."""
    if size(group) == 1:
        return [t.clone()]
    buf = t.detach().to(group_device(group)).contiguous()
    parts = [torch.empty_like(buf) for _ in range(size(group))]
    dist.all_gather(parts, buf, group=group)
    return [p.to(t.device) for p in parts]


def send(t: torch.Tensor, dst: int, group: ProcessGroup | None = None) -> None:
    _check_device(t, group)
    dist.send(t.contiguous(), dst=dst, group=group)


def recv(buf: torch.Tensor, src: int, group: ProcessGroup | None = None) -> torch.Tensor:
    """Fills `buf` (on the group's device) from global rank `src`; returns it."""
    _check_device(buf, group)
    dist.recv(buf, src=src, group=group)
    return buf


class RingShift:
    """The tensors in flight from `ring_shift`: `wait()` returns them as received (the previous rank's)."""

    def __init__(self, works: list, bufs: list[torch.Tensor], sent: list[torch.Tensor]) -> None:
        self._works, self._bufs, self._sent = works, bufs, sent  # the sent tensors live until the wait

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()
        self._works, self._sent = [], []
        return self._bufs


def ring_shift(tensors: Sequence[torch.Tensor], group: ProcessGroup, tag: int = 0) -> RingShift:
    """Send each of `tensors` to the next rank of `group` (group rank + 1, cyclic) and receive the previous
    rank's into new buffers of the same shapes and dtypes, without waiting: the caller computes while the
    ring moves (ring attention), then `wait()`s. The tensors must live on the group's device. Two shifts in
    flight at once take different `tag`s (gloo matches messages by tag; NCCL by order). In a group of one
    the tensors come back themselves."""
    n = size(group)
    if n == 1:
        return RingShift([], list(tensors), [])
    me = dist.get_rank(group)
    nxt, prev = dist.get_global_rank(group, (me + 1) % n), dist.get_global_rank(group, (me - 1) % n)
    ops, bufs, sent = [], [], []
    for t in tensors:
        _check_device(t, group)
        t = t.contiguous()
        buf = torch.empty_like(t)
        bufs.append(buf)
        sent.append(t)
        # every op is posted before any is waited on (no send/recv ordering deadlock); NCCL runs the list as one group
        ops += [dist.P2POp(dist.isend, t, nxt, group, tag), dist.P2POp(dist.irecv, buf, prev, group, tag)]
    return RingShift(dist.batch_isend_irecv(ops), bufs, sent)


T = TypeVar("T")


def all_gather_object(obj: T, group: ProcessGroup | None = None) -> list[T]:
    """Every rank's picklable `obj`, in group rank order."""
    if size(group) == 1:
        return [obj]
    boxes: list[T] = [obj] * size(group)
    dist.all_gather_object(boxes, obj, group=group)
    return boxes


def broadcast_object(obj: T, src: int, group: ProcessGroup | None = None) -> T:
    """Global rank `src`'s picklable `obj` on every rank of `group`."""
    if size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_object(obj: T, dst: int = 0, group: ProcessGroup | None = None) -> list[T] | None:
    """Every rank's `obj` on global rank `dst` (in group rank order); None on the other ranks."""
    if size(group) == 1:
        return [obj]
    boxes: list[T] | None = [obj] * size(group) if rank() == dst else None
    dist.gather_object(obj, boxes, dst=dst, group=group)
    return boxes


def barrier(group: ProcessGroup | None = None) -> None:
    if size(group) > 1:
        dist.barrier(group=group)


def _check_device(t: torch.Tensor, group: ProcessGroup | None) -> None:
    # a GPU tensor suits every backend; only a host one needs the (slower) look at the group's backend
    if t.is_cuda:
        return
    want = group_device(group)
    if t.device.type != want.type:
        raise ValueError(f"a {t.device.type} tensor sent over a {dist.get_backend(group)} group, which needs "
                         f"{want.type} tensors: use trinity.distributed.collectives.all_reduce/broadcast, which move it")


# --- strict mode ----------------------------------------------------------------------------------------------

_guarded: dict[str, Callable] = {}


def strict_requested() -> bool:
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def install_strict_guard() -> None:
    """Wrap torch.distributed's collectives (idempotent): a call whose caller is a trinity module other than
    this one raises `StrictCollectiveError`. megatron-core's and torch's own calls pass through unchanged."""
    import torch.distributed.distributed_c10d as c10d

    for name in COLLECTIVES:
        original = getattr(c10d, name, None)
        if original is None or name in _guarded:
            continue
        _guarded[name] = original
        wrapped = _guard(name, original)
        for module in (dist, c10d):
            if getattr(module, name, None) is original:
                setattr(module, name, wrapped)


def remove_strict_guard() -> None:
    import torch.distributed.distributed_c10d as c10d

    for name, original in _guarded.items():
        for module in (dist, c10d):
            if getattr(getattr(module, name, None), "__wrapped__", None) is original:
                setattr(module, name, original)
    _guarded.clear()


def _guard(name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def guarded(*args, **kwargs):
        frame = sys._getframe(1)
        caller = frame.f_globals.get("__name__", "")
        # a torch function mode (trinity.compat.cpu_compat's) re-dispatches a call someone else made: not the caller
        if caller.split(".")[0] == "trinity" and caller != __name__ and frame.f_code.co_name != "__torch_function__":
            raise StrictCollectiveError(
                f"{caller} calls torch.distributed.{name} directly: go through trinity.distributed.collectives, "
                "which moves host tensors to the device the backend needs (NCCL refuses host tensors)")
        return original(*args, **kwargs)

    return guarded
