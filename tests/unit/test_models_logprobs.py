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


@pytest.mark.parametrize("value_head", [False, True])
def test_stage_output_is_the_model_output_in_megatron_layout(tp1, tmp_path, value_head):
    """The trainer's forward (`stage_output`, no [b, s] copy of the logits) gives GPTModel's own output
    transposed, and the same gradients, for the actor's logits and the critic's values; through the
    DDP wrapper the trainer uses."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from trinity.models.build import build_model
    from trinity.models.logprobs import stage_output

    facts = ModelFacts.from_hf_dir(make_tiny_hf_model("qwen2", tmp_path))
    (model,) = build_model(facts, MegatronConfig(), device="cpu", dtype=torch.float32, value_head=value_head)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (3, 10), generator=g)
    pos = torch.arange(10).expand(3, 10)
    weights = torch.randn(3, 10, 1 if value_head else model.vocab_size, generator=g)

    ref = ddp(ids, pos, None)  # [b, s, ...]
    (ref * weights).sum().backward()
    ref_grads = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    ddp.zero_grad_buffer()
    out = stage_output(ddp, ids, pos, None)
    assert out.shape == (10, 3, ref.shape[-1]) and out.is_contiguous()
    torch.testing.assert_close(out.transpose(0, 1), ref, atol=0, rtol=0)
    (out * weights.transpose(0, 1)).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.main_grad, ref_grads[n], atol=1e-6, rtol=1e-6, msg=n)
    assert model.post_process
