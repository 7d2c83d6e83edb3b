"""One layer's core attention over packed rows, per kernel: forward and forward+backward time.

    python benchmarks/attention.py --shape 0.5b,7b,tiny           # CUDA: every kernel
    python benchmarks/attention.py --shape tiny --device cpu      # CPU smoke: causal and dense only

Each case calls `trinity.models.attention.SDPACoreAttention` the way a layer does (megatron's
[s, b, heads, d] layout, q/k/v strided views of one projection, GQA), so layout copies count. Rows hold
documents of random lengths (64..s/2) back to back; "causal" is the same tokens unpacked (one document
per row, SDPA's causal kernel), the others attend within documents: `varlen` (flash over the document
boundaries), `flex` (FlexAttention block mask), `dense` (SDPA with the [b, 1, s, s] mask). The
boundaries / block mask are built once per case, outside the timing. `tiny` is host-bound: its times
are the host cost of a call. Prints a table last.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

SHAPES = {  # rows x seq, query heads / KV heads, head dim (the Qwen2.5 shapes of train_step.py)
    "0.5b": dict(b=2, s=4096, heads=14, groups=2, d=64),
    "7b": dict(b=1, s=4096, heads=28, groups=4, d=128),
    "tiny": dict(b=2, s=256, heads=14, groups=2, d=64),
}


def document_ids(b: int, s: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(b, s, dtype=torch.long)
    for row in range(b):
        start, doc = 0, 0
        while start < s:
            n = min(int(torch.randint(64, max(65, s // 2 + 1), (1,), generator=g)), s - start)
            ids[row, start:start + n] = doc
            start, doc = start + n, doc + 1
    return ids


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Milliseconds per call, after 3 warm-up calls (FlexAttention compiles in the first)."""
    for _ in range(3):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps * 1e3


def run_shape(name: str, device: torch.device, kernels: list[str], reps: int) -> list[dict[str, object]]:
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from trinity.models.attention import SDPACoreAttention, document_packed_params

    shape = SHAPES[name]
    b, s, heads, groups, d = (shape[k] for k in ("b", "s", "heads", "groups", "d"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=d, attention_dropout=0.0)
    attn = SDPACoreAttention(config, 1, AttnMaskType.causal, "self")
    qkv = torch.randn(s, b, groups, heads // groups + 2, d, device=device, dtype=dtype, requires_grad=True)
    q = qkv[:, :, :, : heads // groups].reshape(s, b, heads, d)
    k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
    doc_ids = document_ids(b, s)
    grad = torch.randn(s, b, heads * d, device=device, dtype=dtype)
    rows = []
    for kernel in kernels:
        if kernel == "causal":
            call = lambda: attn(q, k, v, None)  # noqa: E731
        else:
            params = document_packed_params(doc_ids, device=device, kernel=kernel)
            call = lambda p=params: attn(q, k, v, None, packed_seq_params=p)  # noqa: E731
        with torch.no_grad():
            fwd = timed(call, device, reps)
        both = timed(lambda: torch.autograd.grad(call(), qkv, grad), device, reps)
        rows.append(dict(shape=name, kernel=kernel, fwd_ms=fwd, fwd_bwd_ms=both,
                         docs=int(doc_ids.max(1).values.sum() + b)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="0.5b,7b", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--kernels", default=None, help="comma list of causal, varlen, flex, dense (default: all the device runs)")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()

    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    kernels = (args.kernels or ("causal,varlen,flex,dense" if device.type == "cuda" else "causal,dense")).split(",")
    init_parallel(device=args.device, layout=ParallelLayout(), seed=0)
    try:
        rows = [r for name in args.shape.split(",") for r in run_shape(name, device, kernels, args.reps)]
    finally:
        destroy()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\ncore attention per layer on {where}, torch {torch.__version__}")
    print("shape | kernel | documents | fwd ms | fwd+bwd ms")
    for r in rows:
        print(f"{r['shape']} | {r['kernel']} | {r['docs']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f}")


if __name__ == "__main__":
    main()
