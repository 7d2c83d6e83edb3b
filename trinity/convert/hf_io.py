"""Reading HF checkpoints tensor by tensor and writing sharded safetensors folders.

Reading validates every shard header with `safe_open`, then preads one tensor at a time into a fresh
buffer (no mmap, so shard pages never count against the process), so a loader
holds the model plus the tensor in flight. `.bin` shards go through `torch.load(weights_only=True,
mmap=True)`; nothing else is unpickled. Writing streams tensors into shards with our own safetensors
writer (header, then each tensor's bytes straight from its storage), so no shard is ever built as one
big buffer in memory.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

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
        self._validate()
        self._open_name: str | None = None
        self._open: Any = None

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
                return wm
        files = sorted(self.folder.glob("*.safetensors")) or sorted(self.folder.glob("pytorch_model*.bin"))
        if not files:
            raise UserError(f"{self.folder}: no *.safetensors (or pytorch_model*.bin) weight files")
        wm: dict[str, str] = {}
        for f in files:
            for name in self._read_names(f):
                wm[name] = f.name
        return wm

    def _read_names(self, path: Path) -> dict[str, tuple[int, ...]]:
        """Tensor names and shapes of one shard; UserError naming the file if it is missing or corrupt."""
        if not path.is_file():
            raise UserError(f"{path}: weight shard listed in the index does not exist")
        try:
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(path), framework="pt") as f:
                    return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            return {k: tuple(v.shape) for k, v in sd.items()}
        except UserError:
            raise
        except Exception as exc:  # safetensors raises its own error type for truncated/corrupt files
            raise UserError(f"{path}: corrupt or truncated weight shard ({exc})") from None

    def _validate(self) -> None:
        by_file: dict[str, list[str]] = {}
        for name, fname in self.weight_map.items():
            by_file.setdefault(fname, []).append(name)
        for fname, names in by_file.items():
            shapes = self._read_names(self.folder / fname)
            for name in names:
                if name not in shapes:
                    raise UserError(f"{self.folder / fname}: tensor {name!r} listed in the index is missing")
                self._shapes[name] = shapes[name]

    def names(self) -> list[str]:
        return list(self.weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def get(self, name: str) -> torch.Tensor:
        """One tensor, copied out of its shard (the shard handle stays open until another is needed)."""
        fname = self.weight_map.get(name)
        if fname is None:
            raise UserError(f"{self.folder}: tensor {name!r} is not in the checkpoint")
        if self._open_name != fname:
            self.close()
            path = self.folder / fname
            if fname.endswith(".safetensors"):
                self._open = _SafetensorsFile(path)
            else:
                self._open = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            self._open_name = fname
        if isinstance(self._open, dict):
            return self._open[name].clone()
        return self._open.read(name)

    def close(self) -> None:
        # Dropping the handle unmaps the shard, so its pages stop counting against this process.
        self._open = None
        self._open_name = None

    def total_bytes(self) -> int:
        return sum((self.folder / f).stat().st_size for f in set(self.weight_map.values()))


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
        view = memoryview(buf)
        got = 0
        while got < len(buf):
            n = os.preadv(self.fd, [view[got:]], self.data_start + begin + got)
            if n <= 0:
                raise UserError(
                    f"{self.path}: shard ended early while reading tensor {name!r} (truncated file; download it again)"
                )
            got += n
        dtype = _FROM_ST[info["dtype"]]
        if not buf:
            return torch.empty(info["shape"], dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(info["shape"])

    def __del__(self) -> None:
        os.close(self.fd)


def write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> int:
    """Write one safetensors file from (name, tensor) pairs, casting floating tensors to `dtype` one at
    a time as they are written (no copy of the whole shard in memory); returns bytes written."""
    tensors = [(n, t) for n, t in tensors]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors:
        out_dtype = _out_dtype(t, dtype)
        n = t.numel() * out_dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[out_dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format wants the data aligned to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, t in tensors:
            t = t.detach().to(device="cpu", dtype=_out_dtype(t, dtype)).contiguous()
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b"")
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(blob) + offset


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
    """Stream tensors into `model-0000x-of-0000y.safetensors` + index in `out_dir`; returns bytes, map."""
    shard: list[tuple[str, torch.Tensor]] = []
    shard_bytes = 0
    files: list[tuple[Path, list[str]]] = []
    written = 0
    seen: set[str] = set()

    def flush() -> None:
        nonlocal shard, shard_bytes, written
        if not shard:
            return
        tmp = out_dir / f"shard-{len(files) + 1:05d}.tmp"
        written += write_safetensors(tmp, shard, dtype)
        files.append((tmp, [n for n, _ in shard]))
        shard, shard_bytes = [], 0

    for name, t in tensors:
        if name in seen:
            raise RuntimeError(f"tensor {name!r} exported twice")
        seen.add(name)
        # Shards hold references (mostly views of the model's parameters); the cast happens per tensor
        # while writing, so a shard never costs a second copy of the model.
        n = t.numel() * _out_dtype(t, dtype).itemsize
        if shard and shard_bytes + n > max_shard_bytes:
            flush()
        shard.append((name, t))
        shard_bytes += n
        if on_tensor is not None:
            on_tensor(name, n)
    flush()
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
