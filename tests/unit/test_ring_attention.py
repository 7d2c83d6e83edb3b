"""Ring attention over the CP group (trinity.models.ring_attention) and the CP data split
(trinity.distributed.context_parallel): on gloo, each rank's output and q/k/v gradients equal its share of
one process's full causal attention in fp32, unpacked and packed, MHA, GQA and MQA. One spawn of four
ranks runs both rings: CP=2 through the layer's core-attention module (megatron's CP groups, DP=2), and a
ring of four over the world (at CP=2 the next rank is also the previous one, which would hide a ring
sent the wrong way round); then a two-layer GPTModel at CP=2 gives the logits and (summed over the CP group)
the parameter gradients of the same weights at CP=1, megatron's RoPE slicing the rotary table per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_ranks
from trinity.distributed.context_parallel import chunk_positions, merge_ranks, split_batch, split_for_rank


def test_split_is_megatrons_load_balanced_split():
    # 2·CP chunks of s / (2·CP): rank r holds chunk r and chunk 2·CP-1-r
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert chunk_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    row = torch.arange(16).view(1, 16) * 10
    assert split_for_rank(row, 4, 3).tolist() == [[60, 70, 80, 90]]
    with pytest.raises(ValueError, match="multiple of 2 x context_parallel_size"):
        chunk_positions(10, 3, 0)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_split_then_merge_gives_the_rows_back(cp):
    torch.manual_seed(cp)
    b, s = 3, 8 * cp
    batch = {"tokens": torch.randint(0, 100, (b, s)), "labels": torch.randint(0, 100, (b, s)),
             "loss_mask": torch.rand(b, s) > 0.3, "doc_ids": torch.arange(s).div(5, rounding_mode="floor").expand(b, s),
             "position_ids": torch.arange(s).expand(b, s), "absent": None}
    parts = [split_batch(batch, cp, r) for r in range(cp)]
    assert parts[0]["absent"] is None
    for key in ("tokens", "labels", "loss_mask", "doc_ids", "position_ids"):
        assert all(p[key].shape == (b, s // cp) for p in parts)
        assert torch.equal(merge_ranks([p[key] for p in parts]), batch[key]), key
    # per-token outputs with trailing dims, split along dim 1
    hidden = torch.randn(b, s, 5)
    assert torch.equal(merge_ranks([split_for_rank(hidden, cp, r) for r in range(cp)]), hidden)
    # every position held exactly once
    held = torch.cat([chunk_positions(s, cp, r) for r in range(cp)]).sort().values
    assert torch.equal(held, torch.arange(s))


# --- CP=2 on gloo --------------------------------------------------------------------------------------------

CASES = {  # name: (heads, groups, packed)
    "unpacked_gqa": (4, 2, False),
    "unpacked_mha": (2, 2, False),
    "packed_gqa": (4, 2, True),
    "packed_mqa": (4, 1, True),
}
B, S, D = 2, 16, 8


def _doc_ids() -> torch.Tensor:
    # documents across the chunk borders (chunks of 4 at CP=2), one starting mid-chunk, row 1 ends in padding
    return torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2],
                         [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, -1, -1, -1]])


def _reference(q, k, v, doc_ids, scale):
    """Full causal (block-diagonal for packed rows) attention on one process: SDPA in [b, h, s, d]."""
    from trinity.models.attention import causal_mask, packed_causal_mask

    mask = packed_causal_mask(doc_ids) if doc_ids is not None else causal_mask(q.size(1))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=~mask, scale=scale,
        enable_gqa=q.size(2) != k.size(2))
    return out.transpose(1, 2)


def _ring4(rank: int) -> dict:
    """The raw ring over the world's four ranks (CP=4, chunks of 4), errors per case."""
    import torch.distributed as dist

    from trinity.distributed import context_parallel as cpx
    from trinity.models.ring_attention import ring_attention

    res = {}
    for name, (heads, groups, packed) in CASES.items():
        torch.manual_seed(11)
        s = 32
        q = torch.randn(B, s, heads, D, requires_grad=True)
        k = torch.randn(B, s, groups, D, requires_grad=True)
        v = torch.randn(B, s, groups, D, requires_grad=True)
        dout = torch.randn(B, s, heads, D)
        doc_ids = torch.randint(0, 5, (B, s)).sort(dim=1).values if packed else None
        ref = _reference(q, k, v, doc_ids, 0.3)
        ref.backward(dout)
        lq, lk, lv = (cpx.split_for_rank(t.detach(), 4, rank).requires_grad_() for t in (q, k, v))
        # the math kernel's query tiles: whole blocks, and 3 or 6 rows per tile (uneven) in half the cases
        tiles = {"score_bytes": 4 * B * heads * 8 * 3} if name in ("unpacked_mha", "packed_gqa") else {}
        got = ring_attention(lq, lk, lv, dist.group.WORLD, scale=0.3, doc_ids=doc_ids, **tiles)
        got.backward(cpx.split_for_rank(dout, 4, rank))
        res[name] = {what: float((mine.detach() - cpx.split_for_rank(full, 4, rank)).abs().max())
                     for what, mine, full in (("out", got, ref.detach()), ("dq", lq.grad, q.grad),
                                              ("dk", lk.grad, k.grad), ("dv", lv.grad, v.grad))}
    return res


def _gpt(cp: int, core_attention):
    """A two-layer GPTModel of our local layer spec (RoPE, GQA, RMSNorm, SwiGLU), fp32 on the CPU, with
    `core_attention` as its core attention."""
    import copy

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from trinity.models.spec import TorchNorm

    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = TorchNorm
    spec.submodules.self_attention.submodules.core_attention = core_attention
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8, ffn_hidden_size=48,
        context_parallel_size=cp, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0,
        use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
    return GPTModel(config, spec, vocab_size=64, max_sequence_length=S, position_embedding_type="rope",
                    rotary_base=100)


def _model_cp2(rank: int) -> dict:
    """A GPTModel at CP=2 (RingCoreAttention; megatron's RoPE takes this rank's chunks of the rotary table)
    against the same weights at CP=1 (SDPACoreAttention): logits and the parameters' gradients summed over
    the CP group, unpacked and packed rows. Re-initialises megatron's parallel state twice."""
    from megatron.core import parallel_state as ps

    from trinity.distributed import collectives
    from trinity.distributed import context_parallel as cpx
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import init_parallel
    from trinity.models.attention import SDPACoreAttention, document_packed_params
    from trinity.models.ring_attention import RingCoreAttention, ring_document_params

    torch.manual_seed(5)
    tokens = torch.randint(0, 64, (B, S))
    positions = torch.arange(S).expand(B, S)
    weights = torch.randn(B, S, 64)  # the "loss": sum(logits * weights)
    res = {}
    init_parallel(device="cpu", layout=ParallelLayout(), seed=1)  # CP=1 (DP=4)
    ref = _gpt(1, SDPACoreAttention)
    state = {n: p.detach().clone() for n, p in ref.named_parameters()}
    want = {}
    for packed in (False, True):
        ref.zero_grad()
        extra = {"packed_seq_params": document_packed_params(_doc_ids())} if packed else {}
        logits = ref(tokens, positions, None, **extra)
        (logits * weights).sum().backward()
        want[packed] = (logits.detach(), {n: p.grad.clone() for n, p in ref.named_parameters()})
    # the CPU accommodation cpu_compat is to make at CP>1: megatron's rotary slice pins host memory
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = cpx.pos_emb_on_this_rank
    init_parallel(device="cpu", layout=ParallelLayout(cp=2), seed=1)
    group, cp_rank = ps.get_context_parallel_group(), ps.get_context_parallel_rank()
    model = _gpt(2, RingCoreAttention)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(state[n])
    for packed in (False, True):
        model.zero_grad()
        extra = {"packed_seq_params": ring_document_params(_doc_ids())} if packed else {}
        local = cpx.split_batch({"tokens": tokens, "positions": positions, "weights": weights}, 2, cp_rank)
        logits = model(local["tokens"], local["positions"], None, **extra)
        (logits * local["weights"]).sum().backward()
        ref_logits, ref_grads = want[packed]
        grad_err = max(float((collectives.all_reduce(p.grad, "sum", group) - ref_grads[n]).abs().max())
                       for n, p in model.named_parameters())
        res["packed" if packed else "unpacked"] = {
            "logits": float((logits.detach() - cpx.split_for_rank(ref_logits, 2, cp_rank)).abs().max()),
            "grads": grad_err, "grad_scale": max(float(g.abs().max()) for g in ref_grads.values())}
    return res


def _worker(rank: int, port: int, out: str) -> None:
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from trinity.distributed import context_parallel as cpx
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.ring_attention import RingCoreAttention, ring_document_params

    init_parallel(device="cpu", layout=ParallelLayout(cp=2), seed=1)  # CP=2, DP=2; the strict guard is on
    try:
        group = ps.get_context_parallel_group()
        cp_rank = ps.get_context_parallel_rank()
        res: dict = {"cp_rank": cp_rank}
        for name, (heads, groups, packed) in CASES.items():
            torch.manual_seed(7)  # the same full tensors on both ranks
            q = torch.randn(B, S, heads, D, dtype=torch.float64).float().requires_grad_()
            k = torch.randn(B, S, groups, D).requires_grad_()
            v = torch.randn(B, S, groups, D).requires_grad_()
            dout = torch.randn(B, S, heads, D)
            doc_ids = _doc_ids() if packed else None
            scale = D ** -0.5
            ref = _reference(q, k, v, doc_ids, scale)
            ref.backward(dout)

            config = TransformerConfig(num_layers=1, hidden_size=heads * D, num_attention_heads=heads,
                                       num_query_groups=groups, kv_channels=D, context_parallel_size=2,
                                       attention_dropout=0.0, use_cpu_initialization=True)
            attn = RingCoreAttention(config, 1, AttnMaskType.causal, "self")

            def local(t):  # this rank's chunks, as megatron's [s, b, ...] leaf
                return cpx.split_for_rank(t.detach(), 2, cp_rank).transpose(0, 1).contiguous().requires_grad_()

            lq, lk, lv = local(q), local(k), local(v)
            params = ring_document_params(doc_ids) if packed else None
            got = attn(lq, lk, lv, None, packed_seq_params=params)  # [s, b, heads * D]
            got.backward(cpx.split_for_rank(dout, 2, cp_rank).transpose(0, 1).reshape(got.shape))

            def err(mine, full):  # mine [s_local, b, ...] against this rank's share of the full [b, S, ...]
                want = cpx.split_for_rank(full, 2, cp_rank).transpose(0, 1).reshape(mine.shape)
                return float((mine.detach() - want).abs().max())

            res[name] = {"out": err(got, ref.detach()), "dq": err(lq.grad, q.grad), "dk": err(lk.grad, k.grad),
                         "dv": err(lv.grad, v.grad), "grad_scale": float(q.grad.abs().max())}
            # the whole output back from both ranks' parts
            whole = cpx.gather_sequence(got.detach().transpose(0, 1), group)
            res[name]["gathered"] = float((whole.view(B, S, heads, D) - ref.detach()).abs().max())

        # loss reductions: each rank's own token sum; the totals over the group
        loss_sum, count = torch.tensor(1.5 + cp_rank), torch.tensor(3.0 + cp_rank)
        total, n = cpx.token_totals(loss_sum, count, group)
        res["totals"] = [float(total), float(n)]
        # a value summed over the ranks keeps each rank's own gradient
        x = torch.tensor(2.0 + cp_rank, requires_grad=True)
        s = cpx.sum_over_ranks(x * x, group)
        (3 * s).backward()
        res["sum"] = [float(s.detach()), float(x.grad)]
        res["ring4"] = _ring4(rank)
        res["model"] = _model_cp2(rank)
        Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    finally:
        destroy()


@pytest.mark.multiproc
@pytest.mark.slow
def test_ring_attention_equals_full_attention(tmp_path, monkeypatch):
    from trinity.distributed import collectives

    monkeypatch.setenv(collectives.STRICT_ENV, "1")
    run_ranks(4, _worker, str(tmp_path))
    for rank in range(4):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name in CASES:
            errs = res[name]
            assert errs["grad_scale"] > 0.1  # gradients that are there to compare
            for what in ("out", "dq", "dk", "dv", "gathered"):
                assert errs[what] < 1e-5, (rank, name, what, errs)
            assert max(res["ring4"][name].values()) < 1e-5, (rank, name, res["ring4"][name])
        for rows, errs in res["model"].items():  # a GPTModel at CP=2 against CP=1
            assert errs["grad_scale"] > 0.1 and errs["logits"] < 1e-5 and errs["grads"] < 1e-4, (rank, rows, errs)
        assert res["totals"] == [4.0, 7.0]
        r = res["cp_rank"]
        assert res["sum"] == [13.0, 3 * 2 * (2.0 + r)]  # 2² + 3²; d(3 s)/dx = 3 · 2x on the own rank
