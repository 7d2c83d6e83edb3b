"""Export the trained actor as an HF folder (<output_dir>/hf) that transformers loads directly.

A LoRA job (actor.lora.rank >= 1) exports the MERGED model there (every adapted weight W + alpha/rank * B A,
rounded to the job's dtype: transformers loads it without PEFT), and its adapters apart as a PEFT folder
(<output_dir>/adapter, `PeftModel.from_pretrained(base_model, folder)`). Each checkpoint of a LoRA job
gets the same PEFT folder as step_N/adapter (`write_adapter_folder`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trinity.trainer.context import WorkerContext

ADAPTER_DIR = "adapter"  # a LoRA job's PEFT folder: <output_dir>/adapter and checkpoints/step_N/adapter


def export_hf(ctx: WorkerContext, chunks: list[Any]) -> Path:
    """All ranks call: gather the full weights, rank 0 writes safetensors + the source model's config,
    generation and tokenizer files (atomically, replacing an earlier export). With LoRA the weights are
    the merged ones, and the adapters go to <output_dir>/adapter too."""
    import contextlib

    from trinity.convert.hf_io import copy_side_files
    from trinity.convert.jobs import save_hf_folder_distributed
    from trinity.models.lora import adapters_merged, has_lora

    cfg = ctx.config
    out = ctx.output_dir / "hf"
    lora = has_lora(chunks)
    # merged in place for the export only: every base weight gets its original bits back afterwards
    with adapters_merged(chunks) if lora else contextlib.nullcontext():
        save_hf_folder_distributed(chunks, ctx.facts, out, cfg.model.path, ctx.dtype, force=True)
    if ctx.is_rank0 and cfg.model.tokenizer_path:
        copy_side_files(Path(cfg.model.tokenizer_path), out, skip=("config.json", "generation_config.json"))
    if lora:
        write_adapter_folder(chunks, cfg.actor_rollout_ref.actor.lora, ctx.facts, cfg.model.path,
                             ctx.output_dir / ADAPTER_DIR)
    return out


def write_adapter_folder(chunks: list[Any], lora: Any, facts: Any, base_model: str | Path, folder: Path) -> Path:
    """LoRA adapters as a PEFT folder (trinity.convert.peft_io) with the job's rank, alpha and dropout
    (`lora`: actor.lora); all ranks call, rank 0 writes. `base_model`: the HF model it adapts (model.path)."""
    from trinity.convert.peft_io import save_peft_folder

    save_peft_folder(chunks, facts, folder, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                     base_model=str(base_model))
    return folder
