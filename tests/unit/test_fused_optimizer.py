"""megatron-core's optimizer on torch's fused / multi-tensor kernels (trinity.compat.fused_optimizer)
computes what megatron-core's stock fallbacks compute, on the real optimizer, CPU/gloo."""

from __future__ import annotations

import pytest
import torch

from trinity.testing.optim_checks import megatron_stock, trainer_steps
from trinity.compat import fused_optimizer


def test_l2_norm_is_the_norm_of_all_tensors_as_one_vector():
    tensors = [torch.randn(3, 4), torch.randn(7), torch.randn(2, 2, 2)]
    norm, per = fused_optimizer.l2_norm(0, None, [tensors], False)
    expected = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in tensors]))
    assert per is None and norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm[0], expected, rtol=1e-6, atol=0)
    with pytest.raises(NotImplementedError):
        fused_optimizer.l2_norm(0, None, [tensors], True)


def test_scale_copies_casts_and_scales_in_place():
    src = [torch.randn(5), torch.randn(2, 3)]
    dst = [torch.empty(5, dtype=torch.bfloat16), torch.empty(2, 3, dtype=torch.bfloat16)]
    fused_optimizer.scale(0, None, [src, dst], 1.0)  # main params -> model params
    for s, d in zip(src, dst):
        assert torch.equal(d, s.to(torch.bfloat16))
    fused_optimizer.scale(0, None, [src, dst], 0.5)
    for s, d in zip(src, dst):
        assert torch.equal(d, (s * 0.5).to(torch.bfloat16))
    before = [s.clone() for s in src]
    fused_optimizer.scale(0, None, [src, src], 0.25)  # gradient clipping scales in place
    for b, s in zip(before, src):
        assert torch.equal(s, b * 0.25)


def test_install_replaces_only_the_local_fallbacks_and_uninstall_restores():
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer
    from megatron.core import utils

    fused_optimizer.uninstall()
    assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm  # no TE / apex here
    assert fused_optimizer.install() and fused_optimizer.install()
    assert clip_grads.l2_norm_impl is fused_optimizer.l2_norm
    assert clip_grads.multi_tensor_scale_impl is optimizer.multi_tensor_scale_impl is fused_optimizer.scale
    fused_optimizer.uninstall()
    assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm
    assert optimizer.multi_tensor_scale_impl is utils.local_multi_tensor_scale


@pytest.fixture(scope="module")
def tiny(tiny_qwen2_tp1):
    yield tiny_qwen2_tp1
    fused_optimizer.uninstall()


@pytest.mark.parametrize("distributed", [True, False])
def test_trainer_optimizer_on_fused_kernels_matches_megatron_fallbacks(tiny, distributed):
    facts, path = tiny
    adams, norms, start, fused = trainer_steps(facts, path, device="cpu", dtype=torch.float32, distributed=distributed)
    assert adams and all(g["fused"] and not g["foreach"] for a in adams for g in a.param_groups)
    assert all(isinstance(s["step"], torch.Tensor) and s["step"].dtype == torch.float32
               for a in adams for s in a.state.values())

    with megatron_stock():
        adams, stock_norms, _, stock = trainer_steps(facts, path, device="cpu", dtype=torch.float32,
                                                     distributed=distributed)
    assert not any(g["fused"] for a in adams for g in a.param_groups)

    assert norms[0] > 1e-3 * 10  # clipping was active
    assert norms == pytest.approx(stock_norms, rel=1e-5)
    assert min((a - b).abs().max().item() for a, b in zip(start, fused)) > 1e-3  # every tensor trained
    for a, b in zip(stock, fused):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
