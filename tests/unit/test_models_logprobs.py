"""Chunked log-probs equal megatron's own loss path (values and gradients), fp32 on CPU."""

from __future__ import annotations

import pytest
import torch

from trinity.config.megatron import MegatronConfig
from trinity.distributed.layout import ParallelLayout
from trinity.models.facts import ModelFacts
from trinity.testing.tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def tp1():
    from trinity.distributed.parallel import destroy, init_parallel

    init_parallel(device="cpu", layout=ParallelLayout(), seed=7)
    yield
    destroy()


@pytest.mark.parametrize("tied,chunk", [(True, 6), (False, None)])  # 3 rows per chunk / one piece
def test_chunked_logprobs_equal_megatron_loss_and_grads(tp1, tmp_path, tied, chunk):
    from trinity.models.build import build_model
    from trinity.models.logprobs import decoder_hidden, token_logprobs

    facts = ModelFacts.from_hf_dir(make_tiny_hf_model("qwen2", tmp_path, tie_word_embeddings=tied))
    (model,) = build_model(facts, MegatronConfig(), device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 16), generator=g)
    pos = torch.arange(16).expand(2, 16)
    labels = torch.roll(ids, -1, dims=1)
    ref = model(ids, pos, None, labels=labels)  # [b, s] per-token loss
    ref.sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    logp = token_logprobs(model, decoder_hidden(model, ids, pos, None), labels, chunk_tokens=chunk)
    (-logp).sum().backward()
    assert logp.shape == (2, 16) and logp.dtype == torch.float32
    torch.testing.assert_close(-logp, ref, atol=1e-5, rtol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], atol=1e-6, rtol=0, msg=n)
    assert model.post_process  # restored
