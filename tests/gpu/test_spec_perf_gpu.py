"""The fast paths of our spec on CUDA: packed rows through flash varlen or FlexAttention and
torch.compile'd layers compute the same function as the eager dense-mask path (bf16, relative error,
fresh random inputs)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def cuda_tp1():
    from trinity.compat import cpu_compat
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel

    cpu_compat.disable()
    init_parallel(device="cuda", layout=ParallelLayout(), seed=11)
    yield
    destroy()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _model(tmp_path, compile_scope: str = "none"):
    
    from trinity.config.megatron import MegatronConfig
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts
    from trinity.testing.tiny_models import make_tiny_hf_model

    facts = ModelFacts.from_hf_dir(make_tiny_hf_model("qwen2", tmp_path, hidden_size=256, num_attention_heads=4,
                                                      num_key_value_heads=2, intermediate_size=512))
    megatron = MegatronConfig(torch_compile=compile_scope)
    torch.manual_seed(0)
    (model,) = build_model(facts, megatron, device="cuda", dtype=torch.bfloat16)
    return model


def test_flex_packed_rows_match_dense_mask_on_cuda(cuda_tp1):
    from trinity.models.attention import _flex_attention, document_packed_params

    g = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, (1,))))
    b, s, heads, groups, d = 2, 1024, 8, 2, 128
    q = torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    k = torch.randn(b, groups, s, d, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    v = torch.randn(b, groups, s, d, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    doc_ids = torch.repeat_interleave(torch.tensor([0, 1, 2, 3], device="cuda"), torch.tensor([300, 200, 400, 124], device="cuda")).expand(b, s)
    params = document_packed_params(doc_ids, kernel="flex")
    out = _flex_attention(q, k, v, params.block_mask, d**-0.5, True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=~params.dense_mask(), scale=d**-0.5, enable_gqa=True)
    assert _rel(out, ref) < 1e-2
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        assert _rel(got, want) < 2e-2


def test_varlen_packed_rows_match_dense_mask_through_the_core_attention(cuda_tp1):
    """Megatron's layout ([s, b, heads, d], q/k/v strided views of one projection), two rows with
    different documents and trailing padding, GQA: output and all three gradients."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from trinity.models.doc_masks import block_causal_mask
    from trinity.models.attention import SDPACoreAttention, document_packed_params

    seed = int(torch.randint(0, 2**31, (1,)))
    g = torch.Generator(device="cuda").manual_seed(seed)
    s, b, heads, groups, d = 1024, 2, 8, 2, 128
    config = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=d, attention_dropout=0.0)
    attn = SDPACoreAttention(config, 1, AttnMaskType.causal, "self")
    qkv = torch.randn(s, b, groups, heads // groups + 2, d, device="cuda", dtype=torch.bfloat16, generator=g,
                      requires_grad=True)
    q = qkv[:, :, :, : heads // groups].reshape(s, b, heads, d)
    k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
    doc_ids = torch.full((b, s), -1)
    doc_ids[0, :1000] = torch.repeat_interleave(torch.arange(4), torch.tensor([300, 200, 400, 100]))
    doc_ids[1, :] = torch.repeat_interleave(torch.arange(2), torch.tensor([17, 1007]))
    params = document_packed_params(doc_ids, device="cuda", kernel="varlen")
    assert params.doc_cu_seqlens.numel() == 16 and params.doc_max_seqlen == 1007
    out = attn(q, k, v, None, packed_seq_params=params)
    ref = attn(q.double(), k.double(), v.double(), block_causal_mask(doc_ids.cuda()))
    real = (doc_ids >= 0).T.cuda()  # padding attends differently (to itself only vs. to the padding)
    assert out.shape == ref.shape == (s, b, heads * d)
    assert _rel(out[real], ref[real]) < 1e-2, seed
    grad_out = torch.randn(out.shape, device="cuda", generator=g) * real[..., None]
    (grad,) = torch.autograd.grad(out.float(), qkv, grad_out)
    (ref_grad,) = torch.autograd.grad(ref, qkv, grad_out.double())
    assert _rel(grad, ref_grad) < 2e-2, seed


@pytest.mark.parametrize("kernel", ["varlen", "flex"])
@pytest.mark.parametrize("scope", ["none", "layers", "model"])
def test_model_with_packed_rows_matches_eager_dense_mask(cuda_tp1, tmp_path, scope, kernel):
    from trinity.models.attention import document_packed_params, packed_causal_mask

    eager = _model(tmp_path / "e")
    compiled = _model(tmp_path / "c", scope)
    compiled.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 128, (2, 256), device="cuda")
    pos = torch.arange(256, device="cuda").expand(2, 256)
    doc_ids = torch.repeat_interleave(torch.tensor([0, 1, 2]), torch.tensor([100, 28, 128])).expand(2, 256)
    ref = eager(ids, pos, packed_causal_mask(doc_ids.cuda()))
    for _ in range(2):  # the second batch has other documents: a compiled layer must not keep the first's
        out = compiled(ids, pos, None, packed_seq_params=document_packed_params(doc_ids, device="cuda", kernel=kernel))
        assert _rel(out, ref) < 2e-2
        compiled.zero_grad()
        doc_ids = doc_ids.flip(1).contiguous()
        ref = eager(ids, pos, packed_causal_mask(doc_ids.cuda()))
    out = compiled(ids, pos, None, packed_seq_params=document_packed_params(doc_ids, device="cuda", kernel=kernel))
    assert _rel(out, ref) < 2e-2
    assert _rel(out, ref) < 2e-2
    out.float().logsumexp(-1).mean().backward()
    ref.float().logsumexp(-1).mean().backward()
    got = dict(compiled.named_parameters())
    for name, p in eager.named_parameters():
        assert _rel(got[name].grad, p.grad) < 5e-2, name


def test_compiled_logprobs_match_megatron_cross_entropy(cuda_tp1):
    from megatron.core import tensor_parallel

    from trinity.models.logprobs import _vocab_logprobs

    logits = torch.randn(64, 2, 50000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 50000, (64, 2), device="cuda")
    got = _vocab_logprobs(logits, labels, None)
    want = -tensor_parallel.vocab_parallel_cross_entropy(logits, labels)
    assert got.dtype == torch.float32 and _rel(got, want) < 1e-4
    g_got, = torch.autograd.grad(got.sum(), logits)
    g_want, = torch.autograd.grad(want.sum(), logits)
    assert _rel(g_got, g_want) < 1e-2


@pytest.mark.parametrize("rows", [1000, 333])  # a second size: the kernels turn shape-generic
def test_compiled_vocab_parallel_stats_match_the_eager_chunks(cuda_tp1, monkeypatch, rows):
    """The trainer's log-probs and entropy on CUDA (one compiled kernel each way) against the eager
    fp32 chunks, vocabulary padding included; and no [tokens, vocab] fp32 temporary."""
    from trinity.algorithms import logprob

    # Earlier tests of this process compiled the same kernels for other vocabularies and dtypes: past
    # dynamo's recompile limit (8 variants of one function) it falls back to eager, which this test
    # would then measure. A job compiles one vocabulary and dtype, so only a shared test process sees it.
    torch._dynamo.reset()
    vocab, real = 32768, 32000
    torch.manual_seed(rows)
    logits = (torch.randn(rows, vocab, device="cuda") * 3).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, real, (rows,), device="cuda")
    up_logp, up_ent = torch.randn(rows, device="cuda"), torch.randn(rows, device="cuda")

    def run():
        logp, ent = logprob.vocab_parallel_log_probs_and_entropy(logits, targets, vocab_size=real)
        grad, = torch.autograd.grad((logp * up_logp + ent * up_ent).sum(), logits)
        return logp, ent, grad

    run()  # compile
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logp, ent, grad = run()
    extra = torch.cuda.max_memory_allocated() - base
    with monkeypatch.context() as m:
        m.setattr(logprob, "_kernel", lambda name, fn, x: None)
        want_logp, want_ent, want_grad = run()
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)
    assert bool((grad[:, real:] == 0).all())
    assert _rel(grad, want_grad) < 1e-2  # bf16 gradients of the same fp32 values
    # the bf16 gradient (and a few [rows] vectors), far below one fp32 copy of the logits (2x these bytes)
    assert extra < 1.25 * logits.numel() * logits.element_size(), extra


@pytest.mark.parametrize("seq", [4096, 777])  # a second length: the kernels turn shape-generic
def test_fused_rope_kernels_match_megatron_unfused_on_cuda(cuda_tp1, seq):
    """The compiled RoPE kernels (fp32 math over a cos/sin table) against megatron's unfused RoPE in
    fp32, forward and gradient, at positions up to 4096 (large sin/cos arguments)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from trinity.models.rope import fused_rope

    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    half = torch.arange(seq, device="cuda").float().outer(inv).view(seq, 1, 1, 64)
    freqs = torch.cat((half, half), dim=-1)
    t = torch.randn(seq, 2, 4, 128, device="cuda", requires_grad=True)
    grad = torch.randn_like(t)
    out = fused_rope(t, freqs)
    ref = _apply_rotary_pos_emb_bshd(t, freqs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    (g_out,) = torch.autograd.grad(out, t, grad)
    (g_ref,) = torch.autograd.grad(ref, t, grad)
    torch.testing.assert_close(g_out, g_ref, atol=1e-5, rtol=1e-5)
    tb = t.detach().bfloat16()
    assert _rel(fused_rope(tb, freqs), _apply_rotary_pos_emb_bshd(tb, freqs)) < 1e-2
