"""The one definition of trinity's dist checkpoint format (megatron-core `dist_checkpointing`, torch_dist).

Folder layout:
    <dir>/                      megatron-core torch_dist files (`__*.distcp`, metadata.json, common.pt)
    <dir>/trinity_meta.json     architecture, HF config, dtype, layout, source fingerprint
    <dir>/hf/                   config.json, tokenizer and generation files of the source model

State dict layout (the same for every TP/PP/VPP/EP layout, so any layout loads any other):
    {"model": {"chunk<i>/<local key>": ShardedTensor...},  # data addressed by global sharded keys
     "optimizer": ...,                              # only when an optimizer is passed (training)
     "extra": {...}}                                # `extra_common`: plain objects saved by rank 0

The tensors' data is addressed by megatron-core's global sharded keys and offsets (layer numbers
are global), so the chunk structure of a VPP layout never appears in the data. Writes go to a temporary sibling folder renamed at
the end; a failure leaves no output folder.
"""

from __future__ import annotations

import json
import queue
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from trinity.convert.fingerprint import source_fingerprint
from trinity.convert.hf_io import copy_side_files
from trinity.convert.outdir import check_output, publish, temp_sibling
from trinity.distributed import collectives
from trinity.errors import UserError
from trinity.launch.child import forks_die_with_this_process
from trinity.models.build import unwrap

META = "trinity_meta.json"
HF_SUBDIR = "hf"
FORMAT = "trinity-mcore-dist/1"


def _flat_sharded(models: list[torch.nn.Module]) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """All chunks' sharded tensors in one flat dict, plus, per chunk, local state-dict key -> flat key.

    Only sharded values are kept: their data is addressed by megatron-core's global sharded key and
    offsets, never by the dict key, so the dict keys (which name the chunk) do not tie the checkpoint
    to a VPP layout. Plain objects would be, and GPTModel has none worth keeping.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    flat: dict[str, Any] = {}
    back: list[dict[str, str]] = []
    for i, chunk in enumerate(models):
        local_to_key: dict[str, str] = {}
        for local, value in unwrap(chunk).sharded_state_dict().items():
            if isinstance(value, ShardedBase):
                flat[f"chunk{i}/{local}"] = value
                local_to_key[local] = f"chunk{i}/{local}"
        back.append(local_to_key)
    return flat, back


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    collectives.barrier()


def _broadcast(obj: Any) -> Any:
    return collectives.broadcast_object(obj, src=0)


def _save_strategy() -> Any:
    """megatron-core's torch_dist writer with `io_workers()` writer processes (one file each) instead of
    its default 2: the H100 machine's disk took 1.76 GB/s from 2 streams and 2.06 GB/s from 4
    (benchmarks/convert.py's floors), and the 7B save took 9.95-13.2 s with 8 writers."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from trinity.convert.parallel_io import io_workers

    if filesystem_async._results_queue is None:
        # The writer hands its results over through a queue that megatron makes, on first use, in a
        # spawned Manager process, which must import torch to unpickle them: the first save of a
        # process took 10 s longer than the next on the H100 machine (2.5 s on a 2-core CPU box).
        # trinity saves synchronously, so the writer runs in this process and a plain queue does.
        filesystem_async._results_queue = queue.Queue()
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=io_workers())


def _parallel_reader(checkpoint_dir: Any, cache_metadata: bool = False) -> Any:
    """A torch_dist reader whose items are read by a pool of threads, and whose index `.metadata` is
    read by `_read_index` (allow-listed types only: torch's reader unpickles it with plain pickle).

    torch's FileSystemReader reads every item of the plan in one thread (a 15 GB 7B checkpoint loaded
    at 1.4 GB/s on the H100 machine, whose page cache reads at 16-20 GB/s with 8 streams). The pool runs
    that same reader on shares of the plan balanced by bytes; torch.load and the copies release the
    GIL. The planner is shared: megatron's only keeps per-item state for TransformerEngine FP8
    tensors, which trinity never saves.
    """
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )
    from torch.distributed.checkpoint.metadata import StorageMeta

    from trinity.convert.parallel_io import io_workers

    class ParallelReader(CachedMetadataFileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if self._cached_metadata is None:
                index = _read_index(Path(self.path))
                # What torch's FileSystemReader.read_metadata adds to the index it read.
                if getattr(index, "storage_meta", None) is None:
                    index.storage_meta = StorageMeta()
                index.storage_meta.load_id = self.load_id
                self._cached_metadata = index
            return self._cached_metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            n = min(io_workers(), max(1, len(plan.items)))
            shares: list[list[Any]] = [[] for _ in range(n)]
            loads = [0] * n
            for item in sorted(plan.items, key=lambda i: -self.storage_data[i.storage_index].length):
                k = loads.index(min(loads))
                shares[k].append(item)
                loads[k] += self.storage_data[item.storage_index].length
            read = super().read_data
            with ThreadPoolExecutor(n, thread_name_prefix="trinity-ckpt-read") as pool:
                for fut in [pool.submit(read, dataclasses.replace(plan, items=share), planner) for share in shares]:
                    fut.result().wait()
            done: torch.futures.Future[None] = torch.futures.Future()
            done.set_result(None)
            return done

    return ParallelReader(checkpoint_dir)


def _safe_planner(base: type, ckpt_dir: Path) -> type:
    """megatron's load planner, with byte items (ShardedObjects megatron torch.save'd into a `.distcp`)
    loaded weights-only: torch's DefaultLoadPlanner.load_bytes unpickles them with weights_only=False."""
    from torch.distributed.checkpoint._traverse import set_element

    from trinity.convert.safe_pickle import load_weights_only

    class SafePlanner(base):  # type: ignore[misc, valid-type]
        def load_bytes(self, read_item: Any, value: Any) -> None:
            fqn = read_item.dest_index.fqn
            info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata else None
            where = f"{ckpt_dir / info.relative_path} (item {fqn})" if info else f"{ckpt_dir} (item {fqn})"
            obj = load_weights_only(value, where)
            if self.flatten_state_dict:  # the same placement as torch's load_bytes
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafePlanner


def _load_strategy() -> Any:
    """megatron-core's torch_dist loader, reading with `_parallel_reader` and `_safe_planner`."""
    from megatron.core.dist_checkpointing.strategies import torch as mtorch

    from trinity.compat.scoped import replaced

    class Strategy(mtorch.TorchDistLoadShardedStrategy):
        def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
            planner = _safe_planner(mtorch.MCoreLoadPlanner, Path(checkpoint_dir))
            with replaced("dist_ckpt reader", mtorch, _get_filesystem_reader=_parallel_reader, MCoreLoadPlanner=planner):
                return super().load(sharded_state_dict, checkpoint_dir)

        def load_tensors_metadata(self, checkpoint_dir: Any, metadata: Any = None) -> Any:
            with replaced("dist_ckpt reader", mtorch, _get_filesystem_reader=_parallel_reader):
                return super().load_tensors_metadata(checkpoint_dir, metadata)

        def load_sharded_metadata(self, checkpoint_dir: Any) -> Any:
            with replaced("dist_ckpt reader", mtorch, _get_filesystem_reader=_parallel_reader):
                return super().load_sharded_metadata(checkpoint_dir)

    return Strategy()


def _common_strategy() -> Any:
    """megatron-core's common.pt loader, weights-only whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says
    (megatron's own calls torch.load without the argument)."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class Common(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir: Any) -> Any:
            return _read_common(Path(checkpoint_dir))

    return Common()


def _read_common(path: Path) -> dict[str, Any]:
    from trinity.convert.safe_pickle import load_tensor_dict

    return load_tensor_dict(path / "common.pt")


def read_sharded(request: dict[str, Any], ckpt_dir: str | Path) -> dict[str, Any]:
    """megatron-core's `dist_checkpointing.load` of `request` with trinity's readers: items read in
    parallel, and nothing in the checkpoint unpickled beyond tensors, plain values and the index
    (trinity.convert.safe_pickle)."""
    from megatron.core import dist_checkpointing

    return dict(dist_checkpointing.load(request, str(ckpt_dir), sharded_strategy=_load_strategy(),
                                        common_strategy=_common_strategy()))


def save_model_checkpoint(
    models: list[torch.nn.Module],
    ckpt_dir: str | Path,
    *,
    hf_dir: str | Path | None = None,
    meta: dict[str, Any] | None = None,
    extra_common: dict[str, Any] | None = None,
    optimizer: Any = None,
    force: bool = False,
    exclude: tuple[str, ...] = (),
) -> Path:
    """Save model chunks (and optionally a megatron-core optimizer) as a dist checkpoint. All ranks call.

    hf_dir: the source HF folder, whose config and tokenizer files are copied into `<ckpt_dir>/hf/`
    and whose config.json goes into trinity_meta.json (needed by mcore-to-hf).
    meta: extra fields for trinity_meta.json (layout, dtype, source...); rank 0's copy is written.
    extra_common: plain picklable objects (step, RNG, data position...) saved once by rank 0;
    read back by `load_model_checkpoint(...)` or `read_extra(dir)`.
    optimizer: a megatron-core MegatronOptimizer; its `sharded_state_dict` is saved under "optimizer".
    exclude: sharded keys not to save (a LoRA job's frozen base weights: they come from its weight source).
    """
    from megatron.core import dist_checkpointing

    out = Path(ckpt_dir).resolve()
    tmp: Path | None = None
    if _rank() == 0:
        check_output(out, force, sources=() if hf_dir is None else (hf_dir,), inside_ok=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_sibling(out)
        tmp.mkdir()
    tmp = Path(_broadcast(str(tmp)))
    try:
        flat, _ = _flat_sharded(models)
        flat = {k: v for k, v in flat.items() if getattr(v, "key", None) not in exclude}
        state: dict[str, Any] = {"model": flat, "extra": dict(extra_common or {})}
        if optimizer is not None:
            state["optimizer"] = optimizer.sharded_state_dict(flat)
        with forks_die_with_this_process():  # megatron's writer processes: none may outlive a stop
            dist_checkpointing.save(state, str(tmp), sharded_strategy=_save_strategy())
        _barrier()
        if _rank() == 0:
            _write_meta(tmp, models, hf_dir, meta, has_optimizer=optimizer is not None)
            publish(tmp, out)
        _barrier()
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_meta(
    tmp: Path, models: list[torch.nn.Module], hf_dir: str | Path | None, meta: dict[str, Any] | None, *, has_optimizer: bool
) -> None:
    params = [p for m in models for p in m.parameters()]
    body: dict[str, Any] = {
        "format": FORMAT,
        "dtype": str(params[0].dtype).removeprefix("torch.") if params else None,
        "has_optimizer": has_optimizer,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if hf_dir is not None:
        hf = Path(hf_dir)
        (tmp / HF_SUBDIR).mkdir()
        copy_side_files(hf, tmp / HF_SUBDIR)
        cfg = json.loads((hf / "config.json").read_text())
        body.update(
            architecture=(cfg.get("architectures") or [None])[0],
            hf_config=cfg,
            source={"path": str(hf.resolve()), "fingerprint": source_fingerprint(hf)},
        )
    body.update(meta or {})
    (tmp / META).write_text(json.dumps(body, indent=2, default=str) + "\n")


def read_meta(ckpt_dir: str | Path) -> dict[str, Any]:
    """trinity_meta.json of a dist checkpoint; UserError naming the file if it is missing or bad."""
    path = Path(ckpt_dir) / META
    if not path.is_file():
        raise UserError(f"{path}: not a trinity dist checkpoint (no {META}; write one with `trinity convert hf-to-mcore`)")
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{path}: unknown checkpoint format {meta.get('format')!r} (expected {FORMAT})")
    return meta


# What megatron-core's torch_dist format always writes besides the `*.distcp` data files.
_DIST_FILES = ("metadata.json", ".metadata", "common.pt")


def check_readable(ckpt_dir: str | Path) -> None:
    """Cheap integrity check of a megatron-core torch_dist checkpoint folder (any writer, trinity's or
    not), reading no tensor data: the folder and its `metadata.json`, `.metadata` (torch's index of
    every stored item) and `common.pt` must exist and parse, and every `*.distcp` file the index
    refers to must exist and be long enough for the items in it. A checkpoint cut by a crash, a full
    disk or a partial copy fails here. Raises UserError naming the folder and the first bad file; the
    trainer's resume uses it to skip to an older complete checkpoint.

    Bytes garbled inside a data file are only found when read (`load_model_checkpoint` then names the
    file too)."""
    path = Path(ckpt_dir)
    if not path.is_dir():
        raise UserError(f"{path}: dist checkpoint folder does not exist")
    for name in _DIST_FILES:
        if not (path / name).is_file():
            raise UserError(f"{path}: not a complete megatron-core dist checkpoint (no {name} in it)")
    try:
        config = json.loads((path / "metadata.json").read_text())
        backend = config.get("sharded_backend")
    except (OSError, ValueError, AttributeError) as exc:
        raise UserError(f"{path}: corrupt or truncated dist checkpoint file metadata.json ({exc})") from None
    if backend != "torch_dist":
        raise UserError(f"{path}: dist checkpoint backend {backend!r} is not supported (only torch_dist)")
    index = _read_index(path)
    ends: dict[str, int] = {}
    for info in index.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in sorted(ends.items(), key=lambda kv: str(kv[0])):
        _check_data_file_name(path, rel)
        f = path / rel
        if not f.is_file():
            raise UserError(f"{path}: dist checkpoint file {rel} is missing")
        size = f.stat().st_size
        if size < end:
            raise UserError(f"{path}: dist checkpoint file {rel} is truncated ({size} bytes, its items need {end})")
    _check_zip(path, "common.pt", (path / "common.pt").read_bytes())


def _check_data_file_name(path: Path, rel: object) -> None:
    """The index is data: a data file it names must be a file name inside the checkpoint folder (torch
    writes `__<rank>_<n>.distcp`), or loading would read any file the user can read into the weights."""
    if not isinstance(rel, str) or Path(rel).name != rel or rel in ("", ".", ".."):
        raise UserError(
            f"{path}: the dist checkpoint index (.metadata) names data file {rel!r} outside the checkpoint "
            "folder; it was not written by megatron-core"
        )


def _read_index(path: Path) -> Any:
    """torch's checkpoint index (`.metadata`, a pickle of what each `*.distcp` file holds where), built
    from allow-listed types only (trinity.convert.safe_pickle)."""
    from trinity.convert.safe_pickle import load_dcp_index

    try:
        index = load_dcp_index(path / ".metadata")
        index.storage_data.items()
    except UserError:
        raise
    except Exception as exc:  # a cut pickle raises EOFError, UnpicklingError, AttributeError...
        raise UserError(f"{path}: corrupt or truncated dist checkpoint file .metadata ({type(exc).__name__}: {exc})") from None
    return index


def _check_zip(path: Path, name: str, blob: bytes) -> None:
    """`blob` (a torch.save archive from file `name`) must be a complete, CRC-correct zip."""
    import io
    import zipfile

    try:
        bad = zipfile.ZipFile(io.BytesIO(blob)).testzip()
        bad = None if bad is None else f"bad checksum of {bad}"
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
        bad = str(exc)
    if bad is not None:
        raise UserError(f"{path}: corrupt or truncated dist checkpoint file {name} ({bad})")


def _find_corrupt_file(path: Path) -> None:
    """After a failed load: read every stored item and raise UserError naming the first file whose
    bytes are not what torch.save wrote (slow, a full read: only used to explain a failure)."""
    check_readable(path)
    index = _read_index(path)
    handles: dict[str, Any] = {}
    try:
        for info in sorted(index.storage_data.values(), key=lambda i: (i.relative_path, i.offset)):
            f = handles.get(info.relative_path)
            if f is None:
                f = handles[info.relative_path] = open(path / info.relative_path, "rb")
            f.seek(info.offset)
            blob = f.read(info.length)
            if blob[:2] == b"PK" or not getattr(info, "transform_descriptors", None):
                _check_zip(path, info.relative_path, blob)
    finally:
        for f in handles.values():
            f.close()


def hf_dir_of(ckpt_dir: str | Path) -> Path:
    """The HF config/tokenizer folder saved inside a dist checkpoint."""
    path = Path(ckpt_dir) / HF_SUBDIR
    if not (path / "config.json").is_file():
        raise UserError(f"{path / 'config.json'}: missing from the dist checkpoint")
    return path


def read_extra(ckpt_dir: str | Path) -> dict[str, Any]:
    """The `extra_common` dict saved with the checkpoint (no model needed)."""
    failure: BaseException | None = None
    try:
        return dict(_read_common(Path(ckpt_dir)).get("extra", {}))
    except UserError:
        raise
    except Exception as exc:  # a cut common.pt raises RuntimeError, EOFError, zip errors...
        failure = exc
    check_readable(ckpt_dir)  # names the missing or damaged file
    raise UserError(f"{ckpt_dir}: cannot read the dist checkpoint's common.pt ({_short(failure)})")


def load_model_checkpoint(
    models: list[torch.nn.Module],
    ckpt_dir: str | Path,
    *,
    strict: bool = True,
    optimizer: Any = None,
    exclude: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Load a dist checkpoint into built model chunks of any layout (resharding as needed), and the
    optimizer state when `optimizer` is given. All ranks call. Returns the saved `extra_common` ({} for
    a checkpoint trinity did not write).

    Any megatron-core torch_dist checkpoint of the same model loads, trinity's or not (e.g. verl's
    converter_hf_to_mcore.py): the tensors are addressed by GPTModel's sharded-state-dict keys, which
    are the same for the local and the TransformerEngine layer specs. Before any data is read, the
    checkpoint's keys and global shapes are compared with the model's (UserError naming the missing,
    unexpected or mismatched keys). `exclude`: sharded keys not to load (a critic skips
    `output_layer.weight`).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(ckpt_dir)
    check_readable(path)
    if (path / META).exists():
        read_meta(path)
    stored = _stored_metadata(path)
    flat, back = _flat_sharded(models)
    flat = {k: v for k, v in flat.items() if getattr(v, "key", None) not in exclude}
    check_matches_model(path, models, stored, exclude=exclude)
    # Per-layer `_extra_state` objects (TransformerEngine FP8 scales; empty for the local spec) are
    # loaded when the checkpoint has them: writers differ there, and none of them carries weights.
    flat = {k: v for k, v in flat.items() if not isinstance(v, ShardedObject) or v.unique_key in stored}
    request: dict[str, Any] = {"model": flat}
    if optimizer is not None:
        request["optimizer"] = optimizer.sharded_state_dict(flat, is_loading=True)
    failure: BaseException | None = None
    try:
        loaded = read_sharded(request, path)
    except (KeyError, ValueError, RuntimeError, OSError, EOFError, CheckpointException) as exc:
        failure = exc
    if failure is not None:  # outside the except block: the one-line error has no chained traceback
        refusal = _first_failure(failure)
        if isinstance(refusal, UserError):  # a refused item, raised inside torch's reader threads
            raise UserError(str(refusal))
        _find_corrupt_file(path)  # raises UserError naming the file when its bytes are bad
        raise UserError(f"{path}: cannot load the dist checkpoint into this model ({_short(failure)})")
    for chunk, local_to_key in zip(models, back):
        sd = {local: loaded["model"][key] for local, key in local_to_key.items() if key in loaded["model"]}
        result = unwrap(chunk).load_state_dict(sd, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state") and k not in _excluded(chunk, exclude)]
        if strict and missing:
            raise UserError(f"{path}: checkpoint has no value for model parameter {missing[0]!r}")
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    return read_extra(path)


def _excluded(chunk: torch.nn.Module, exclude: tuple[str, ...]) -> set[str]:
    """Local state-dict names of `chunk` whose sharded key is in `exclude`."""
    if not exclude:
        return set()
    return {local for local, v in unwrap(chunk).sharded_state_dict().items() if getattr(v, "key", None) in exclude}


def _first_failure(exc: BaseException) -> BaseException:
    """The exception itself, or the first rank's failure that torch's CheckpointException wraps."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        failures = getattr(exc, "failures", {}) or {}
        exc = next(iter(failures.values()), exc)
        if isinstance(exc, tuple):  # (exception, traceback frames) in recent torch
            exc = exc[0]
    return exc


def _short(exc: BaseException) -> str:
    """One line of an exception: torch's CheckpointException holds per-rank tracebacks."""
    text = " ".join(str(_first_failure(exc)).split())
    return text[:300] + ("..." if len(text) > 300 else "")


def _stored_metadata(path: Path) -> dict[str, Any]:
    """The checkpoint's sharded keys (ShardedObjects by `unique_key`) -> metadata with global shapes."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    try:
        return dict(load_sharded_metadata(str(path), _load_strategy(), _common_strategy()))
    except UserError:
        raise
    except Exception as exc:  # megatron wraps reader errors in several types
        raise UserError(f"{path}: cannot read the dist checkpoint's metadata ({_short(exc)})") from None


def _model_tensors(models: list[torch.nn.Module]) -> dict[str, Any]:
    """Sharded key -> ShardedTensor (factories applied, as megatron does before loading) of the model."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    flat, _ = _flat_sharded(models)  # a fresh dict: apply_factories replaces its values in place
    apply_factories(flat)
    return {t.key: t for t in nested_values(flat) if isinstance(t, ShardedTensor)}


def check_matches_model(
    ckpt_dir: str | Path, models: list[torch.nn.Module], stored: dict[str, Any] | None = None, *,
    exclude: tuple[str, ...] = (),
) -> None:
    """The checkpoint's tensors are this model's: every model key is stored with the model's global
    shape, and no other model tensor is stored (optimizer state of a training checkpoint is allowed).
    The vocabulary-padded embedding and output layer may differ in rows: megatron-core pads or trims
    them on load. UserError naming the first few offending keys and their count."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    path = Path(ckpt_dir)
    if stored is None:
        stored = _stored_metadata(path)
    ours = {k: t for k, t in _model_tensors(models).items() if k not in exclude}
    theirs = {k: v for k, v in stored.items() if isinstance(v, ShardedTensor)}
    # Each rank checks its own chunks. Per-layer keys are the same on every pipeline stage (layers are
    # stacked along a global first axis); only the embedding (first stage), final norm and output layer
    # (last stage) live on some ranks, so their absence elsewhere is expected (`_other_stage_key`).
    missing = sorted(k for k in ours if k not in theirs)
    # Vocabulary rows may differ (megatron-core pads or trims them on load), but only for a tensor that
    # has the model's padded vocabulary as rows: a critic's [1, hidden] value head is not an LM head.
    vocab = {getattr(unwrap(m), "vocab_size", None) for m in models}

    def same(mine: tuple[int, ...], stored: tuple[int, ...], padded: bool) -> bool:
        if mine == stored:
            return True
        return padded and len(mine) == len(stored) and mine[1:] == stored[1:] and mine[0] in vocab

    shapes = sorted(
        f"{k} {list(theirs[k].global_shape)} vs model {list(t.global_shape)}"
        for k, t in ours.items()
        if k in theirs and not same(tuple(t.global_shape), tuple(theirs[k].global_shape), t.allow_shape_mismatch)
    )
    unexpected = sorted(
        k for k in theirs
        if k not in ours and k not in exclude and not k.startswith("optimizer.") and not _other_stage_key(k, ours)
    )
    problems = []
    for what, keys in (("missing from the checkpoint", missing), ("shape differs", shapes),
                       ("not in the model", unexpected)):
        if keys:
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            problems.append(f"{len(keys)} {what}: {', '.join(keys[:3])}{more}")
    if problems:
        raise UserError(
            f"{path}: the dist checkpoint does not match the model ({'; '.join(problems)}); "
            "it was written for another model or model config"
        )


def _other_stage_key(key: str, ours: dict[str, Any]) -> bool:
    """A key that another pipeline stage of this model holds (embedding on the first, final norm and
    output layer on the last), so its absence from this rank's chunks is expected."""
    from megatron.core import parallel_state as ps

    try:
        pp = ps.get_pipeline_model_parallel_world_size()
    except (AssertionError, AttributeError, RuntimeError):
        pp = 1
    return pp > 1 and key in ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight")
