"""Weight-map transforms against megatron-core's own layouts, on plain tensors (no model built)."""

from __future__ import annotations

import pytest
import torch

from trinity.convert.registry import WEIGHT_MAPS, weight_map
from trinity.convert.weightmap import Geometry, Kind, Rule, row_pieces, to_hf, to_mcore, tp_merge, tp_split
from trinity.errors import UserError

GEO = Geometry(num_heads=8, num_groups=2, head_dim=4, vocab_size=10, padded_vocab_size=16)


def _qkv(bias: bool = False):
    h = 12
    shape = (lambda n: (n,)) if bias else (lambda n: (n, h))
    q = torch.randn(shape(8 * 4))
    k = torch.randn(shape(2 * 4))
    v = torch.randn(shape(2 * 4))
    return q, k, v


@pytest.mark.parametrize("bias", [False, True])
def test_qkv_is_megatron_per_group_layout_and_inverts(bias):
    rule = Rule("x", ("q", "k", "v"), Kind.QKV, tp_dim=0)
    q, k, v = _qkv(bias)
    fused = to_mcore(rule, [q, k, v], GEO)
    # megatron-core: group g holds its 4 query heads, then its k head, then its v head.
    per_group = fused.reshape(2, 6 * 4, *fused.shape[1:])
    assert torch.equal(per_group[1, : 4 * 4], q.reshape(2, 16, *q.shape[1:])[1])
    assert torch.equal(per_group[1, 16:20], k[4:8])
    assert torch.equal(per_group[1, 20:24], v[4:8])
    back = to_hf(rule, fused, GEO)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))
    # TP=2 gives each rank whole groups.
    assert torch.equal(tp_split(rule, fused, 1, 2), per_group[1].reshape(-1, *fused.shape[1:]))


def test_gate_up_tp_split_holds_gate_and_up_shards_per_rank():
    rule = Rule("x", ("g", "u"), Kind.GATE_UP, tp_dim=0)
    gate, up = torch.arange(8.0).reshape(8, 1), 100 + torch.arange(8.0).reshape(8, 1)
    full = to_mcore(rule, [gate, up], GEO)
    parts = [tp_split(rule, full, r, 2) for r in range(2)]
    # megatron's swiglu chunks the local fc1 output in two: rank r must hold [gate_r; up_r].
    assert torch.equal(parts[1], torch.cat([gate[4:], up[4:]]))
    assert torch.equal(tp_merge(rule, parts), full)
    assert all(torch.equal(a, b) for a, b in zip(to_hf(rule, full, GEO), (gate, up)))


def test_row_parallel_split_is_on_input_dim():
    rule = Rule("x", ("o",), tp_dim=1)
    w = torch.randn(6, 8)
    parts = [tp_split(rule, w, r, 4) for r in range(4)]
    assert torch.equal(parts[2], w[:, 4:6])
    assert torch.equal(tp_merge(rule, parts), w)


def test_vocab_rows_padded_with_zeros_and_stripped():
    rule = Rule("x", ("e",), Kind.VOCAB, tp_dim=0)
    e = torch.randn(10, 3)
    full = to_mcore(rule, [e], GEO)
    assert full.shape == (16, 3) and torch.equal(full[:10], e) and not full[10:].any()
    assert torch.equal(to_hf(rule, full, GEO)[0], e)


def test_grouped_gemm_weights_match_groupedmlp_views():
    """GroupedMLP views weight1 as [E, h, 2*ffn] and weight2 as [E, ffn, h] (experts.py forward)."""
    E, h, ffn = 3, 4, 5
    gates = [torch.randn(ffn + 1, h) for _ in range(E)]
    ups = [torch.randn(ffn + 1, h) for _ in range(E)]
    downs = [torch.randn(h, ffn + 1) for _ in range(E)]
    fc1 = Rule("w1", ("g{E}", "u{E}"), Kind.GROUPED_FC1, tp_dim=1)
    fc2 = Rule("w2", ("d{E}",), Kind.GROUPED_FC2, tp_dim=0)
    flat1 = [t for e in range(E) for t in (gates[e], ups[e])]
    w1 = to_mcore(fc1, flat1, GEO)
    w2 = to_mcore(fc2, downs, GEO)
    for e in range(E):
        assert torch.equal(w1.view(E, h, -1)[e], torch.cat([gates[e], ups[e]]).t())
        assert torch.equal(w2.view(E, -1, h)[e], downs[e].t())
    assert all(torch.equal(a, b) for a, b in zip(to_hf(fc1, w1, GEO, E), flat1))
    assert all(torch.equal(a, b) for a, b in zip(to_hf(fc2, w2, GEO, E), downs))
    # TP=2: rank r's weight1, viewed per expert, is [gate_r; up_r] transposed (the local swiglu halves).
    local = tp_split(fc1, w1, 1, 2, E)
    for e in range(E):
        expect = torch.cat([torch.chunk(gates[e], 2)[1], torch.chunk(ups[e], 2)[1]]).t()
        assert torch.equal(local.view(E, h, -1)[e], expect)
        assert torch.equal(tp_split(fc2, w2, 1, 2, E).view(E, -1, h)[e], torch.chunk(downs[e], 2, dim=1)[1].t())
    assert torch.equal(tp_merge(fc1, [tp_split(fc1, w1, r, 2, E) for r in range(2)], E), w1)
    assert torch.equal(tp_merge(fc2, [tp_split(fc2, w2, r, 2, E) for r in range(2)], E), w2)


def _from_pieces(pieces, tensors, like):
    """The local tensor a loader builds from `pieces`: rows copied, the rest left zero."""
    out = torch.zeros_like(like)
    covered = torch.zeros(like.shape[0], dtype=torch.int)
    for p in pieces:
        out[p.dst_row : p.dst_row + p.rows] = tensors[p.src][p.src_row : p.src_row + p.rows]
        covered[p.dst_row : p.dst_row + p.rows] += 1
    assert covered.max() <= 1, "pieces overlap"
    return out, covered


_GQA = Geometry(num_heads=8, num_groups=4, head_dim=3, vocab_size=10, padded_vocab_size=16)
_MHA = Geometry(num_heads=4, num_groups=4, head_dim=2, vocab_size=13, padded_vocab_size=13)


def _cases():
    h = 5
    for geo in (_GQA, _MHA):
        per, g, hd = geo.num_heads // geo.num_groups, geo.num_groups, geo.head_dim
        for rest in ((h,), ()):  # weights and 1-D biases
            yield geo, Rule("qkv", ("q", "k", "v"), Kind.QKV, tp_dim=0), [(g * per * hd, *rest), (g * hd, *rest), (g * hd, *rest)]
        yield geo, Rule("e", ("e",), Kind.VOCAB, tp_dim=0), [(geo.vocab_size, h)]
        yield geo, Rule("e", ("e",), Kind.VOCAB, tp_dim=0), [(geo.padded_vocab_size, h)]  # already padded
        yield geo, Rule("fc1", ("g", "u"), Kind.GATE_UP, tp_dim=0), [(12, h), (12, h)]
        yield geo, Rule("qkv", ("qkv",), Kind.FUSED_QKV, tp_dim=0), [(g * (per + 2) * hd, h)]  # Phi-3's qkv_proj
        yield geo, Rule("fc1", ("gu",), Kind.FUSED_GATE_UP, tp_dim=0), [(24, h)]  # Phi-3's gate_up_proj
        yield geo, Rule("fc1", ("g", "u"), Kind.GATE_UP, tp_dim=0), [(7, h), (7, h)]  # uneven chunks
        yield geo, Rule("col", ("w",), tp_dim=0), [(12, h)]
        yield geo, Rule("col", ("w",), tp_dim=0), [(7,)]  # uneven: chunks 2, 2, 2, 1 at TP=4
        yield geo, Rule("norm", ("w",)), [(h,)]
        yield geo, Rule("router", ("w",)), [(4, h)]
        yield geo, Rule("row", ("w",), tp_dim=1), [(6, 8)]  # row parallel: pieces only at TP=1


@pytest.mark.parametrize("size", [1, 2, 4])
def test_row_pieces_give_exactly_tp_split_of_to_mcore(size):
    torch.manual_seed(0)
    checked = 0
    for geo, rule, shapes in _cases():
        tensors = [torch.randn(s) + 10 for s in shapes]  # never zero: a missed row shows
        full = to_mcore(rule, tensors, geo)
        for rank in range(size):
            pieces = row_pieces(rule, shapes, geo, rank, size)
            if rule.tp_dim == 1 and size > 1:
                assert pieces is None
                continue
            expect = tp_split(rule, full, rank, size)
            got, covered = _from_pieces(pieces, tensors, expect)
            assert torch.equal(got, expect), (rule, shapes, rank, size)
            # Only vocab padding is left to the caller's zero fill.
            assert ((covered == 0) == (expect == 0).reshape(expect.shape[0], -1).all(1)).all()
            checked += 1
    assert checked > 20


def test_row_pieces_qkv_rank_holds_whole_groups_in_few_pieces():
    shapes = [(8 * 3, 5), (4 * 3, 5), (4 * 3, 5)]  # 8 heads, 4 groups, head_dim 3
    pieces = row_pieces(Rule("qkv", ("q", "k", "v"), Kind.QKV, tp_dim=0), shapes, _GQA, 1, 2)
    # rank 1 of 2 holds groups 2 and 3: per group its 2 q heads, its k head, its v head.
    assert pieces == [(0, 12, 6, 0), (1, 6, 3, 6), (2, 6, 3, 9), (0, 18, 6, 12), (1, 9, 3, 18), (2, 9, 3, 21)]
    copy = row_pieces(Rule("w", ("w",), tp_dim=0), [(12, 5)], _GQA, 2, 4)
    assert copy == [(0, 6, 3, 0)]


def test_row_pieces_refuses_what_rows_cannot_express():
    geo = _GQA
    assert row_pieces(Rule("w1", ("g{E}", "u{E}"), Kind.GROUPED_FC1, tp_dim=1), [(4, 3)] * 4, geo, 0, 1) is None
    assert row_pieces(Rule("w2", ("d{E}",), Kind.GROUPED_FC2, tp_dim=0), [(3, 4)] * 2, geo, 0, 1) is None
    assert row_pieces(Rule("o", ("o",), tp_dim=1), [(6, 8)], geo, 0, 2) is None
    assert row_pieces(Rule("o", ("o",), tp_dim=1), [(6, 8)], geo, 0, 1) == [(0, 0, 6, 0)]
    # torch.chunk gives 3 rows only 2 parts of 2 at TP=3: tp_split raises, row_pieces declines.
    assert row_pieces(Rule("w", ("w",), tp_dim=0), [(4, 2)], geo, 2, 3) is None
    # Shapes the transforms would reinterpret rather than copy row by row.
    assert row_pieces(Rule("f", ("g", "u"), Kind.GATE_UP, tp_dim=0), [(4, 3), (4, 2)], geo, 0, 1) is None
    assert row_pieces(Rule("q", ("q", "k", "v"), Kind.QKV, tp_dim=0), [(24, 5), (24, 5), (12, 5)], geo, 0, 1) is None
    assert row_pieces(Rule("s", ("s",)), [()], geo, 0, 1) is None


def test_rule_names_and_matching():
    rule = Rule("decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight",
                ("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", "model.layers.{L}.mlp.experts.{E}.up_proj.weight"),
                Kind.GATE_UP, tp_dim=0)
    assert rule.match_mcore("decoder.layers.3.mlp.experts.local_experts.12.linear_fc1.weight") == {"L": 3, "E": 12}
    assert rule.match_mcore("decoder.layers.3.mlp.linear_fc1.weight") is None
    assert rule.hf_names(3, [12])[1] == "model.layers.3.mlp.experts.12.up_proj.weight"
    assert rule.expert


def test_registry_has_every_family_and_both_norm_spellings():
    assert set(WEIGHT_MAPS) >= {"llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "mistral", "phi3", "qwen2_moe", "glm4",
                                "deepseek_v2", "deepseek_v3", "gemma2", "gemma3"}
    for wmap in WEIGHT_MAPS.values():
        if wmap.family in ("gemma2", "gemma3"):  # sandwich norms: our spec only, never TransformerEngine's
            continue
        for te, local in [("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.0.input_layernorm.weight"),
                          ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "decoder.layers.0.pre_mlp_layernorm.weight")]:
            assert wmap.for_mcore(te, False)[0].hf == wmap.for_mcore(local, False)[0].hf
    tied = weight_map("qwen2").for_mcore("output_layer.weight", True)[0]
    assert tied.hf == ("model.embed_tokens.weight",)
    assert weight_map("mixtral").covers_hf("model.layers.1.block_sparse_moe.experts.7.w3.weight")
    assert not weight_map("qwen2").covers_hf("model.layers.1.block_sparse_moe.experts.7.w3.weight")


def test_unknown_family_lists_supported():
    with pytest.raises(UserError, match="supported: deepseek_v2, deepseek_v3, gemma2, gemma3, glm4, llama, mistral, "
                                        "mixtral, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe"):
        weight_map("gpt2")


def test_fused_qkv_and_gate_up_are_the_split_kinds_and_invert():
    """Phi-3's qkv_proj [q; k; v] gives what QKV gives from q, k, v; gate_up_proj [gate; up] what GATE_UP
    gives from gate, up (TP splits included); both come back bit for bit."""
    q, k, v = _qkv()
    qkv = Rule("a", ("q", "k", "v"), Kind.QKV, tp_dim=0)
    fused = Rule("a", ("qkv",), Kind.FUSED_QKV, tp_dim=0)
    full = to_mcore(fused, [torch.cat([q, k, v])], GEO)
    assert torch.equal(full, to_mcore(qkv, [q, k, v], GEO))
    assert torch.equal(to_hf(fused, full, GEO)[0], torch.cat([q, k, v]))
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    gu, sep = Rule("f", ("gu",), Kind.FUSED_GATE_UP, tp_dim=0), Rule("f", ("g", "u"), Kind.GATE_UP, tp_dim=0)
    full = to_mcore(gu, [torch.cat([gate, up])], GEO)
    for rank in range(2):
        assert torch.equal(tp_split(gu, full, rank, 2), tp_split(sep, to_mcore(sep, [gate, up], GEO), rank, 2))
    assert torch.equal(tp_merge(gu, [tp_split(gu, full, r, 2) for r in range(2)]), full)
    assert torch.equal(to_hf(gu, full, GEO)[0], torch.cat([gate, up]))
