"""Our layer spec (local + SDPA) on CUDA in bf16: attention equivalence and a training step."""

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

    cpu_compat.disable()  # an earlier CPU test in this process may have mapped cuda to cpu
    init_parallel(device="cuda", layout=ParallelLayout(), seed=7)
    yield
    destroy()


def _attention_pair(dtype: torch.dtype):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from trinity.models.attention import SDPACoreAttention

    cfg = TransformerConfig(
        num_layers=1, hidden_size=8 * 64, num_attention_heads=8, num_query_groups=2, kv_channels=64,
        masked_softmax_fusion=False, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        attention_dropout=0.0, hidden_dropout=0.0,
    )
    kw = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    return SDPACoreAttention(**kw).cuda(), DotProductAttention(**kw).cuda()


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_sdpa_matches_dot_product_attention_on_cuda(cuda_tp1, dtype, atol):
    from trinity.models.attention import causal_mask, packed_causal_mask

    ours, ref = _attention_pair(dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(128, 2, 8, 64, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(128, 2, 2, 64, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(128, 2, 2, 64, device="cuda", dtype=dtype, generator=g)
    expected = ref(q, k, v, causal_mask(128, device="cuda"))
    torch.testing.assert_close(ours(q, k, v, None), expected, atol=atol, rtol=0)
    doc_ids = torch.arange(128, device="cuda").div(40, rounding_mode="floor").expand(2, 128)
    mask = packed_causal_mask(doc_ids)
    torch.testing.assert_close(ours(q, k, v, mask), ref(q, k, v, mask), atol=atol, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_bf16_forward_backward_with_our_spec(cuda_tp1, tmp_path, family):
    from trinity.config.megatron import MegatronConfig
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts
    from trinity.models.spec import BACKEND_LOCAL_SDPA, have_transformer_engine
    from trinity.testing.tiny_models import make_tiny_hf_model

    facts = ModelFacts.from_hf_dir(make_tiny_hf_model(family, tmp_path))
    (model,) = build_model(facts, MegatronConfig(), device="cuda", dtype=torch.bfloat16)
    if not have_transformer_engine():
        assert model.trinity_backend == BACKEND_LOCAL_SDPA
    params = list(model.parameters())
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in params)
    ids = torch.randint(0, 128, (2, 64), device="cuda")
    pos = torch.arange(64, device="cuda").expand(2, 64)
    model.train()
    loss = model(ids, pos, None, labels=ids).float().mean()
    loss.backward()
    assert torch.isfinite(loss) and 3.0 < loss.item() < 7.0  # ~ln(128) for a random model
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
