"""What each rank of a conversion runs, plus the HF folder writer and the post-conversion checks.

`api` calls these in-process (world size 1) or through `trinity.convert.worker` under torchrun.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from trinity.convert.options import megatron_config, torch_dtype
from trinity.convert.report import ConvertReport, dir_bytes
from trinity.convert.builtin import export_hf_weights, load_hf_weights
from trinity.convert.dist_ckpt import hf_dir_of, load_model_checkpoint, read_meta, save_model_checkpoint
from trinity.convert.hf_io import HFCheckpoint, copy_side_files, write_shards
from trinity.convert.outdir import atomic_dir
from trinity.convert.verify import Diff, compare_folders, compare_logits, hf_logits, mcore_logits, random_tokens
from trinity.distributed import collectives
from trinity.errors import UserError
from trinity.models.facts import ModelFacts


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


@contextlib.contextmanager
def progress(label: str, total_bytes: int) -> Iterator[Callable[[str, int], None]]:
    """A rich progress bar over bytes on rank 0 when stdout is a terminal (a no-op callback elsewhere:
    in a log or a pipe the bar would leave nothing but a blank line where it stopped)."""
    from rich.console import Console

    console = Console()
    if _rank() != 0 or not console.is_terminal:
        yield lambda name, n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    cols = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*cols, transient=True, console=console) as bar:
        task = bar.add_task(label, total=total_bytes)
        yield lambda name, n: bar.update(task, advance=n)


@contextlib.contextmanager
def parallel_session(device: str, megatron: Any) -> Iterator[None]:
    from trinity.distributed.parallel import destroy, init_parallel

    init_parallel(device=device, layout=megatron.layout(), seed=megatron.seed)
    try:
        yield
    finally:
        destroy()


def _build(facts: ModelFacts, megatron: Any, device: str, dtype: torch.dtype) -> list[torch.nn.Module]:
    """Model chunks holding `dtype` parameters. On CPU megatron-core computes in fp32 only, so the model
    is built in fp32 and its parameters are cast afterwards: the checkpoint still stores `dtype`."""
    from trinity.models.build import build_model

    build_dtype = dtype if device != "cpu" else torch.float32
    return build_model(facts, megatron, device=device, dtype=build_dtype)


def _holder(facts: ModelFacts, megatron: Any, dtype: torch.dtype) -> list[torch.nn.Module]:
    """Model chunks that only carry weights between files: `dtype` parameters in host memory, never
    randomly initialised and never run. A conversion moves bytes, so the GPU adds only copies: before
    this, a 7B model went host -> GPU -> host (through a pinned copy of the whole model) on its way
    from HF shards to the dist checkpoint."""
    from trinity.models.build import build_model

    return build_model(facts, megatron, device="cpu", dtype=dtype, weights_only=True)


def run_hf_to_mcore(
    *, hf_path: str, output: str, tp: int, pp: int, vpp: int | None, ep: int, backend: str, dtype: str,
    force: bool, device: str,
) -> ConvertReport:
    """One rank's part of hf-to-mcore (all ranks call it)."""
    megatron = megatron_config(tp=tp, pp=pp, vpp=vpp, ep=ep)
    facts = ModelFacts.from_hf_dir(hf_path)
    start = time.perf_counter()
    phase = _Phases()
    with parallel_session(device, megatron):
        models = _holder(facts, megatron, torch_dtype(dtype))
        phase("build")
        local_bytes = sum(p.numel() * p.element_size() for m in models for p in m.parameters())
        if backend == "mbridge":
            from trinity.convert.mbridge_adapter import load_weights

            load_weights(models, hf_path, facts)
        else:
            with progress("loading HF tensors", local_bytes) as cb:
                load_hf_weights(models, hf_path, facts, progress=cb)
        phase("load")
        layout = {"tp": tp, "pp": pp, "vpp": vpp, "ep": ep}
        save_model_checkpoint(
            models, output, hf_dir=hf_path, force=force,
            meta={"layout": layout, "backend": backend, "family": facts.family},
        )
        phase("save")
        tensors = sum(1 for m in models for _ in m.parameters())
    seconds = time.perf_counter() - start
    return ConvertReport("hf-to-mcore", output, dir_bytes(output), seconds, tensors, phases=phase.seconds)


class _Phases:
    """Seconds since the previous call, by name: `phase("load")` after loading."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self._last, 3)
        self._last = now


def save_hf_folder(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    hf_config_dir: str | Path,
    dtype: torch.dtype | None,
    *,
    force: bool = False,
    on_tensor: Callable[[str, int], None] | None = None,
) -> tuple[int, int]:
    """Write (name, tensor) pairs as a complete HF folder: sharded safetensors + index, config.json
    (dtype updated), tokenizer and generation files from `hf_config_dir`. Atomic. Single process:
    under torchrun call it on rank 0 and drain the export iterator on the others (see
    `save_hf_folder_distributed`). Returns (bytes written, tensors)."""
    count = 0

    def counted(it: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal count
        for pair in it:
            count += 1
            yield pair

    src = Path(hf_config_dir)
    # The config/tokenizer folder is read while the output is written: --force must never replace it.
    with atomic_dir(out_dir, force=force, sources=(src,), inside_ok=True) as tmp:
        written, _ = write_shards(counted(tensors), tmp, dtype=dtype, on_tensor=on_tensor)
        copy_side_files(src, tmp, skip=("config.json",))
        cfg = json.loads((src / "config.json").read_text())
        if dtype is not None:
            name = str(dtype).removeprefix("torch.")
            for key in ("dtype", "torch_dtype"):
                if key in cfg or key == "torch_dtype" and "dtype" not in cfg:
                    cfg[key] = name
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return written, count


def save_hf_folder_distributed(
    models: list[torch.nn.Module], facts: ModelFacts, out_dir: str | Path, hf_config_dir: str | Path,
    dtype: torch.dtype | None, *, force: bool = False,
) -> None:
    """All ranks call: gathers the model and writes the HF folder on rank 0."""
    pairs = export_hf_weights(models, facts)
    if _rank() == 0:
        save_hf_folder(pairs, out_dir, hf_config_dir, dtype, force=force)
    else:
        for _ in pairs:
            pass
    collectives.barrier()


def run_mcore_to_hf(
    mcore_path: str, output: str, *, meta: dict[str, Any], dtype: str | None, verify: bool, force: bool, device: str
) -> ConvertReport:
    """mcore-to-hf in this process (world size 1: dist checkpointing reshards any saved layout)."""
    hf_src = hf_dir_of(mcore_path)
    facts = ModelFacts.from_hf_dir(hf_src)
    ckpt_dtype = torch_dtype(meta.get("dtype") or "float32")
    out_dtype = torch_dtype(dtype) if dtype else ckpt_dtype
    megatron = megatron_config()
    start = time.perf_counter()
    phase = _Phases()
    from trinity.convert.load import load_lora_checkpoint, lora_of

    lora = lora_of(meta)
    with parallel_session(device, megatron), contextlib.ExitStack() as merged:
        models = _holder(facts, megatron, ckpt_dtype)
        phase("build")
        if lora is None:
            load_model_checkpoint(models, mcore_path)
        else:  # a LoRA job's checkpoint: its base model + the adapters, exported merged
            from trinity.models.lora import adapters_merged

            load_lora_checkpoint(models, mcore_path, facts, lora)
            merged.enter_context(adapters_merged(models))
        phase("load")
        total = sum(p.numel() for n, p in models[0].named_parameters() if ".lora." not in n) * out_dtype.itemsize
        with progress("writing HF tensors", total) as cb:
            written, count = save_hf_folder(
                export_hf_weights(models, facts), output, hf_src, out_dtype, force=force, on_tensor=cb
            )
        phase("write")
        seconds = time.perf_counter() - start
        report = ConvertReport("mcore-to-hf", output, written, seconds, count, phases=phase.seconds)
        if verify:
            try:
                diff, what = _verify_export(models, facts, output, meta, ckpt_dtype, out_dtype, device)
            except UserError as e:
                # An export that failed its check is not left behind for someone to load.
                shutil.rmtree(output, ignore_errors=True)
                raise UserError(f"{e} ({output} was removed)") from e
            report.max_abs_diff, report.mean_abs_diff, report.verified = diff.max_abs, diff.mean_abs, what
    return report


def _verify_export(
    models: list[torch.nn.Module], facts: ModelFacts, output: str, meta: dict[str, Any],
    ckpt_dtype: torch.dtype, out_dtype: torch.dtype, device: str,
) -> tuple[Diff, str]:
    if out_dtype == ckpt_dtype:
        # Bit for bit: against the original HF source when it is still there unchanged, and always
        # against the model's own export (what was written is what the checkpoint holds).
        written = HFCheckpoint(output)
        try:
            for name, tensor in export_hf_weights(models, facts):
                if not torch.equal(written.get(name), tensor.to(out_dtype)):
                    raise UserError(f"{output}: tensor {name!r} differs from the dist checkpoint")
        finally:
            written.close()
        source = _untouched_source(meta)
        if source and _same_dtype_source(source, out_dtype):
            compare_folders(output, source, what=output)
            return Diff(0.0, 0.0), f"every tensor bit for bit against {source}"
        return Diff(0.0, 0.0), "every tensor bit for bit against the dist checkpoint"
    # The holder cannot run: the logits come from a float32 model holding the exported (rounded) values.
    model = _build(facts, megatron_config(), device, torch.float32)[0]
    with torch.no_grad():
        held_params = [p for n, p in models[0].named_parameters() if ".lora.lora_" not in n]  # merged already
        for p, held in zip(model.parameters(), held_params, strict=True):
            p.copy_(held.to(out_dtype).float())
    tokens = random_tokens(facts.vocab_size)
    ours = mcore_logits(model, tokens, facts.vocab_size)
    theirs = hf_logits(output, tokens)
    return compare_logits(ours, theirs, what=output), "logits vs transformers (dtype changed)"


def _untouched_source(meta: dict[str, Any]) -> str | None:
    """The HF folder a converted (never trained) checkpoint came from, if it is still there unchanged."""
    source = meta.get("source") or {}
    path = source.get("path")
    if meta.get("kind") == "training" or not path or not Path(path).is_dir():
        return None
    from trinity.convert.fingerprint import source_fingerprint

    return path if source_fingerprint(path) == source.get("fingerprint") else None


def _same_dtype_source(source: str, dtype: torch.dtype) -> bool:
    src = HFCheckpoint(source)
    try:
        first = src.names()[0]
        return src.get(first).dtype == dtype
    finally:
        src.close()


def verify_mcore_against_hf(mcore_path: str, hf_path: str, *, device: str) -> Diff:
    """Logits of the written dist checkpoint (loaded at TP=PP=1) vs transformers on the HF folder."""
    meta = read_meta(mcore_path)
    facts = ModelFacts.from_hf_dir(hf_path)
    ckpt_dtype = torch_dtype(meta.get("dtype") or "float32")
    megatron = megatron_config()
    tokens = random_tokens(facts.vocab_size)
    with parallel_session(device, megatron):
        models = _build(facts, megatron, device, ckpt_dtype)
        load_model_checkpoint(models, mcore_path)
        ours = mcore_logits(models[0].float(), tokens, facts.vocab_size)
    theirs = hf_logits(hf_path, tokens, round_to=ckpt_dtype)
    return compare_logits(ours, theirs, what=str(mcore_path))
