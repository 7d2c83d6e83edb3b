"""Declarative HF <-> megatron-core weight maps: rules, name templates and tensor transforms.

A family module lists `Rule`s; nothing here knows a family by name. A rule ties one megatron-core
parameter (a template with `{L}` for the global layer and `{E}` for the global expert) to the HF tensors
it is made of, and names how they combine (`Kind`). Every transform is defined on the *full* (TP=1)
megatron tensor; `tp_split` / `tp_merge` then cut it the way megatron-core's layers hold it per TP rank.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Sequence

import torch


class Kind(enum.Enum):
    COPY = "copy"  # one HF tensor, same layout
    VOCAB = "vocab"  # one HF tensor, rows padded to the padded vocab size (stripped on export)
    QKV = "qkv"  # q, k, v -> megatron's per-query-group [q..., k, v] rows
    GATE_UP = "gate_up"  # gate, up -> [gate; up] (swiglu linear_fc1)
    FUSED_QKV = "fused_qkv"  # one HF tensor [q; k; v] (Phi-3's qkv_proj) -> megatron's per-group rows
    FUSED_GATE_UP = "fused_gate_up"  # one HF tensor [gate; up] (Phi-3's gate_up_proj): megatron's full fc1
    GROUPED_FC1 = "grouped_fc1"  # per expert gate, up -> GroupedMLP.weight1 [h, E * 2 * ffn]
    GROUPED_FC2 = "grouped_fc2"  # per expert down -> GroupedMLP.weight2 [E * ffn, h]


# How many equal blocks the TP-split dimension holds; each block is split across TP ranks separately
# (megatron-core's swiglu fc1 holds [gate_r; up_r] on rank r, not a contiguous slice of [gate; up]).
_HALVES = {Kind.GATE_UP: 2, Kind.FUSED_GATE_UP: 2, Kind.GROUPED_FC1: 2}


@dataclass(frozen=True)
class Rule:
    """One megatron-core parameter and the HF tensors it is made of."""

    mcore: str
    hf: tuple[str, ...]
    kind: Kind = Kind.COPY
    tp_dim: int | None = None  # None: replicated over TP
    tied_only: bool = False  # output_layer from embed_tokens when word embeddings are tied
    untied_only: bool = False
    _mcore_re: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _hf_res: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_mcore_re", _compile(self.mcore))
        object.__setattr__(self, "_hf_res", tuple(_compile(h) for h in self.hf))

    @property
    def grouped(self) -> bool:
        """The megatron tensor holds all local experts of a layer (GroupedMLP)."""
        return self.kind in (Kind.GROUPED_FC1, Kind.GROUPED_FC2)

    @property
    def expert(self) -> bool:
        return self.grouped or "{E}" in self.mcore

    def match_mcore(self, name: str) -> dict[str, int] | None:
        m = self._mcore_re.fullmatch(name)
        return {k: int(v) for k, v in m.groupdict().items()} if m else None

    def match_hf(self, name: str) -> dict[str, int] | None:
        for rx in self._hf_res:
            m = rx.fullmatch(name)
            if m:
                return {k: int(v) for k, v in m.groupdict().items()}
        return None

    def hf_names(self, layer: int | None, experts: Iterable[int] | None = None) -> list[str]:
        """The HF tensors of this rule, in transform order (grouped: expert-major)."""
        if self.grouped:
            assert experts is not None
            return [h.format(L=layer, E=e) for e in experts for h in self.hf]
        exp = list(experts or [None])[0]
        return [h.format(L=layer, E=exp) for h in self.hf]


def _compile(template: str) -> re.Pattern[str]:
    rx = re.escape(template).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
    return re.compile(rx)


@dataclass(frozen=True)
class Geometry:
    """The shape facts the transforms need."""

    num_heads: int
    num_groups: int
    head_dim: int
    vocab_size: int  # the real (HF) vocabulary
    padded_vocab_size: int


def to_mcore(rule: Rule, tensors: list[torch.Tensor], geo: Geometry) -> torch.Tensor:
    """Combine HF tensors into the full (TP=1) megatron-core tensor."""
    kind = rule.kind
    if kind in (Kind.COPY, Kind.FUSED_GATE_UP):
        return tensors[0]
    if kind is Kind.FUSED_QKV:
        return to_mcore(_QKV_RULE, list(torch.split(tensors[0], _qkv_rows(geo), dim=0)), geo)
    if kind is Kind.VOCAB:
        src = tensors[0]
        if src.shape[0] == geo.padded_vocab_size:
            return src
        pad = src.new_zeros((geo.padded_vocab_size - src.shape[0], *src.shape[1:]))
        return torch.cat([src, pad], dim=0)
    if kind is Kind.QKV:
        q, k, v = tensors
        g, hd = geo.num_groups, geo.head_dim
        per = geo.num_heads // g
        rest = q.shape[1:]
        fused = torch.cat(
            [q.reshape(g, per * hd, *rest), k.reshape(g, hd, *rest), v.reshape(g, hd, *rest)], dim=1
        )
        return fused.reshape(g * (per + 2) * hd, *rest)
    if kind is Kind.GATE_UP:
        return torch.cat(tensors, dim=0)
    if kind is Kind.GROUPED_FC1:
        # GroupedMLP's forward views weight1 [h, E*2*ffn] as [E, h, 2*ffn] (a memory reshape):
        # block e is expert e's [gate; up] transposed.
        pairs = [torch.cat(tensors[i : i + 2], dim=0).t() for i in range(0, len(tensors), 2)]
        stacked = torch.stack(pairs)
        return stacked.reshape(stacked.shape[1], -1)
    if kind is Kind.GROUPED_FC2:
        # ... and weight2 [E*ffn, h] as [E, ffn, h]: block e is expert e's down projection transposed.
        stacked = torch.stack([t.t() for t in tensors])
        return stacked.reshape(-1, stacked.shape[2])
    raise AssertionError(kind)


def to_hf(rule: Rule, full: torch.Tensor, geo: Geometry, n_experts: int = 1) -> list[torch.Tensor]:
    """Split the full (TP=1) megatron-core tensor back into its HF tensors (inverse of to_mcore)."""
    kind = rule.kind
    if kind in (Kind.COPY, Kind.FUSED_GATE_UP):
        return [full]
    if kind is Kind.FUSED_QKV:
        return [torch.cat(to_hf(_QKV_RULE, full, geo), dim=0)]
    if kind is Kind.VOCAB:
        return [full[: geo.vocab_size]]
    if kind is Kind.QKV:
        g, hd = geo.num_groups, geo.head_dim
        per = geo.num_heads // g
        rest = full.shape[1:]
        grouped = full.reshape(g, (per + 2) * hd, *rest)
        q, k, v = torch.split(grouped, [per * hd, hd, hd], dim=1)
        return [
            q.reshape(g * per * hd, *rest),
            k.reshape(g * hd, *rest),
            v.reshape(g * hd, *rest),
        ]
    if kind is Kind.GATE_UP:
        return list(torch.chunk(full, 2, dim=0))
    if kind is Kind.GROUPED_FC1:
        out: list[torch.Tensor] = []
        for block in _grouped_3d(rule, full, n_experts):
            out.extend(torch.chunk(block.t(), 2, dim=0))
        return out
    if kind is Kind.GROUPED_FC2:
        return [block.t() for block in _grouped_3d(rule, full, n_experts)]
    raise AssertionError(kind)


_QKV_RULE = Rule("qkv", ("q", "k", "v"), Kind.QKV)


def _qkv_rows(geo: Geometry) -> list[int]:
    """Rows of q, k and v in a fused [q; k; v] tensor."""
    return [geo.num_heads * geo.head_dim, geo.num_groups * geo.head_dim, geo.num_groups * geo.head_dim]


def _grouped_3d(rule: Rule, t: torch.Tensor, n_experts: int) -> torch.Tensor:
    """GroupedMLP's per-expert view: weight1 -> [E, h, 2*ffn], weight2 -> [E, ffn, h]."""
    if rule.kind is Kind.GROUPED_FC1:
        return t.reshape(n_experts, t.shape[0], -1)
    return t.reshape(n_experts, -1, t.shape[1])


def _grouped_2d(rule: Rule, t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[1], -1) if rule.kind is Kind.GROUPED_FC1 else t.reshape(-1, t.shape[2])


def tp_split(rule: Rule, full: torch.Tensor, rank: int, size: int, n_experts: int = 1) -> torch.Tensor:
    """The part of `full` that TP rank `rank` of `size` holds."""
    if rule.tp_dim is None or size == 1:
        return full
    if rule.grouped:  # each rank holds every local expert's shard, in the same per-expert view
        local = _split_blocks(_grouped_3d(rule, full, n_experts), rule.tp_dim + 1, _HALVES.get(rule.kind, 1), rank, size)
        return _grouped_2d(rule, local)
    return _split_blocks(full, rule.tp_dim, _HALVES.get(rule.kind, 1), rank, size)


def _split_blocks(t: torch.Tensor, dim: int, nblocks: int, rank: int, size: int) -> torch.Tensor:
    blocks = torch.chunk(t, nblocks, dim=dim)
    return torch.cat([torch.chunk(b, size, dim=dim)[rank] for b in blocks], dim=dim)


def _merge_blocks(parts: list[torch.Tensor], dim: int, nblocks: int) -> torch.Tensor:
    per_rank = [torch.chunk(p, nblocks, dim=dim) for p in parts]
    return torch.cat([torch.cat([pr[b] for pr in per_rank], dim=dim) for b in range(nblocks)], dim=dim)


def tp_merge(rule: Rule, parts: list[torch.Tensor], n_experts: int = 1) -> torch.Tensor:
    """Inverse of tp_split: the full tensor from every TP rank's part, in rank order."""
    if rule.tp_dim is None or len(parts) == 1:
        return parts[0]
    if rule.grouped:
        views = [_grouped_3d(rule, p, n_experts) for p in parts]
        return _grouped_2d(rule, _merge_blocks(views, rule.tp_dim + 1, _HALVES.get(rule.kind, 1)))
    return _merge_blocks(parts, rule.tp_dim, _HALVES.get(rule.kind, 1))


class Piece(NamedTuple):
    """Rows [src_row, src_row + rows) of the rule's HF tensor number `src` are the local megatron
    tensor's rows [dst_row, dst_row + rows)."""

    src: int
    src_row: int
    rows: int
    dst_row: int


def row_pieces(
    rule: Rule, hf_shapes: Sequence[Sequence[int]], geo: Geometry, rank: int, size: int
) -> list[Piece] | None:
    """`tp_split(rule, to_mcore(rule, tensors, geo), rank, size)` as row ranges of the HF tensors.

    A loader copies each piece straight into the parameter (no fused or full tensor is ever built);
    rows no piece covers are zeros (vocab padding). None where the local tensor is not made of whole
    HF rows: grouped experts (transposed) and row-parallel splits (dim 1). The shapes are assumed to
    have passed the transforms; None also for shapes the row model does not fit.
    """
    segments = _full_segments(rule, [tuple(s) for s in hf_shapes], geo)
    if segments is None:
        return None
    total = sum(n for _, _, n in segments)
    if rule.tp_dim is None or size == 1:
        windows = [(0, total)]
    elif rule.tp_dim != 0:
        return None
    else:
        # The same cut as _split_blocks: each block chunked over the ranks, this rank's chunks in order.
        windows = []
        for start, end in _chunks(0, total, _HALVES.get(rule.kind, 1)):
            parts = _chunks(start, end - start, size)
            if rank >= len(parts):  # torch.chunk gave fewer parts: tp_split fails, and so must the caller
                return None
            windows.append(parts[rank])
    return _cut(segments, windows)


# (HF tensor index or None for zero rows, first row in it, rows): the full megatron tensor, in order.
_Segment = tuple[int | None, int, int]


def _full_segments(rule: Rule, shapes: list[tuple[int, ...]], geo: Geometry) -> list[_Segment] | None:
    """to_mcore as row segments; None where it does more than stack HF rows (or would not run)."""
    if rule.grouped or not shapes or any(len(s) == 0 for s in shapes):
        return None
    rest = shapes[0][1:]
    if any(s[1:] != rest for s in shapes):  # torch.cat / reshape would mix rows of different widths
        return None
    kind = rule.kind
    if kind is Kind.COPY and len(shapes) == 1:
        return [(0, 0, shapes[0][0])]
    if kind is Kind.VOCAB and len(shapes) == 1 and shapes[0][0] <= geo.padded_vocab_size:
        return [(0, 0, shapes[0][0]), (None, 0, geo.padded_vocab_size - shapes[0][0])]
    if kind is Kind.GATE_UP or (kind is Kind.FUSED_GATE_UP and len(shapes) == 1):
        return [(i, 0, s[0]) for i, s in enumerate(shapes)]
    if kind is Kind.FUSED_QKV and len(shapes) == 1:
        q, kv, _ = _qkv_rows(geo)
        if shapes[0][0] != q + 2 * kv:
            return None
        g, hd = geo.num_groups, geo.head_dim
        q_rows = q // g
        fused: list[_Segment] = []
        for i in range(g):  # megatron's per-group layout out of the [q; k; v] rows
            fused += [(0, i * q_rows, q_rows), (0, q + i * hd, hd), (0, q + kv + i * hd, hd)]
        return fused
    if kind is Kind.QKV and len(shapes) == 3:
        g, hd = geo.num_groups, geo.head_dim
        q_rows = (geo.num_heads // g) * hd
        if (shapes[0][0], shapes[1][0], shapes[2][0]) != (g * q_rows, g * hd, g * hd):
            return None
        out: list[_Segment] = []
        for i in range(g):  # megatron's per-group layout: [q heads of group i; k_i; v_i]
            out += [(0, i * q_rows, q_rows), (1, i * hd, hd), (2, i * hd, hd)]
        return out
    return None


def _chunks(start: int, n: int, chunks: int) -> list[tuple[int, int]]:
    """The [begin, end) rows of torch.chunk(rows start..start+n, chunks), uneven sizes included."""
    if n == 0:
        return [(start, start)] * chunks
    step = -(-n // chunks)
    return [(start + a, start + min(a + step, n)) for a in range(0, n, step)]


def _cut(segments: list[_Segment], windows: list[tuple[int, int]]) -> list[Piece]:
    """The pieces of the full tensor's row windows, laid end to end from destination row 0."""
    pieces: list[Piece] = []
    dst = 0
    for begin, end in windows:
        at = 0  # the current segment's first row in the full tensor
        for src, first, n in segments:
            lo, hi = max(begin, at), min(end, at + n)
            if lo < hi and src is not None:
                piece = Piece(src, first + lo - at, hi - lo, dst + lo - begin)
                last = pieces[-1] if pieces else None
                follows = last is not None and last.src == src and last.src_row + last.rows == piece.src_row
                if follows and last.dst_row + last.rows == piece.dst_row:
                    pieces[-1] = last._replace(rows=last.rows + piece.rows)  # fewer, larger reads
                else:
                    pieces.append(piece)
            at += n
        dst += end - begin
    return pieces


@dataclass(frozen=True)
class WeightMap:
    """All rules of one family; looked up by megatron-core parameter name or HF tensor name."""

    family: str
    rules: tuple[Rule, ...]

    def for_mcore(self, name: str, tied: bool) -> tuple[Rule, dict[str, int]] | None:
        for rule in self.rules:
            if (rule.tied_only and not tied) or (rule.untied_only and tied):
                continue
            idx = rule.match_mcore(name)
            if idx is not None:
                return rule, idx
        return None

    def covers_hf(self, name: str) -> bool:
        return any(rule.match_hf(name) is not None for rule in self.rules)
