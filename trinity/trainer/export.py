"""Export the trained actor as an HF folder (<output_dir>/hf) that transformers loads directly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trinity.trainer.context import WorkerContext


def export_hf(ctx: WorkerContext, chunks: list[Any]) -> Path:
    """All ranks call: gather the full weights, rank 0 writes safetensors + the source model's config,
    generation and tokenizer files (atomically, replacing an earlier export)."""
    from trinity.convert.hf_io import copy_side_files
    from trinity.convert.jobs import save_hf_folder_distributed

    cfg = ctx.config
    out = ctx.output_dir / "hf"
    save_hf_folder_distributed(chunks, ctx.facts, out, cfg.model.path, ctx.dtype, force=True)
    if ctx.is_rank0 and cfg.model.tokenizer_path:
        copy_side_files(Path(cfg.model.tokenizer_path), out, skip=("config.json", "generation_config.json"))
    return out
