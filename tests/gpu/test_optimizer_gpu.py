"""The trainer's optimizer on CUDA: torch's fused AdamW and the multi-tensor norm / scale of
trinity.compat.fused_optimizer step bf16 params (fp32 master weights) as megatron-core's stock
fallbacks do."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def cuda_tiny(tmp_path_factory):
    from trinity.compat import cpu_compat
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.facts import ModelFacts
    from trinity.testing.tiny_models import make_tiny_hf_model

    cpu_compat.disable()
    path = make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen2"))
    init_parallel(device="cuda", layout=ParallelLayout(), seed=5)
    yield ModelFacts.from_hf_dir(path), path
    destroy()


@pytest.mark.parametrize("distributed", [True, False])
def test_fused_optimizer_matches_megatron_stock_on_cuda(cuda_tiny, distributed):
    from trinity.testing.optim_checks import megatron_stock, no_grad_fusion, trainer_steps

    facts, path = cuda_tiny
    with no_grad_fusion():  # the same gradients on both sides (the fusion is tested below)
        adams, norms, start, fused = trainer_steps(facts, path, device="cuda", dtype=torch.bfloat16,
                                                   distributed=distributed)
    assert adams and all(g["fused"] for a in adams for g in a.param_groups)
    assert all(s["step"].device.type == "cuda" for a in adams for s in a.state.values())
    with megatron_stock():
        _, stock_norms, _, stock = trainer_steps(facts, path, device="cuda", dtype=torch.bfloat16,
                                                 distributed=distributed)
    # the first norm is over the same gradients; later ones over bf16 params that may differ in a last bit
    assert norms[0] > 1e-2 and norms[0] == pytest.approx(stock_norms[0], rel=1e-5)
    assert norms == pytest.approx(stock_norms, rel=2e-3)
    # bf16 copies of fp32 masters that differ by float rounding: equal but for rare last-bit flips
    moved = sum(float((a.float() - b.float()).abs().sum()) for a, b in zip(start, fused))
    differ = sum(float((a.float() - b.float()).abs().sum()) for a, b in zip(stock, fused))
    assert differ < 1e-3 * moved, (differ, moved)


@pytest.mark.parametrize("tied", [True, False])
def test_weight_gradients_accumulate_into_the_fp32_buffer(tmp_path, tied):
    """trinity.trainer.engine.grad_fusion: eager CUDA linear layers add their weight gradients into DDP's fp32
    buffer inside the GEMM. Over two micro batches the buffer equals DDP's own path (bf16 gradients
    added by its hook) to bf16 rounding, and a tied output layer is left to DDP's hook (the embedding's
    gradient of the same weight would be lost otherwise)."""
    import contextlib

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.compat import cpu_compat
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts
    from trinity.testing.optim_checks import TOKENS, no_grad_fusion
    from trinity.testing.tiny_models import make_tiny_hf_model
    from trinity.trainer.engine.setup import wrap_ddp

    cpu_compat.disable()
    path = make_tiny_hf_model("qwen2", tmp_path, tie_word_embeddings=tied)
    facts = ModelFacts.from_hf_dir(path)

    def grads(fused: bool):
        chunks = build_model(facts, MegatronConfig(), device="cuda", dtype=torch.bfloat16)
        load_hf_weights(chunks, path, facts)
        with contextlib.nullcontext() if fused else no_grad_fusion():
            (ddp,) = wrap_ddp(chunks, MegatronConfig())
        ddp.zero_grad_buffer()
        tokens = torch.tensor(TOKENS, device="cuda")
        positions = torch.arange(tokens.shape[1], device="cuda").expand_as(tokens)
        for row in range(2):  # two micro batches accumulate
            out = ddp(tokens[row:row + 1], positions[row:row + 1], None)
            out.float().log_softmax(-1)[..., 1].mean().neg().backward()
        linear = [m for m in chunks[0].modules() if type(m) in (ColumnParallelLinear, RowParallelLinear)]
        # megatron marks a weight whose gradient its GEMM added into main_grad
        added = [m for m in linear if getattr(m.weight, "grad_added_to_main_grad", False)]
        return {n: p.main_grad.double() for n, p in chunks[0].named_parameters()}, linear, added

    init_parallel(device="cuda", layout=ParallelLayout(), seed=5)
    try:
        fused, linear, added = grads(True)
        plain, _, none_added = grads(False)
    finally:
        destroy()
    assert not none_added
    assert added == ([m for m in linear if m is not linear[-1]] if tied else linear)  # output layer last
    for name, want in plain.items():
        assert float(want.norm()) > 0, name
        assert float((fused[name] - want).norm() / want.norm()) < 2e-2, name
