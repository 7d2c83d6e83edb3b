"""torch's fused AdamW over a model's parameter list against the same AdamW over one flat tensor of the
same number of elements, at a Qwen2.5 shape's real tensor sizes, next to the copy-rate floor.

    python benchmarks/adamw.py --shape qwen2_5_7b --dtype bf16          # the bare step's optimizer
    python benchmarks/adamw.py --shape qwen2_5_1_5b --dtype fp32        # the trainer's master weights

An AdamW step reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq: 7 accesses
per element (14 bytes in bf16, 28 in fp32). floor = those bytes / the copy rate measured in the same
run (reads and writes counted). The list case is what `torch.optim.AdamW(model.parameters(),
fused=True)` runs; the flat case is what it runs over one contiguous buffer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import bandwidth  # noqa: E402
from train_step import SHAPES  # noqa: E402


def tensor_shapes(cfg: dict) -> list[tuple[int, ...]]:
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    layer = [(h,), (h + 2 * kv, h), (h + 2 * kv,), (h, h), (h,), (2 * f, h), (h, f)]
    head = [(v, h)] + ([] if cfg["tie_word_embeddings"] else [(v, h)]) + [(h,)]
    return head + layer * cfg["num_hidden_layers"]


def time_step(params: list[torch.Tensor], reps: int) -> float:
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=True)
    for _ in range(2):
        opt.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    del opt
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2_5_7b")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    shapes = tensor_shapes(SHAPES[args.shape])
    numel = sum(torch.Size(s).numel() for s in shapes)
    bw = bandwidth(torch.device("cuda"))
    floor_ms = 7 * dtype.itemsize * numel / bw * 1e3
    rows = []
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype) * 0.02) for s in shapes]
    rows.append(("torch fused, list", len(params), time_step(params, args.reps)))
    del params
    torch.cuda.empty_cache()
    flat = [torch.nn.Parameter(torch.randn(numel, device="cuda", dtype=dtype) * 0.02)]
    rows.append(("torch fused, flat", 1, time_step(flat, args.reps)))
    print(f"\nAdamW step on {torch.cuda.get_device_name()}, {args.shape}, {numel / 1e9:.2f}B elements, {args.dtype}, "
          f"copy rate {bw / 1e12:.2f} TB/s, floor {floor_ms:.1f} ms, torch {torch.__version__}")
    print("optimizer, tensors | ms | % of floor | TB/s")
    for name, n, ms in rows:
        print(f"{name} ({n}) | {ms:.2f} | {100 * floor_ms / ms:.0f}% | {7 * dtype.itemsize * numel / ms / 1e9:.2f}")


if __name__ == "__main__":
    main()
