"""`trinity convert` with `--device cuda`: the weights travel through host memory (a holder built on the
CPU inside an NCCL process group) and the checks compute their logits on the GPU. Skipped without CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_cuda_conversion_both_ways_verified(tmp_path, family):
    from safetensors.torch import load_file

    from trinity.convert.api import hf_to_mcore, mcore_to_hf
    from trinity.testing.tiny_models import make_tiny_hf_model

    src = make_tiny_hf_model(family, tmp_path / "hf")
    to_mcore = hf_to_mcore(str(src), str(tmp_path / "mc"), dtype="bf16", verify=True, device="cuda")
    assert to_mcore.max_abs_diff is not None and to_mcore.max_abs_diff <= 1e-4
    assert list(to_mcore.phases) == ["build", "load", "save"]
    back = mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "back"), verify=True, device="cuda")
    assert back.max_abs_diff == 0.0 and "bit for bit" in (back.verified or "")
    # A dtype change is checked by logits, computed on the GPU from a float32 model.
    fp32 = mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "fp32"), dtype="fp32", verify=True, device="cuda")
    assert "logits" in (fp32.verified or "") and fp32.max_abs_diff <= 1e-4
    exported = load_file(str(tmp_path / "back" / "model-00001-of-00001.safetensors"))
    source = load_file(str(src / "model.safetensors"))
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor.to(torch.bfloat16)), name
