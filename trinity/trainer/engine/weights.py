"""Load a role's initial weights from its `WeightSource` (decided in trinity.config.weights)."""

from __future__ import annotations

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
