"""benchmarks/train_step.py: the per-kind GPU time summary of a profiled step (pure logic; a CPU
profiler has no GPU rows, so the rows are built with the fields `key_averages()` gives)."""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import torch

from tests.conftest import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("bench_train_step", REPO / "benchmarks" / "train_step.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _row(key: str, ms: float, count: int, device=torch.autograd.DeviceType.CUDA, **kw):
    return SimpleNamespace(key=key, device_type=device, self_device_time_total=ms * 1e3, count=count, **kw)


def test_kernel_kinds_count_kernels_once_and_skip_annotations_and_host_rows():
    rows = [
        _row("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT", 70.0, 85),
        _row("void at::native::multi_tensor_apply_kernel<...>", 42.2, 364),
        _row("Optimizer.step#AdamW.step", 42.8, 1),  # spans the optimizer kernels above
        _row("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", 23.0, 28),
        _row("triton_poi_fused_mul_silu_split_0", 3.0, 28),
        _row("my_range", 9.0, 1, is_user_annotation=True),
        _row("aten::mm", 243.0, 339, device=torch.autograd.DeviceType.CPU),  # the host op, not a kernel
    ]
    totals = _bench().kernel_kind_totals(rows)
    assert totals == {"gemm": [70.0, 85], "optimizer": [42.2, 364], "attention": [23.0, 28],
                      "compiled (triton)": [3.0, 28]}
