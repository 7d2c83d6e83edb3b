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
    """LoRA adapters as a PEFT folder (trinity.models.peft_io) with the job's rank, alpha and dropout
    (`lora`: actor.lora); all ranks call, rank 0 writes. `base_model`: the HF model it adapts (model.path)."""
    from trinity.models.peft_io import save_peft_folder

    save_peft_folder(chunks, facts, folder, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                     base_model=str(base_model))
    return folder


# ---------------------------------------------------------------- a LoRA checkpoint outside its job


def lora_of(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The actor.lora settings a training checkpoint was written with (its trinity_meta.json), None
    without LoRA."""
    lora = meta.get("lora")
    return lora if isinstance(lora, dict) and int(lora.get("rank", 0)) > 0 else None


def load_lora_checkpoint(chunks: list[Any], ckpt_dir: str | Path, facts: Any, lora: dict[str, Any]) -> None:
    """Fill bare model chunks (TP=PP=1, as `trinity convert` and `trinity generate` build them) from a LoRA
    training checkpoint, which holds the adapters only: the base weights from the job's weight source
    (named in the checkpoint's resolved_config.yaml), then the adapters added and loaded. The caller
    merges them (trinity.models.lora.adapters_merged) where it needs plain weights."""
    import yaml

    from trinity.config.roles import Role
    from trinity.config.schema import JobConfig, LoraConfig
    from trinity.config.weights import WeightKind, WeightSource, weight_source
    from trinity.convert.cache import is_cache_entry
    from trinity.convert.dist_ckpt import _flat_sharded, load_model_checkpoint
    from trinity.errors import UserError
    from trinity.models.lora import apply_lora
    from trinity.trainer.engine.weights import load_weights
    from trinity.trainer.resume import CONFIG_FILE

    ckpt = Path(ckpt_dir)
    stored = next((d / CONFIG_FILE for d in (ckpt, ckpt.parent) if (d / CONFIG_FILE).is_file()), None)
    if stored is None:
        raise UserError(f"{ckpt}: a LoRA checkpoint holds the adapters only, and the {CONFIG_FILE} that names its "
                        "base model is not beside it; copy the whole step_N/ folder")
    cfg = JobConfig.model_validate(yaml.safe_load(stored.read_text(encoding="utf-8")))
    source = weight_source(cfg, Role.actor)
    if is_cache_entry(source.path) and not Path(source.path).exists() and Path(cfg.model.path).is_dir():
        # The conversion `trinity run` made of model.path was removed since (the conversion cache is
        # bounded): the HF folder it was made from holds the same weights.
        source = WeightSource(WeightKind.hf, cfg.model.path)
    if not Path(source.path).exists():
        raise UserError(f"{ckpt}: a LoRA checkpoint holds the adapters only; its base model {source.path} "
                        f"(from {stored}) does not exist any more; restore it there")
    load_weights(chunks, source, facts, value_head=False)
    apply_lora(chunks, LoraConfig.model_validate(lora))
    flat, _ = _flat_sharded(chunks)
    base = tuple(sorted({v.key for v in flat.values() if ".lora.lora_" not in v.key}))
    load_model_checkpoint(chunks, ckpt, exclude=base)
