"""Per-GPU training throughput of our megatron-core model at TP=2 and DP=2 against one GPU.

    python benchmarks/scaling.py --shape qwen2_5_7b --seq 4096              # needs 2 GPUs
    python benchmarks/scaling.py --shape tiny --device cpu --seq 128 --steps 2 --warmup 1   # gloo smoke

The command starts `torchrun --standalone` three times (1 process; 2 processes at DP=2; 2 at TP=2),
each running one training step loop of `benchmarks/train_step.py`'s megatron-core case (bf16, fused
AdamW, our spec, compiled log-probs) on the same micro-batch per data-parallel rank. DP=2 reduces the
gradients with megatron-core's DDP (bucketed all-reduce overlapped with the backward pass, as the
trainer's `overlap_grad_reduce: true`), or with `--ddp flat` one all-reduce after the backward pass.
Efficiency = (tokens/s per GPU of the layout) / (tokens/s of one GPU). Each layout also reports the
all-reduce bus bandwidth it measured (64 MiB, nccl-tests' busbw). Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LAYOUTS = {"1gpu": (1, 1), "dp2": (2, 1), "tp2": (2, 2), "dp4": (4, 1), "tp2dp2": (4, 2), "tp4": (4, 4)}  # name -> (processes, TP)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).parent))
    from train_step import hf_config_dict, make_batch, optimizer, profile_step

    from trinity.distributed import parallel
    from trinity.distributed.layout import ParallelLayout
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts
    from trinity.models.logprobs import decoder_hidden, token_logprobs
    from trinity.config.megatron import MegatronConfig

    nproc, tp = LAYOUTS[args.worker]
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    parallel.init_parallel(device=args.device, layout=ParallelLayout(tp=tp), seed=1234)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(hf_config_dict(args.shape, args.seq)))
            facts = ModelFacts.from_hf_dir(Path(tmp))
        megatron = MegatronConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1 and args.sequence_parallel,
                                  torch_compile=args.compile)
        (model,) = build_model(facts, megatron, device=device.type, dtype=dtype)
        opt = optimizer(model.parameters(), device)
        batch = make_batch(model.vocab_size, args.seq, args.mbs, False, device, seed=dist.get_rank() // tp)
        dp = nproc // tp
        params = [p for p in model.parameters() if p.requires_grad]
        ddp = None
        if dp > 1 and args.ddp == "megatron":
            # The trainer's reducer: megatron-core DDP, bucketed all-reduce overlapped with the backward
            # pass (bf16 grad buffer so the same fused AdamW steps on it as in the other layouts).
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.utils import get_model_config

            ddp = DistributedDataParallel(
                config=get_model_config(model), module=model,
                ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=True),
            )

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            if ddp is not None:
                ddp.zero_grad_buffer()
            hidden = decoder_hidden(model, batch["tokens"], batch["position_ids"], None)
            (-token_logprobs(model, hidden, batch["labels"]).mean()).backward()
            if ddp is not None:
                ddp.finish_grad_sync()
                for p in params:
                    p.grad = p.main_grad
            elif dp > 1:
                grads = [p.grad for p in params]
                flat = torch.cat([g.reshape(-1) for g in grads]).div_(dp)
                dist.all_reduce(flat)
                offset = 0
                for g in grads:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
            opt.step()

        for _ in range(args.warmup):
            step()
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        seconds = (time.perf_counter() - t0) / args.steps
        busbw = allreduce_busbw(device, nproc) if nproc > 1 else None
        if args.profile:
            if dist.get_rank() == 0:
                print(f"--- profile {args.worker} (rank 0)", flush=True)
                profile_step(step, device, None, rows=25)
            else:
                step()
        if dist.get_rank() == 0:
            tokens = args.seq * args.mbs * dp  # per step, all data-parallel ranks
            Path(args.json).write_text(json.dumps({
                "layout": args.worker, "gpus": nproc, "tp": tp, "dp": dp, "step_s": seconds,
                "tokens_per_s": tokens / seconds, "tokens_per_s_per_gpu": tokens / seconds / nproc,
                "allreduce_busbw_gbs": busbw,
            }))
    finally:
        parallel.destroy()


def allreduce_busbw(device: Any, nproc: int, mib: int = 64, iters: int = 20) -> float:
    """All-reduce bus bandwidth in GB/s (nccl-tests' definition: 2(n-1)/n x bytes / time)."""
    import torch
    import torch.distributed as dist

    x = torch.ones(mib * 2**20 // 2, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device)
    for _ in range(3):
        dist.all_reduce(x)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    sync()
    seconds = (time.perf_counter() - t0) / iters
    return 2 * (nproc - 1) / nproc * x.numel() * x.element_size() / seconds / 1e9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(layout: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    nproc, _ = LAYOUTS[layout]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", __file__, "--worker", layout, "--json", str(out),
           "--shape", args.shape, "--device", args.device, "--seq", str(args.seq), "--mbs", str(args.mbs),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--compile", args.compile, "--ddp", args.ddp]
    cmd += (["--profile"] if args.profile else []) + (["--sequence-parallel"] if args.sequence_parallel else [])
    subprocess.run(cmd, check=True, timeout=args.timeout)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2_5_0_5b")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--timeout", type=int, default=600, help="seconds per torchrun")
    p.add_argument("--ddp", choices=["megatron", "flat"], default="megatron",
                   help="DP=2 gradient reduction: megatron-core DDP (overlapped buckets) or one flat all-reduce after backward")
    p.add_argument("--compile", choices=["none", "layers", "model"], default="none", help="megatron.torch_compile")
    p.add_argument("--sequence-parallel", action="store_true", help="megatron.sequence_parallel at TP=2")
    p.add_argument("--profile", action="store_true", help="print rank 0's top kernels for one step per layout")
    p.add_argument("--worker", choices=sorted(LAYOUTS), default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts.split(","):
            rows.append(launch(layout, args, Path(tmp) / f"{layout}.json"))
    base = next((r["tokens_per_s_per_gpu"] for r in rows if r["layout"] == "1gpu"), None)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"\nscaling, shape {args.shape}, seq {args.seq} x mbs {args.mbs}, device {args.device}, "
          f"torch_compile {args.compile}, sequence_parallel {args.sequence_parallel}, DP reducer {args.ddp}")
    print("layout | gpus | step s | tokens/s | tokens/s per gpu | efficiency | all-reduce bus GB/s")
    for r in rows:
        eff = f"{r['tokens_per_s_per_gpu'] / base:.2f}" if base else "-"
        bw = f"{r['allreduce_busbw_gbs']:.0f}" if r.get("allreduce_busbw_gbs") else "-"
        print(f"{r['layout']} | {r['gpus']} | {r['step_s']:.4f} | {r['tokens_per_s']:.0f} | "
              f"{r['tokens_per_s_per_gpu']:.0f} | {eff} | {bw}")


if __name__ == "__main__":
    main()
