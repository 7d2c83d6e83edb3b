"""trinity.trainer.profiling: the per-kind GPU time summary (pure logic; a CPU profiler has no GPU rows,
so those rows are built with the fields `key_averages()` gives) and a real profiled step on CPU."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import torch

from trinity.trainer.profiling import StepProfiler, kernel_kind_table, kernel_kind_totals, summary_path, trace_path


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
    totals = kernel_kind_totals(rows)
    assert totals == {"gemm": [70.0, 85], "optimizer": [42.2, 364], "attention": [23.0, 28],
                      "compiled (triton)": [3.0, 28]}
    lines = kernel_kind_table(totals, wall_s=0.2)
    assert lines[0] == "GPU busy 138.2 ms of a 200.0 ms profiled step"
    assert lines[2] == "gemm | 70.0 | 85 | 50.7%"  # largest first, share of busy time
    assert lines[-1].startswith("compiled (triton) | 3.0 | 28 |")


def test_step_profiler_traces_only_its_step(tmp_path):
    prof = StepProfiler(2, tmp_path, rank=0, device=torch.device("cpu"))
    a = torch.randn(64, 64)
    for step in (1, 2, 3):
        with prof.step(step) as profiled:
            (a @ a).sum()
        assert profiled == (step == 2)
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["step_2.rank_0.json.gz", "step_2.rank_0.txt"]
    trace = json.loads(gzip.decompress(trace_path(tmp_path, 2, 0).read_bytes()))
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    assert prof.summary[0] == f"profiled step 2: trace {trace_path(tmp_path, 2, 0)}"
    assert any(line.startswith("aten::mm |") for line in prof.summary)
    assert summary_path(tmp_path, 2, 0).read_text() == "\n".join(prof.summary) + "\n"


def _job_cfg(write_job, small_job, profile_step=None, **actor):
    from trinity.config.loader import load_config

    job = {**small_job, "trainer": {**small_job["trainer"], "total_steps": 6, "profile_step": profile_step}}
    job["actor_rollout_ref"] = {"actor": actor}
    return load_config(write_job(job)).config


def test_verl_profile_block_profiles_a_step_range_on_listed_ranks(tmp_path, write_job, small_job):
    """verl's `actor.profile`: steps counted from 0, [step_start, step_end) -> trinity steps 3 and 4,
    on ranks 0 and 2 only, into save_path, with the per-step summary beside each trace."""
    save = tmp_path / "verl_prof"
    cfg = _job_cfg(write_job, small_job, profile={"use_profile": True, "profile_ranks": [0, 2], "step_start": 2,
                                                 "step_end": 4, "save_path": str(save)})
    a = torch.randn(32, 32)
    for rank in (0, 1, 2):
        prof = StepProfiler.from_config(cfg, tmp_path / "out", rank, torch.device("cpu"))
        marked = []
        for step in range(1, 7):
            with prof.step(step) as profiled:
                (a @ a).sum()
            marked.append(profiled)
        assert marked == ([False, False, True, True, False, False] if rank != 1 else [False] * 6), rank
    assert sorted(p.name for p in save.iterdir()) == sorted(
        f"step_{s}.rank_{r}.{ext}" for s in (3, 4) for r in (0, 2) for ext in ("json.gz", "txt"))
    assert not (tmp_path / "out").exists()
    assert summary_path(tmp_path, 4, 2, save).read_text().startswith(f"profiled step 4: trace {save / 'step_4.rank_2.json.gz'}")


def test_verl_profiler_block_and_short_form(tmp_path, write_job, small_job):
    """verl's newer `actor.profiler` picks the ranks of trainer.profile_step; the short form alone
    profiles that step on every rank into <output_dir>/profile."""
    short = _job_cfg(write_job, small_job, profile_step=2)
    assert all(StepProfiler.from_config(short, tmp_path, r, torch.device("cpu")).steps == {2} for r in (0, 5))
    cfg = _job_cfg(write_job, small_job, profile_step=2, profiler={"enable": True, "ranks": [1], "tool": "torch"})
    assert StepProfiler.from_config(cfg, tmp_path, 1, torch.device("cpu")).steps == {2}
    assert StepProfiler.from_config(cfg, tmp_path, 0, torch.device("cpu")).steps == frozenset()
    none = _job_cfg(write_job, small_job)
    assert StepProfiler.from_config(none, tmp_path, 0, torch.device("cpu")).steps == frozenset()
