"""The one place trinity unpickles anything read from a file: checkpoints and model folders are data, so
nothing in them may run code.

Two kinds of pickle are read:
- torch.save archives (a dist checkpoint's `common.pt` and its byte items, the RNG state files,
  `pytorch_model*.bin`): torch's own restricted unpickler, `torch.load(weights_only=True)`, which builds
  tensors, containers and plain values only. The argument is passed explicitly: then
  TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD cannot turn it off.
- torch.distributed.checkpoint's index `.metadata`, a plain pickle of dataclasses that weights_only does
  not admit: `_IndexUnpickler` admits exactly the globals megatron-core's `dist_checkpointing.save`
  writes there (listed from a real checkpoint of this project, see `_INDEX_GLOBALS`) and torch dtypes.

A file that holds anything else is refused with one line naming it (`refused`), before any of its
objects is built.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from trinity.errors import UserError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

# Every global a `.metadata` written by megatron-core's torch_dist save references (torch 2.13): its
# dataclasses and enums, torch.Size and the layout lookup. Constructing any of them runs no code
# beyond setting fields. A newer torch that pickles another class there fails with `refused`
# naming it; add it here after checking that building it only stores data.
_INDEX_GLOBALS = frozenset({
    "torch.Size",
    "torch.serialization._get_layout",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.planner.SavePlan",
    "torch.distributed.checkpoint.planner.TensorWriteData",
    "torch.distributed.checkpoint.planner.WriteItem",
    "torch.distributed.checkpoint.planner.WriteItemType",
})

# The text after which torch's weights_only error names the global it refused.
_TORCH_REFUSED_GLOBAL = re.compile(r"GLOBAL (\S+)")


def refused(where: str | Path, what: str, global_name: str) -> UserError:
    """The one-line refusal of a file holding Python objects beyond `what`."""
    return UserError(
        f"{where}: refused to load: it holds Python objects other than {what} ({global_name}); "
        "it was not written by trinity or megatron-core, and trinity never runs code from a file"
    )


class _Refused(pickle.UnpicklingError):
    """A global outside the allow-list; carries its module-qualified name."""


def _is_torch_dtype(module: str, name: str) -> bool:
    """`torch.<name>` is a dtype (a checkpoint's tensors may have any of them; a dtype is not callable)."""
    if module != "torch":
        return False
    import torch

    return isinstance(getattr(torch, name, None), torch.dtype)


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        if qualified in _INDEX_GLOBALS or _is_torch_dtype(module, name):
            return super().find_class(module, name)
        raise _Refused(qualified)


def load_dcp_index(path: Path) -> "Metadata":
    """torch.distributed.checkpoint's `.metadata` at `path`, built from allow-listed types only.

    UserError (`refused`) for a global outside the list; a cut or garbled file raises what pickle
    raises (EOFError, UnpicklingError...), for the caller to name as damaged."""
    from torch.distributed.checkpoint.metadata import Metadata

    with open(path, "rb") as f:
        try:
            index = _IndexUnpickler(f).load()
        except _Refused as exc:
            raise refused(path, "a dist checkpoint index", str(exc)) from None
    if not isinstance(index, Metadata):
        raise UserError(f"{path}: not a dist checkpoint index (it holds a {type(index).__name__}); "
                        "it was not written by megatron-core")
    return index


def load_weights_only(source: str | Path | IO[bytes], where: str | Path, *, mmap: bool = False) -> object:
    """`torch.load(weights_only=True)` of a file or stream (`where` names it in errors), on CPU.

    UserError (`refused`) when the pickle holds anything but tensors and plain values; a damaged
    archive raises what torch raises, for the caller to name as damaged."""
    import torch

    if isinstance(source, Path):
        source = str(source)
    try:
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        found = _TORCH_REFUSED_GLOBAL.search(str(exc))
        raise refused(where, "tensors and plain values", found.group(1) if found else "weights_only") from None


def load_tensor_dict(path: Path, *, mmap: bool = False) -> dict[str, Any]:
    """A torch.save file that must hold a dict (common.pt, an RNG state, pytorch_model.bin)."""
    loaded = load_weights_only(path, path, mmap=mmap)
    if not isinstance(loaded, dict):
        raise UserError(f"{path}: holds a {type(loaded).__name__}, not a dict of tensors; it was not written by "
                        "trinity, megatron-core or transformers")
    return loaded

