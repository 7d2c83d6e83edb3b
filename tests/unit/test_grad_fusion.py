"""trinity.trainer.engine.grad_fusion on CPU: the apex-contract GEMM for half-precision buffers, and CPU
chunks left to DDP's hook (the fp32-output GEMM is CUDA-only; tests/gpu/test_optimizer_gpu.py runs it)."""

from __future__ import annotations

import torch

from trinity.compat.grad_fusion import TorchWgradGemm


def test_half_precision_buffer_accumulates_the_weight_gradient():
    g = torch.Generator().manual_seed(0)
    total_input = torch.randn(12, 5, generator=g).to(torch.bfloat16)
    grad_output = torch.randn(12, 3, generator=g).to(torch.bfloat16)
    main_grad = torch.randn(3, 5, generator=g).to(torch.bfloat16)
    want = main_grad.float() + grad_output.float().t() @ total_input.float()
    TorchWgradGemm.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
    torch.testing.assert_close(main_grad.float(), want, rtol=2e-2, atol=2e-2)


def test_cpu_chunks_keep_ddp_hooks(tmp_path):
    from trinity.config.megatron import MegatronConfig
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts
    from trinity.testing.tiny_models import make_tiny_hf_model
    from trinity.trainer.engine.setup import wrap_ddp

    facts = ModelFacts.from_hf_dir(make_tiny_hf_model("qwen2", tmp_path))
    init_parallel(device="cpu", layout=ParallelLayout(), seed=1)
    try:
        chunks = build_model(facts, MegatronConfig(), device="cpu", dtype=torch.float32)
        wrap_ddp(chunks, MegatronConfig())
        linear = [m for m in chunks[0].modules() if hasattr(m, "gradient_accumulation_fusion")]
        assert linear and not any(m.gradient_accumulation_fusion for m in linear)
    finally:
        destroy()
