"""Reading HF checkpoints tensor by tensor and writing sharded safetensors folders.

Reading validates every shard header with `safe_open`, then preads each tensor into a fresh buffer
(no mmap, so shard pages never count against the process), or `read_rows_into` preads rows straight
into a caller's tensor (a parameter: no buffer to allocate, touch and copy again); both are
thread-safe, so a loader reads several tensors at once. `.bin` shards go through
`torch.load(weights_only=True, mmap=True)` (trinity.convert.safe_pickle); nothing else is unpickled.
Writing streams tensors into shards with our own safetensors writer (header, then each tensor's bytes
pwritten straight from its storage in pieces, several at once), so no shard is ever built as one big
buffer in memory.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import threading
from collections import deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Iterable, Iterator

import torch

from trinity.convert.parallel_io import io_workers
from trinity.convert.safe_pickle import load_tensor_dict
from trinity.errors import UserError

INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"

# Files that travel with the weights so that the folder is a complete HF model.
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)

_ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_FROM_ST = {v: k for k, v in _ST_DTYPES.items()}


class HFCheckpoint:
    """The tensors of an HF model folder: names, shapes and one-at-a-time reads, validated up front."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.weight_map = self._weight_map()  # tensor name -> file name
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._nbytes: dict[str, int] = {}
        self._dtypes: dict[str, torch.dtype | None] = {}
        self._validate()
        self._files: dict[str, Any] = {}  # shard file name -> open reader
        self._lock = threading.Lock()

    def _weight_map(self) -> dict[str, str]:
        for index_name in (INDEX, BIN_INDEX):
            index = self.folder / index_name
            if index.is_file():
                try:
                    data = json.loads(index.read_text())
                    wm = dict(data["weight_map"])
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    raise UserError(f"{index}: not a valid weight index ({exc})") from None
                if not wm:
                    raise UserError(f"{index}: weight_map is empty")
                for name, fname in wm.items():
                    _check_shard_name(index, name, fname)
                return wm
        files = sorted(self.folder.glob("*.safetensors")) or sorted(self.folder.glob("pytorch_model*.bin"))
        if not files:
            raise UserError(f"{self.folder}: no *.safetensors (or pytorch_model*.bin) weight files")
        wm: dict[str, str] = {}
        for f in files:
            for name in self._read_names(f):
                wm[name] = f.name
        return wm

    def _read_names(self, path: Path) -> dict[str, tuple[tuple[int, ...], int, torch.dtype | None]]:
        """Tensor names -> (shape, bytes, dtype; None if torch has no such dtype) of one shard; UserError
        naming the file if it is missing or corrupt."""
        if not path.is_file():
            raise UserError(f"{path}: weight shard listed in the index does not exist")
        try:
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(path), framework="pt") as f:
                    out = {}
                    for k in f.keys():
                        sl = f.get_slice(k)
                        shape = tuple(sl.get_shape())
                        dtype = _FROM_ST.get(sl.get_dtype())
                        # Bytes only size the read-ahead: an exotic dtype counts as 2 per element.
                        out[k] = (shape, math.prod(shape) * (dtype.itemsize if dtype else 2), dtype)
                    return out
            sd = load_tensor_dict(path, mmap=True)
            return {k: (tuple(v.shape), v.numel() * v.element_size(), v.dtype) for k, v in sd.items()}
        except UserError:
            raise
        except Exception as exc:  # safetensors raises its own error type for truncated/corrupt files
            raise UserError(f"{path}: corrupt or truncated weight shard ({exc})") from None

    def _validate(self) -> None:
        by_file: dict[str, list[str]] = {}
        for name, fname in self.weight_map.items():
            by_file.setdefault(fname, []).append(name)
        for fname, names in by_file.items():
            found = self._read_names(self.folder / fname)
            for name in names:
                if name not in found:
                    raise UserError(f"{self.folder / fname}: tensor {name!r} listed in the index is missing")
                self._shapes[name], self._nbytes[name], self._dtypes[name] = found[name]

    def names(self) -> list[str]:
        return list(self.weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def nbytes(self, name: str) -> int:
        return self._nbytes[name]

    def dtype(self, name: str) -> torch.dtype | None:
        """The stored dtype (None for a safetensors dtype torch cannot hold)."""
        return self._dtypes[name]

    def get(self, name: str) -> torch.Tensor:
        """One tensor, copied out of its shard. Thread-safe: loaders read several tensors at once."""
        handle = self._handle(name)
        if isinstance(handle, dict):
            return handle[name].clone()
        return handle.read(name)

    def read_rows_into(self, name: str, first_row: int, n_rows: int, out: torch.Tensor) -> None:
        """Rows [first_row, first_row + n_rows) (along dim 0) of tensor `name` into `out`, a contiguous
        CPU tensor of the stored dtype with as many elements. Thread-safe.

        Safetensors rows are contiguous bytes, so they are preadv'd straight into `out`'s memory: the
        bytes are touched once, where they stay (fresh buffers cost as much as the read itself on VMs
        whose first touch of memory is slow)."""
        handle = self._handle(name)
        shape, dtype = self.shape(name), self.dtype(name)
        row = math.prod(shape[1:]) if shape else 1
        if out.dtype != dtype or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(f"{name}: needs a contiguous CPU {dtype} tensor, got {out.dtype} on {out.device}")
        if not shape or first_row < 0 or n_rows < 0 or first_row + n_rows > shape[0] or out.numel() != n_rows * row:
            raise ValueError(f"{name} {list(shape)}: rows {first_row}+{n_rows} do not fit into {list(out.shape)}")
        if not n_rows or not row:
            return
        if isinstance(handle, dict):  # a mapped .bin shard: its storage is not the file's bytes
            out.view(-1).copy_(handle[name][first_row : first_row + n_rows].reshape(-1))
            return
        view = _byte_view(out)
        handle.read_into(name, first_row * row * out.element_size(), view)

    def _handle(self, name: str) -> Any:
        """The open reader of `name`'s shard (opened once, shared by every thread)."""
        fname = self.weight_map.get(name)
        if fname is None:
            raise UserError(f"{self.folder}: tensor {name!r} is not in the checkpoint")
        with self._lock:
            handle = self._files.get(fname)
            if handle is None:
                path = self.folder / fname
                if fname.endswith(".safetensors"):
                    handle = _SafetensorsFile(path)
                else:
                    # A mapped .bin shard's pages count against the process while it is open: keep one.
                    for other in [f for f, h in self._files.items() if isinstance(h, dict)]:
                        del self._files[other]
                    handle = load_tensor_dict(path, mmap=True)
                self._files[fname] = handle
        return handle

    def close(self) -> None:
        # Dropping the handles closes the files and unmaps .bin shards.
        with self._lock:
            self._files.clear()

    def total_bytes(self) -> int:
        return sum((self.folder / f).stat().st_size for f in set(self.weight_map.values()))


def _check_shard_name(index: Path, name: str, fname: Any) -> None:
    """A weight_map entry must name a file inside the model folder: an index is data (often
    downloaded), and `../x` or an absolute path would make the loader read any file the user can read.
    The check is on the name only: symlinked shards (the HF hub cache's layout) stay allowed."""
    parts = PurePosixPath(fname).parts + PureWindowsPath(fname).parts if isinstance(fname, str) else ()
    if not isinstance(fname, str) or not fname or PurePosixPath(fname).is_absolute() or \
            PureWindowsPath(fname).is_absolute() or PureWindowsPath(fname).drive or ".." in parts:
        raise UserError(
            f"{index}: weight_map entry {name!r} -> {fname!r} points outside the model folder; "
            "shard names must be file names inside it"
        )


class _SafetensorsFile:
    """Reads one tensor at a time with pread into a fresh buffer: no mmap, so the shard's pages never
    count against this process (safe_open maps the whole file). The header was validated by safe_open."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        (n,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
        self.header = json.loads(os.pread(self.fd, n, 8))
        self.data_start = 8 + n

    def read(self, name: str) -> torch.Tensor:
        info = self.header[name]
        begin, end = info["data_offsets"]
        buf = bytearray(end - begin)
        self.read_into(name, 0, memoryview(buf))
        dtype = _FROM_ST[info["dtype"]]
        if not buf:
            return torch.empty(info["shape"], dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(info["shape"])

    def read_into(self, name: str, offset: int, view: memoryview) -> None:
        """len(view) bytes of tensor `name`'s data from `offset` into `view`; the caller keeps it in range."""
        pos = self.data_start + self.header[name]["data_offsets"][0] + offset
        got = 0
        while got < len(view):  # preadv may return less (signals, reads over 2 GiB): loop until done
            n = os.preadv(self.fd, [view[got:]], pos + got)
            if n <= 0:
                raise UserError(
                    f"{self.path}: shard ended early while reading tensor {name!r} (truncated file; download it again)"
                )
            got += n

    def __del__(self) -> None:
        os.close(self.fd)


_CHUNK_BYTES = 64 << 20  # one pwrite task: large tensors are written by several threads at once


class _PendingFile:
    """A safetensors file whose header is written and whose tensors are being written by a pool."""

    def __init__(self, path: Path, tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None, pool: Executor):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, t in tensors:
            out_dtype = _out_dtype(t, dtype)
            n = t.numel() * out_dtype.itemsize
            header[name] = {"dtype": _ST_DTYPES[out_dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the format wants the data aligned to 8 bytes
        self.nbytes = 8 + len(blob) + offset
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.futures: list[Future[None]] = []
        try:
            _pwrite_all(self.fd, memoryview(struct.pack("<Q", len(blob)) + blob), 0)
            for name, t in tensors:
                pos = 8 + len(blob) + header[name]["data_offsets"][0]
                for part, at in _row_chunks(t, _out_dtype(t, dtype)):
                    self.futures.append(pool.submit(_write_part, self.fd, part, _out_dtype(t, dtype), pos + at))
        except BaseException:
            self.abort()
            raise

    def finish(self) -> int:
        """Wait for every part, fsync and close; returns the file's size."""
        try:
            for fut in self.futures:
                fut.result()
            os.fsync(self.fd)
        except BaseException:
            self.abort()
            raise
        os.close(self.fd)
        return self.nbytes

    def abort(self) -> None:
        for fut in self.futures:
            fut.cancel()
        wait(self.futures)
        os.close(self.fd)


def _row_chunks(t: torch.Tensor, out_dtype: torch.dtype) -> Iterator[tuple[torch.Tensor, int]]:
    """(view, byte offset in the tensor's data) pieces of about _CHUNK_BYTES, cut along the first dim."""
    if t.dim() == 0 or t.numel() == 0:
        yield t, 0
        return
    row_bytes = t[0].numel() * out_dtype.itemsize
    rows = max(1, _CHUNK_BYTES // max(1, row_bytes))
    for r in range(0, t.shape[0], rows):
        yield t[r : r + rows], r * row_bytes


def _write_part(fd: int, part: torch.Tensor, out_dtype: torch.dtype, pos: int) -> None:
    # The cast (and the copy from a GPU) happens here, one piece at a time: a shard never costs a
    # second copy of the model.
    data = part.detach().to(device="cpu", dtype=out_dtype).contiguous()
    if data.numel():
        _pwrite_all(fd, _byte_view(data), pos)


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, for preadv / pwrite. Not through `.numpy()`: that marks the
    storage non-resizable for good, and these are often parameters, which offload frees with
    `storage.resize_(0)`. The tensor must outlive the view."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")


def _pwrite_all(fd: int, view: memoryview, pos: int) -> None:
    while view:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n


def write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> int:
    """Write one safetensors file from (name, tensor) pairs, casting floating tensors to `dtype` piece
    by piece as they are written (no copy of the whole shard in memory); returns bytes written."""
    with ThreadPoolExecutor(io_workers(), thread_name_prefix="trinity-write") as pool:
        return _PendingFile(path, list(tensors), dtype, pool).finish()


def _out_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def write_shards(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: Path,
    *,
    dtype: torch.dtype | None,
    max_shard_bytes: int = 4 << 30,
    on_tensor: Any = None,
) -> tuple[int, dict[str, str]]:
    """Stream tensors into `model-0000x-of-0000y.safetensors` + index in `out_dir`; returns bytes, map.

    Every shard's tensors are written in pieces by a thread pool (pwrite at their header offsets) while
    the next shard is collected; at most two shards are in flight, so the references they hold (views
    of parameters, or fresh tensors gathered from other ranks) stay bounded.
    """
    shard: list[tuple[str, torch.Tensor]] = []
    shard_bytes = 0
    files: list[tuple[Path, list[str]]] = []
    in_flight: deque[_PendingFile] = deque()
    written = 0
    seen: set[str] = set()
    pool = ThreadPoolExecutor(io_workers(), thread_name_prefix="trinity-write")

    def flush() -> None:
        nonlocal shard, shard_bytes, written
        if not shard:
            return
        tmp = out_dir / f"shard-{len(files) + 1:05d}.tmp"
        in_flight.append(_PendingFile(tmp, shard, dtype, pool))
        files.append((tmp, [n for n, _ in shard]))
        shard, shard_bytes = [], 0
        while len(in_flight) > 1:
            written += in_flight.popleft().finish()

    try:
        for name, t in tensors:
            if name in seen:
                raise RuntimeError(f"tensor {name!r} exported twice")
            seen.add(name)
            n = t.numel() * _out_dtype(t, dtype).itemsize
            if shard and shard_bytes + n > max_shard_bytes:
                flush()
            shard.append((name, t))
            shard_bytes += n
            if on_tensor is not None:
                on_tensor(name, n)
        flush()
        while in_flight:
            written += in_flight.popleft().finish()
    except BaseException:
        while in_flight:
            in_flight.popleft().abort()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    weight_map: dict[str, str] = {}
    for i, (tmp, names) in enumerate(files, start=1):
        final = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        tmp.rename(out_dir / final)
        weight_map.update({n: final for n in names})
    index = {"metadata": {"total_size": written}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return written, weight_map


def copy_side_files(src: Path, dst: Path, *, skip: Iterable[str] = ()) -> list[str]:
    """Copy config/tokenizer/generation files that exist in `src` into `dst`; returns their names."""
    import shutil

    copied = []
    for name in HF_SIDE_FILES:
        if name in skip:
            continue
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def iter_names_sorted(names: Iterable[str]) -> Iterator[str]:
    """HF names in a natural order (layer numbers numerically), for stable shard contents."""
    import re

    def key(n: str) -> list[Any]:
        return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)]

    return iter(sorted(names, key=key))
