"""Export the trained actor as an HF folder (<output_dir>/hf) that transformers loads directly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trinity.trainer.registry import WorkerContext


def export_hf(ctx: WorkerContext, chunks: list[Any]) -> Path:
    """Gather the full weights (every rank iterates; collectives inside), rank 0 writes safetensors
    plus the source model's config, generation config and tokenizer files, atomically."""
    from trinity.convert.builtin import export_hf_weights
    from trinity.convert.hf_io import copy_side_files, write_shards
    from trinity.convert.outdir import atomic_dir

    cfg = ctx.config
    out = ctx.output_dir / "hf"
    pairs = export_hf_weights(chunks, ctx.facts)
    if not ctx.is_rank0:
        for _ in pairs:  # take part in the gathers
            pass
        _barrier()
        return out
    with atomic_dir(out, force=True) as tmp:
        write_shards(((name, t.detach().cpu()) for name, t in pairs), tmp, dtype=None)
        copy_side_files(Path(cfg.model.path), tmp)
        tok = Path(cfg.model.tokenizer_path or cfg.model.path)
        copy_side_files(tok, tmp, skip=("config.json", "generation_config.json"))
        _set_config_dtype(tmp / "config.json", ctx.dtype)
    _barrier()
    return out


def _set_config_dtype(path: Path, dtype: torch.dtype) -> None:
    """The exported tensors keep the training dtype; say so in config.json."""
    import json

    if not path.is_file():
        return
    cfg = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    for key in ("torch_dtype", "dtype"):
        if key in cfg:
            cfg[key] = name
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
