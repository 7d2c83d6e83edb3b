"""Conversion benchmark: a random Qwen2-shaped HF checkpoint, HF -> MCore -> HF, next to the disk floor.

    python benchmarks/convert.py --shape small   # CPU check (a few seconds)
    python benchmarks/convert.py --shape 7b      # Qwen2.5-7B shape, ~15 GB bf16 (GPU machine)

Each conversion runs in its own process so that its peak resident memory (ru_maxrss) is its own.
The disk floor is reading the same shard bytes plus writing them again with fsync, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064),
    "medium": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=8, num_attention_heads=12,
                   num_key_value_heads=2, vocab_size=151936),
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=32000),
}


def make_checkpoint(out: Path, shape: dict) -> int:
    """Random bf16 Qwen2 checkpoint written tensor by tensor (never the whole model in memory)."""
    import torch

    from trinity.convert.hf_io import write_shards

    h, f, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv, V = shape["num_attention_heads"], shape["num_key_value_heads"], shape["vocab_size"]
    hd = h // heads

    def tensors():
        g = torch.Generator().manual_seed(0)

        def r(*s):
            return (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)

        yield "model.embed_tokens.weight", r(V, h)
        for i in range(L):
            p = f"model.layers.{i}"
            yield f"{p}.input_layernorm.weight", r(h)
            yield f"{p}.post_attention_layernorm.weight", r(h)
            for n, rows in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd)):
                yield f"{p}.self_attn.{n}_proj.weight", r(rows, h)
                yield f"{p}.self_attn.{n}_proj.bias", r(rows)
            yield f"{p}.self_attn.o_proj.weight", r(h, heads * hd)
            yield f"{p}.mlp.gate_proj.weight", r(f, h)
            yield f"{p}.mlp.up_proj.weight", r(f, h)
            yield f"{p}.mlp.down_proj.weight", r(h, f)
        yield "model.norm.weight", r(h)
        yield "lm_head.weight", r(V, h)

    out.mkdir(parents=True)
    written, _ = write_shards(tensors(), out, dtype=None)
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": "bfloat16",
           "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "tie_word_embeddings": False, "hidden_act": "silu", **shape}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return written


def disk_floor(src: Path, scratch: Path) -> tuple[float, float, int]:
    """Seconds to read every shard of `src`, and to write as many bytes with fsync."""
    files = sorted(src.glob("*.safetensors"))
    buf = bytearray(64 << 20)
    total = 0
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(scratch, "wb", buffering=0) as fh:
        left = total
        while left:
            n = fh.write(memoryview(buf)[: min(left, len(buf))])
            left -= n
        os.fsync(fh.fileno())
    write_s = time.perf_counter() - t0
    scratch.unlink()
    return read_s, write_s, total


def _child(step: str, src: str, dst: str, dtype: str) -> None:
    import megatron.core  # noqa: F401  imports before the baseline: they are not the conversion's memory
    import transformers  # noqa: F401

    import trinity.convert.jobs  # noqa: F401
    from trinity.convert.api import hf_to_mcore, mcore_to_hf

    # ru_maxrss is inherited across fork/exec on Linux, so sample this process's RSS instead.
    import threading

    import psutil

    me = psutil.Process()
    base = me.memory_info().rss
    peak = base
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.005):
            peak = max(peak, me.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    report = hf_to_mcore(src, dst, dtype=dtype) if step == "hf-to-mcore" else mcore_to_hf(src, dst)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    print("RESULT " + json.dumps({"seconds": seconds, "bytes": report.bytes_written, "peak_rss": peak, "base_rss": base}))


def _run_step(step: str, src: Path, dst: Path, dtype: str) -> dict:
    cmd = [sys.executable, __file__, "--child", step, str(src), str(dst), dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{step} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--workdir", default=None, help="where to write (default: a temp folder, removed after)")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="trinity-bench-"))
    try:
        src = work / "hf"
        t0 = time.perf_counter()
        hf_bytes = make_checkpoint(src, SHAPES[args.shape])
        print(f"random {args.shape} checkpoint: {hf_bytes / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")
        read_s, write_s, _ = disk_floor(src, work / "floor.bin")
        to_mcore = _run_step("hf-to-mcore", src, work / "mcore", args.dtype)
        to_hf = _run_step("mcore-to-hf", work / "mcore", work / "back", args.dtype)
        floor = read_s + write_s
        gb = hf_bytes / 1e9
        print(f"\n{'step':<32}{'seconds':>9}{'GB':>8}{'GB/s':>8}{'x floor':>9}{'peak RSS GB':>13}{'above imports':>15}")
        print(f"{'disk floor (read + fsync write)':<32}{floor:>9.2f}{gb:>8.2f}{gb / floor:>8.2f}{1.0:>9.2f}")
        for name, r in (("hf-to-mcore", to_mcore), ("mcore-to-hf", to_hf)):
            print(f"{name:<32}{r['seconds']:>9.2f}{r['bytes'] / 1e9:>8.2f}{gb / r['seconds']:>8.2f}"
                  f"{r['seconds'] / floor:>9.2f}{r['peak_rss'] / 1e9:>13.2f}{(r['peak_rss'] - r['base_rss']) / 1e9:>15.2f}")
        print(f"(model bytes in the checkpoint dtype: {gb:.2f} GB; on CPU the model is held in fp32: {2 * gb:.2f} GB)")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(*sys.argv[2:6])
    else:
        main()
