"""Vocab-parallel log-probs/entropy on one rank equal plain log_softmax, values and gradients.

Every test runs twice: through the eager chunks (CPU's path) and through the math of the one-kernel
functions that CUDA compiles (`_stats_kernel`, `_grad_kernel`, run eagerly here; compiled on a GPU in
tests/gpu/test_spec_perf_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from trinity.algorithms import logprob
from trinity.algorithms.logprob import (
    vocab_parallel_entropy,
    vocab_parallel_log_probs,
    vocab_parallel_log_probs_and_entropy,
)


@pytest.fixture(autouse=True, params=["chunks", "kernels"])
def path(request, monkeypatch):
    if request.param == "kernels":
        monkeypatch.setattr(logprob, "_kernel", lambda name, fn, logits: fn)
    return request.param


def _reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_values_and_gradients_match_log_softmax(chunk_size):
    torch.manual_seed(0)
    logits = (torch.randn(2, 7, 50) * 4).requires_grad_(True)
    targets = torch.randint(0, 50, (2, 7))
    up_logp, up_ent = torch.randn(2, 7), torch.randn(2, 7)

    logp, entropy = vocab_parallel_log_probs_and_entropy(logits, targets, chunk_size=chunk_size)
    (logp * up_logp + entropy * up_ent).sum().backward()
    grad = logits.grad.clone()
    logits.grad = None

    ref_logp, ref_ent = _reference(logits, targets)
    (ref_logp * up_logp + ref_ent * up_ent).sum().backward()
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, logits.grad, atol=1e-5, rtol=1e-5)


def test_single_output_functions():
    torch.manual_seed(1)
    logits = torch.randn(5, 33, requires_grad=True)
    targets = torch.randint(0, 33, (5,))
    ref_logp, ref_ent = _reference(logits, targets)

    (g_logp,) = torch.autograd.grad(vocab_parallel_log_probs(logits, targets, chunk_size=2).sum(), logits)
    (r_logp,) = torch.autograd.grad(ref_logp.sum(), logits, retain_graph=True)
    torch.testing.assert_close(g_logp, r_logp)
    (g_ent,) = torch.autograd.grad(vocab_parallel_entropy(logits, chunk_size=2).sum(), logits)
    (r_ent,) = torch.autograd.grad(ref_ent.sum(), logits)
    torch.testing.assert_close(g_ent, r_ent)
    torch.testing.assert_close(vocab_parallel_entropy(logits), ref_ent)


def test_gradcheck_float64():
    torch.manual_seed(2)
    logits = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (2, 3))
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_log_probs_and_entropy(x, targets, chunk_size=4), (logits,)
    )


def test_bf16_logits_computed_in_fp32():
    torch.manual_seed(3)
    logits = (torch.randn(4, 6, 64) * 8).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 64, (4, 6))
    logp, entropy = vocab_parallel_log_probs_and_entropy(logits, targets)
    assert logp.dtype == torch.float32
    ref_logp, ref_ent = _reference(logits.detach(), targets)  # exact fp32 on the bf16 values
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_ent, atol=1e-5, rtol=1e-5)
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_large_logits_do_not_overflow():
    logits = torch.tensor([[1000.0, 0.0, -1000.0]])
    logp = vocab_parallel_log_probs(logits, torch.tensor([0]))
    torch.testing.assert_close(logp, torch.tensor([0.0]))


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="targets shape"):
        vocab_parallel_log_probs(torch.randn(2, 3, 5), torch.zeros(3, 2, dtype=torch.long))


def test_padded_vocabulary_columns_are_excluded():
    torch.manual_seed(4)
    padded = torch.randn(3, 4, 64, requires_grad=True)  # real vocabulary 50, padded to 64
    targets = torch.randint(0, 50, (3, 4))
    up_logp, up_ent = torch.randn(3, 4), torch.randn(3, 4)
    logp, entropy = vocab_parallel_log_probs_and_entropy(padded, targets, vocab_size=50, chunk_size=5)
    (logp * up_logp + entropy * up_ent).sum().backward()

    real = padded.detach()[..., :50].clone().requires_grad_(True)
    ref_logp, ref_ent = _reference(real, targets)
    (ref_logp * up_logp + ref_ent * up_ent).sum().backward()
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(entropy, ref_ent)
    torch.testing.assert_close(padded.grad[..., :50], real.grad)
    assert padded.grad[..., 50:].abs().max().item() == 0.0
    # without vocab_size the padding columns would change the result
    assert (vocab_parallel_log_probs(padded, targets) - ref_logp).abs().max().item() > 1e-3
