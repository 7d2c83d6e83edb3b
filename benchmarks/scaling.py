"""Per-GPU training throughput of our megatron-core model at TP=2 and DP=2 against one GPU.

    python benchmarks/scaling.py --shape qwen2_5_7b --seq 4096              # needs 2 GPUs
    python benchmarks/scaling.py --shape tiny --device cpu --seq 128 --steps 2 --warmup 1   # gloo smoke

The command starts `torchrun --standalone` three times (1 process; 2 processes at DP=2; 2 at TP=2),
each running one training step loop of `benchmarks/train_step.py`'s megatron-core case (bf16, fused
AdamW, our spec, compiled log-probs) on the same micro-batch per data-parallel rank. DP=2 all-reduces
the gradients (one flat bucket, averaged) before the optimizer, as DDP does without overlap. Efficiency
= (tokens/s per GPU of the layout) / (tokens/s of one GPU). Prints a table last.
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

LAYOUTS = {"1gpu": (1, 1), "dp2": (2, 1), "tp2": (2, 2)}  # name -> (processes, TP)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).parent))
    from train_step import hf_config_dict, make_batch, optimizer

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
        megatron = MegatronConfig(tensor_model_parallel_size=tp)
        (model,) = build_model(facts, megatron, device=device.type, dtype=dtype)
        opt = optimizer(model.parameters(), device)
        batch = make_batch(model.vocab_size, args.seq, args.mbs, False, device, seed=dist.get_rank() // tp)
        dp = nproc // tp
        params = [p for p in model.parameters() if p.requires_grad]

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            hidden = decoder_hidden(model, batch["tokens"], batch["position_ids"], None)
            (-token_logprobs(model, hidden, batch["labels"]).mean()).backward()
            if dp > 1:
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
        if dist.get_rank() == 0:
            tokens = args.seq * args.mbs * dp  # per step, all data-parallel ranks
            Path(args.json).write_text(json.dumps({
                "layout": args.worker, "gpus": nproc, "tp": tp, "dp": dp, "step_s": seconds,
                "tokens_per_s": tokens / seconds, "tokens_per_s_per_gpu": tokens / seconds / nproc,
            }))
    finally:
        parallel.destroy()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(layout: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    nproc, _ = LAYOUTS[layout]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", __file__, "--worker", layout, "--json", str(out),
           "--shape", args.shape, "--device", args.device, "--seq", str(args.seq), "--mbs", str(args.mbs),
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
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
    print(f"\nscaling, shape {args.shape}, seq {args.seq} x mbs {args.mbs}, device {args.device}")
    print("layout | gpus | step s | tokens/s | tokens/s per gpu | efficiency")
    for r in rows:
        eff = f"{r['tokens_per_s_per_gpu'] / base:.2f}" if base else "-"
        print(f"{r['layout']} | {r['gpus']} | {r['step_s']:.4f} | {r['tokens_per_s']:.0f} | "
              f"{r['tokens_per_s_per_gpu']:.0f} | {eff}")


if __name__ == "__main__":
    main()
