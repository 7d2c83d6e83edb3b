"""Load a role's initial weights from its `WeightSource` (decided in trinity.config.weights), and a LoRA
training checkpoint outside its job (`trinity convert`, `trinity generate`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trinity.config.weights import WeightKind, WeightSource


def load_weights(chunks: list[Any], source: WeightSource, facts: Any, *, value_head: bool) -> None:
    """Fill `chunks` from `source`; with a value head only the backbone (the head keeps its init)."""
    if source.is_dist:
        if value_head:
            load_backbone_from_dist_checkpoint(chunks, source.path)
        else:
            from trinity.convert.dist_ckpt import load_model_checkpoint

            load_model_checkpoint(chunks, source.path)
    elif source.kind is WeightKind.mbridge:
        from trinity.convert.mbridge_adapter import load_weights as mbridge_load

        mbridge_load(chunks, source.path, facts)
    else:  # builtin HF loader; it knows a [1, hidden] output layer is a value head and skips it
        from trinity.convert.builtin import load_hf_weights

        load_hf_weights(chunks, source.path, facts)


def load_backbone_from_dist_checkpoint(chunks: list[Any], ckpt_dir: str) -> None:
    """A critic from an LM dist checkpoint: every sharded tensor but the output layer."""
    from trinity.convert.dist_ckpt import _flat_sharded, check_readable, read_meta, read_sharded

    read_meta(ckpt_dir)
    check_readable(ckpt_dir)
    flat, back = _flat_sharded(chunks)
    wanted = {k: v for k, v in flat.items() if not k.endswith("output_layer.weight")}
    loaded = read_sharded({"model": wanted}, ckpt_dir)["model"]
    for chunk, local_to_key in zip(chunks, back):
        sd = {local: loaded[key] for local, key in local_to_key.items() if key in loaded}
        chunk.load_state_dict(sd, strict=False)


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
    from trinity.config.loader import RESOLVED_CONFIG_FILE
    from trinity.convert.dist_ckpt import _flat_sharded, load_model_checkpoint
    from trinity.errors import UserError
    from trinity.models.lora import apply_lora

    ckpt = Path(ckpt_dir)
    stored = next((d / RESOLVED_CONFIG_FILE for d in (ckpt, ckpt.parent) if (d / RESOLVED_CONFIG_FILE).is_file()), None)
    if stored is None:
        raise UserError(f"{ckpt}: a LoRA checkpoint holds the adapters only, and the {RESOLVED_CONFIG_FILE} that names its "
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
