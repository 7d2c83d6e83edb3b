"""The builtin converter: fill built megatron-core chunks from HF safetensors, and export them back.

Both directions are driven by the weight map of `facts.family`. Loading walks this rank's parameters
(so it only reads the HF tensors this rank needs) and, where the local tensor is whole HF rows of the
same dtype, preads those rows straight into the parameter (`row_pieces`): no read buffer and no fused
copy, whose first touch of fresh memory cost as much as the reads themselves. Exporting walks the
union of every rank's parameters in one agreed order, gathering TP parts inside their group and
broadcasting the full tensor so that every rank yields the same (name, tensor) sequence.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from trinity.convert.hf_io import HFCheckpoint
from trinity.convert.parallel_io import ordered_map
from trinity.convert.registry import weight_map
from trinity.convert.weightmap import (
    Geometry,
    Piece,
    Rule,
    WeightMap,
    row_pieces,
    to_hf,
    to_mcore,
    tp_merge,
    tp_split,
)
from trinity.distributed import collectives
from trinity.errors import UserError
from trinity.models.build import unwrap
from trinity.models.facts import ModelFacts

log = logging.getLogger(__name__)

Progress = Callable[[str, int], None]  # (tensor name, bytes) after each tensor


@dataclass(frozen=True)
class _Ranks:
    """This rank's coordinates in the groups that cut a parameter."""

    tp: int = 0
    tp_size: int = 1
    etp: int = 0
    etp_size: int = 1
    ep: int = 0
    ep_size: int = 1
    tp_group: Any = None
    etp_group: Any = None

    @classmethod
    def current(cls) -> "_Ranks":
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return cls()
        return cls(
            tp=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            etp=ps.get_expert_tensor_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
            ep=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            tp_group=ps.get_tensor_model_parallel_group(),
            etp_group=ps.get_expert_tensor_parallel_group(),
        )

    def of(self, rule: Rule) -> tuple[int, int, Any]:
        return (self.etp, self.etp_size, self.etp_group) if rule.expert else (self.tp, self.tp_size, self.tp_group)


@dataclass
class _Entry:
    """One local parameter resolved to its rule and global indices."""

    rule: Rule
    param: torch.Tensor
    layer: int | None
    experts: list[int] | None

    @property
    def key(self) -> str:
        name = self.rule.mcore.format(L=self.layer, E=(self.experts or [None])[0])
        return f"{name}@experts{self.experts[0]}-{self.experts[-1]}" if self.rule.grouped else name

    def hf_names(self) -> list[str]:
        return self.rule.hf_names(self.layer, self.experts)


def _geometry(facts: ModelFacts, padded_vocab: int) -> Geometry:
    return Geometry(
        num_heads=facts.num_attention_heads,
        num_groups=facts.num_query_groups,
        head_dim=facts.head_dim,
        vocab_size=facts.vocab_size,
        padded_vocab_size=padded_vocab,
    )


def _entries(models: list[torch.nn.Module], facts: ModelFacts, wmap: WeightMap, ranks: _Ranks) -> list[_Entry]:
    """Every parameter of every local chunk, resolved to global layer/expert indices (strict)."""
    out: list[_Entry] = []
    n_local = (facts.num_experts or 0) // ranks.ep_size
    for chunk in models:
        model = unwrap(chunk)
        layers = [layer.layer_number - 1 for layer in model.decoder.layers] if hasattr(model, "decoder") else []
        # Buffers that are HF weights (DeepSeek-V3's router score-correction bias) join the parameters;
        # other buffers (RoPE tables, token counters) are no weights.
        buffers = [(n, b) for n, b in model.named_buffers() if wmap.for_mcore(n, facts.tie_word_embeddings)]
        for name, param in [*model.named_parameters(), *buffers]:
            if ".lora.lora_" in name:
                # LoRA adapters (trinity.models.lora) are no HF weight: a LoRA job's HF export merges them
                # into the base weights first (trinity.trainer.export), its PEFT folder holds them apart.
                continue
            found = wmap.for_mcore(name, facts.tie_word_embeddings)
            if found is None:
                raise UserError(
                    f"model parameter {name!r} has no HF source in the {wmap.family!r} weight map "
                    f"(model built with options the converter does not know)"
                )
            rule, idx = found
            layer = layers[idx["L"]] if "L" in idx else None
            experts: list[int] | None = None
            if rule.grouped:
                experts = list(range(ranks.ep * n_local, (ranks.ep + 1) * n_local))
            elif "E" in idx:
                experts = [ranks.ep * n_local + idx["E"]]
            out.append(_Entry(rule, param, layer, experts))
    return out


def _is_value_head(entry: _Entry, facts: ModelFacts) -> bool:
    # A critic's output layer is [1, hidden]: it is not the LM head and starts from its own init.
    return entry.rule.mcore == "output_layer.weight" and entry.param.shape[0] == 1 and facts.vocab_size > 1


def load_hf_weights(
    models: list[torch.nn.Module],
    hf_dir: str | Path,
    facts: ModelFacts,
    *,
    progress: Progress | None = None,
) -> None:
    """Fill this rank's model chunks from the HF checkpoint in `hf_dir`, sliced for TP/PP/EP.

    Strict: every model parameter must come from HF tensors and every HF tensor must land in some
    rank's parameters (checked across all ranks); otherwise UserError naming the tensor and file.
    """
    wmap = weight_map(facts.family, facts.source)
    ckpt = HFCheckpoint(hf_dir)
    ranks = _Ranks.current()
    consumed: set[str] = set()
    todo: list[_Entry] = []
    for entry in _entries(models, facts, wmap, ranks):
        names = entry.hf_names()
        if _is_value_head(entry, facts):
            consumed.update(names)
            continue
        for n in names:
            if n not in ckpt.weight_map:
                raise UserError(f"{ckpt.folder}: tensor {n!r} is missing (needed for model parameter {entry.key!r})")
        todo.append(entry)
    # Several parameters are filled at once (each into its own parameter); they are consumed in
    # order, so the first failure reported is the first in the model's order.
    def nbytes(e: _Entry) -> int:
        return sum(ckpt.nbytes(n) for n in e.hf_names())

    try:
        for entry, _ in ordered_map(lambda e: _load_one(e, ckpt, facts, ranks), todo, size=nbytes):
            names = entry.hf_names()
            consumed.update(names)
            if progress is not None:
                progress(names[0], entry.param.numel() * entry.param.element_size())
    finally:
        ckpt.close()
    _check_all_consumed(ckpt, consumed, facts, wmap)


def _load_one(entry: _Entry, ckpt: HFCheckpoint, facts: ModelFacts, ranks: _Ranks) -> None:
    rule, param = entry.rule, entry.param
    names = entry.hf_names()
    rank, size, _ = ranks.of(rule)
    n_exp = len(entry.experts) if rule.grouped and entry.experts else 1
    padded = param.shape[0] * (size if rule.tp_dim == 0 else 1)
    geo = _geometry(facts, padded)
    # Shapes first, on meta tensors: the direct path never builds the fused tensor whose transforms
    # would catch a mismatch, and no byte should be read for a parameter that cannot be filled.
    try:
        meta = [torch.empty(ckpt.shape(n), dtype=ckpt.dtype(n) or param.dtype, device="meta") for n in names]
        local = tp_split(rule, to_mcore(rule, meta, geo), rank, size, n_exp)
        if tuple(local.shape) != tuple(param.shape):
            raise ValueError(f"gives shape {tuple(local.shape)}")
    except (RuntimeError, ValueError) as exc:
        shapes = ", ".join(f"{n} {list(ckpt.shape(n))} in {ckpt.weight_map[n]}" for n in names)
        raise UserError(
            f"{ckpt.folder}: shape mismatch for model parameter {entry.key!r} {list(param.shape)} "
            f"(TP {rank}/{size}): from {shapes} ({exc})"
        ) from None
    with torch.no_grad():  # a worker thread: grad mode is per thread
        pieces = _direct_pieces(rule, names, ckpt, param.data, geo, rank, size)
        if pieces is None:
            full = to_mcore(rule, [ckpt.get(n) for n in names], geo)
            param.data.copy_(tp_split(rule, full, rank, size, n_exp))
            return
        data, filled = param.data, 0
        for p in pieces:  # in destination order; the gaps are vocab padding
            data[filled : p.dst_row].zero_()
            ckpt.read_rows_into(names[p.src], p.src_row, p.rows, data[p.dst_row : p.dst_row + p.rows])
            filled = p.dst_row + p.rows
        data[filled:].zero_()


def _direct_pieces(
    rule: Rule, names: list[str], ckpt: HFCheckpoint, data: torch.Tensor, geo: Geometry, rank: int, size: int
) -> list[Piece] | None:
    """The row pieces to read straight into `data`, or None where it needs the read-fuse-copy path:
    a GPU parameter, a cast (HF dtype != parameter dtype), or a layout rows cannot express."""
    if data.device.type != "cpu" or not data.is_contiguous() or any(ckpt.dtype(n) != data.dtype for n in names):
        return None
    return row_pieces(rule, [ckpt.shape(n) for n in names], geo, rank, size)


def _check_all_consumed(ckpt: HFCheckpoint, consumed: set[str], facts: ModelFacts, wmap: WeightMap) -> None:
    consumed = set().union(*map(set, collectives.all_gather_object(sorted(consumed))))
    leftover = [n for n in ckpt.names() if n not in consumed]
    # Some tied checkpoints still carry lm_head.weight (a copy of the embeddings): nothing to load.
    leftover = [n for n in leftover if not (facts.tie_word_embeddings and n == "lm_head.weight")]
    mtp = [n for n in leftover if _mtp_tensor(n, facts)]
    if mtp:
        log.warning("%s: %d tensors of the multi-token-prediction layers (num_nextn_predict_layers=%d, "
                    "model.layers.%d+) are not loaded: trinity trains and exports the main model only",
                    ckpt.folder, len(mtp), facts.mtp_layers, facts.num_layers)
        leftover = [n for n in leftover if n not in set(mtp)]
    if leftover:
        n = leftover[0]
        why = "matches a rule but the model has no such parameter" if wmap.covers_hf(n) else "is not in the weight map"
        more = f" (and {len(leftover) - 1} more)" if len(leftover) > 1 else ""
        raise UserError(
            f"{ckpt.folder / ckpt.weight_map[n]}: tensor {n!r} {why} of family {wmap.family!r}{more}"
        )


def _mtp_tensor(name: str, facts: ModelFacts) -> bool:
    """A tensor of DeepSeek-V3's MTP layers, stored after the main layers (model.layers.<L>.*, L >= layers)."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return facts.mtp_layers > 0 and m is not None and int(m.group(1)) >= facts.num_layers


def export_hf_weights(
    models: list[torch.nn.Module], facts: ModelFacts
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield full HF (name, tensor) pairs gathered over TP/PP/EP. Every rank must call it and iterate
    it to the end (it runs collectives); every rank yields the same sequence."""
    wmap = weight_map(facts.family, facts.source)
    ranks = _Ranks.current()
    entries = {
        e.key: e
        for e in _entries(models, facts, wmap, ranks)
        if not e.rule.tied_only and not _is_value_head(e, facts)
    }
    dist = torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    if not dist:
        for key in _natural(entries):
            e = entries[key]
            full = tp_merge(e.rule, [e.param.detach()])
            yield from _to_hf_pairs(e.rule, e.layer, e.experts, full, facts)
        return
    yield from _export_distributed(entries, facts, wmap, ranks)


def _to_hf_pairs(
    rule: Rule, layer: int | None, experts: list[int] | None, full: torch.Tensor, facts: ModelFacts
) -> Iterator[tuple[str, torch.Tensor]]:
    n_exp = len(experts) if rule.grouped and experts else 1
    tensors = to_hf(rule, full, _geometry(facts, full.shape[0]), n_exp)
    yield from zip(rule.hf_names(layer, experts), tensors)


def _export_distributed(
    entries: dict[str, _Entry], facts: ModelFacts, wmap: WeightMap, ranks: _Ranks
) -> Iterator[tuple[str, torch.Tensor]]:
    local_meta = {}
    for key, e in entries.items():
        _, size, _ = ranks.of(e.rule)
        shape = list(e.param.shape)
        if e.rule.tp_dim is not None:
            shape[e.rule.tp_dim] *= size
        local_meta[key] = (wmap.rules.index(e.rule), e.layer, e.experts, shape, str(e.param.dtype).removeprefix("torch."))
    gathered = collectives.all_gather_object(local_meta)
    owners: dict[str, int] = {}
    meta: dict[str, tuple] = {}
    for rank, m in enumerate(gathered):
        for key, value in m.items():
            owners.setdefault(key, rank)
            meta.setdefault(key, value)
    device = collectives.group_device()
    for key in _natural(meta):
        rule_index, layer, experts, shape, dtype = meta[key]
        rule = wmap.rules[rule_index]
        if key in entries:
            e = entries[key]
            _, size, group = ranks.of(e.rule)
            local = e.param.detach().contiguous()
            if size > 1 and rule.tp_dim is not None:
                parts = collectives.all_gather(local, group=group)
                n_exp = len(experts) if rule.grouped and experts else 1
                full = tp_merge(rule, parts, n_exp)
            else:
                full = local
            full = full.to(device).contiguous()
        else:
            full = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        full = collectives.broadcast_(full, src=owners[key])
        yield from _to_hf_pairs(rule, layer, experts, full.cpu(), facts)


def _natural(keys: Any) -> list[str]:
    return sorted(keys, key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)])
