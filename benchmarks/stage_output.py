"""One forward (no grad) of an RL micro batch through GPTModel's own output path ([b, s] copy of the
logits or values) against the trainer's `trinity.models.logprobs.stage_output` ([s, b], no copy), for the
actor's logits and the critic's value head, alternating, same model and rows.

    python benchmarks/stage_output.py --shape 0.5b
    python benchmarks/stage_output.py --shape tiny --device cpu      # CPU smoke

Rows: --rows x --seq tokens with --pad left padding (as rollouts are), response = the last --response
positions; each variant reduces its output over the response positions, as the RL phases do. Milliseconds
per forward, median of --reps timings of --inner forwards each. The two paths' outputs are compared
first and must be equal (they differ only in layout).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import SHAPES, make_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=288)
    ap.add_argument("--pad", type=int, default=20)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--inner", type=int, default=8)
    args = ap.parse_args()

    from trinity.config.megatron import MegatronConfig
    from trinity.distributed import cpu_compat
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.build import build_model, packed_attention
    from trinity.models.facts import ModelFacts
    from trinity.models.logprobs import stage_output
    from trinity.trainer.engine.setup import wrap_ddp

    dev = torch.device(args.device)
    cpu_compat.enable() if dev.type == "cpu" else cpu_compat.disable()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sync: Callable[[], None] = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    init_parallel(device=dev.type, layout=ParallelLayout(), seed=1)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            facts = ModelFacts.from_hf_dir(make_model(args.shape, str(Path(tmp) / "model"), dtype))
            tokens = torch.randint(0, min(1000, facts.vocab_size), (args.rows, args.seq), device=dev)
            key_mask = torch.ones_like(tokens)
            key_mask[:, : args.pad] = 0
            pos = torch.arange(args.seq, device=dev).expand_as(tokens)
            resp = slice(args.seq - args.response, args.seq)
            for head in ("logits", "value head"):
                chunks = build_model(facts, MegatronConfig(), device=dev.type, dtype=dtype,
                                     value_head=head == "value head")
                (ddp,) = wrap_ddp(chunks, MegatronConfig())
                ddp.eval()

                def gpt_model_out() -> torch.Tensor:  # [b, r, ...]
                    return ddp(tokens, pos, **packed_attention(ddp, key_mask - 1, dev))[:, resp]

                def stage_out() -> torch.Tensor:  # [r, b, ...]
                    return stage_output(ddp, tokens, pos, **packed_attention(ddp, key_mask - 1, dev))[resp]

                variants = {
                    "GPTModel output ([b, s] copy)": lambda: gpt_model_out().float().sum(),
                    "stage_output ([s, b])": lambda: stage_out().float().sum(),
                }
                times: dict[str, list[float]] = {name: [] for name in variants}
                with torch.no_grad():
                    # Timing two paths means little unless they compute the same thing.
                    diff = (gpt_model_out().float() - stage_out().transpose(0, 1).float()).abs().max().item()
                    if diff > 0:
                        raise SystemExit(f"{head}: the two output paths differ (max |diff| {diff})")
                    for fn in list(variants.values()) * 2:  # warm-up
                        fn()
                    for rep in range(args.reps):
                        order = list(variants.items())
                        for name, fn in order if rep % 2 == 0 else order[::-1]:
                            sync()
                            t0 = time.perf_counter()
                            for _ in range(args.inner):
                                fn()
                            sync()
                            times[name].append((time.perf_counter() - t0) / args.inner * 1e3)
                for name, ts in times.items():
                    rows.append((head, name, statistics.median(ts), min(ts), max(ts)))
                del ddp, chunks
    finally:
        destroy()
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"\nforward of {args.rows} x {args.seq} tokens, shape {args.shape}, {where}, torch {torch.__version__}")
    print("output | path | ms median | min | max")
    for head, name, med, lo, hi in rows:
        print(f"{head} | {name} | {med:.2f} | {lo:.2f} | {hi:.2f}")


if __name__ == "__main__":
    main()
