"""Can the ref's forward hide under a rollout's tail on one GPU? A probe, before building it.

A lognormal rollout's last ~700 decode steps hold 16-128 rows; each step is ~270 small kernels that leave
most SMs idle (docs/performance.md, "2026-11-26, morning"). The ref's forward (0.39 s at 0.5B) is a few
large GEMMs per layer. This times a stand-in for each, with the shapes of a Qwen2 model:
- `decode`: one CUDA graph per step, each layer's lean-path GEMMs at `--rows` rows (QKV + bias, o_proj +
  residual, gate/up, down + residual) and its two RMSNorms, plus the LM head;
- `forward`: the same layers' GEMMs over `--tokens` tokens (a packed micro batch), repeated to last about
  as long as the decode steps;
and then both at once: decode on a high-priority stream, forward on a low-priority one, both queued
from one host thread; and, where torch has green contexts, decode and forward on disjoint SM
partitions. A case "hides" the forward when the wall time of both is close to the decode's alone.

The cases above queue the whole forward first. A stream's launch queue holds about a thousand kernels,
and the forward's launches block the host thread once it is full, so the decode's replays are queued only
as the forward drains: those cases measure the host's serialisation as much as the GPU's. The `thread`
cases are the engine's shape: the decode loop replays a step and waits for the step before it (as
`generate_continuous` does), and a second host thread runs the forward a layer at a time, waiting for
the layer before last before it queues the next, so its queue stays short and the GIL comes back to the
decode loop at each wait. `--carveout K` also runs them with cuBLASLt told to plan the forward's GEMMs
for K SMs fewer (`torch._C._set_sm_carveout_experimental`: persistent GEMM kernels size their grid to
the SMs they are given, and hold them until they end).

    python benchmarks/tail_overlap.py --shape 0.5b --rows 32 --tokens 8192 --steps 300 --carveout 16 32
    python benchmarks/tail_overlap.py --shape 0.5b --rows 32 --tokens 8192 --steps 300 --legacy   # + one-thread cases
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import SHAPES, geometry  # noqa: E402  (the benchmarks' Qwen2 shapes)


def weights(shape: str, device: torch.device) -> list[dict]:
    h, ffn, layers, heads, groups, d, _ = geometry(shape)
    qkv = (heads + 2 * groups) * d

    def w(*s: int) -> torch.Tensor:
        return torch.randn(*s, device=device, dtype=torch.bfloat16) * 0.02

    return [{"n1": torch.ones(h, device=device, dtype=torch.bfloat16), "qkv": w(qkv, h), "qkv_b": w(qkv),
             "o": w(h, heads * d), "n2": torch.ones(h, device=device, dtype=torch.bfloat16), "fc1": w(2 * ffn, h),
             "fc2": w(h, ffn)} for _ in range(layers)]


def layers(x: torch.Tensor, ws: list[dict], heads_dim: int) -> torch.Tensor:
    for w in ws:
        q = F.linear(F.rms_norm(x, (x.shape[-1],), w["n1"], 1e-6), w["qkv"], w["qkv_b"])
        x = x.addmm(q[:, :heads_dim], w["o"].t())  # attention left out: its output's shape, not its work
        up = F.linear(F.rms_norm(x, (x.shape[-1],), w["n2"], 1e-6), w["fc1"])
        gate, value = up.chunk(2, dim=-1)
        x = x.addmm(F.silu(gate) * value, w["fc2"].t())
    return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--rows", type=int, nargs="+", default=[32])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sms", type=int, nargs="+", default=[32, 66], help="green contexts: the decode's SMs")
    ap.add_argument("--carveout", type=int, nargs="*", default=[16, 32], help="thread cases: SMs kept from the forward's GEMMs")
    ap.add_argument("--legacy", action="store_true", help="also the one-thread cases (the forward queued first)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    h, _, _, heads, _, d, vocab = geometry(args.shape)
    ws = weights(args.shape, dev)
    head = torch.randn(vocab, h, device=dev, dtype=torch.bfloat16) * 0.02
    big = torch.randn(args.tokens, h, device=dev, dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs; shape {args.shape}, forward over {args.tokens} tokens, "
          f"{args.steps} decode steps")

    def forward() -> None:
        layers(big, ws, heads * d)

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    forward()
    one_fwd = timed(forward)
    print("| rows | case | wall s | decode ms/step | forward s (its own) | forward hidden |")
    print("|---|---|---|---|---|---|")
    for rows in args.rows:
        x = torch.randn(rows, h, device=dev, dtype=torch.bfloat16)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            F.linear(layers(x.clone(), ws, heads * d), head)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            F.linear(layers(x.clone(), ws, heads * d), head)
        decode_alone = timed(lambda: [graph.replay() for _ in range(args.steps)])
        reps = max(1, round(decode_alone / one_fwd))
        fwd_alone = timed(lambda: [forward() for _ in range(reps)])
        print(f"| {rows} | decode alone | {decode_alone:.3f} | {1e3 * decode_alone / args.steps:.3f} | - | - |")
        print(f"| {rows} | forward alone ({reps}x) | {fwd_alone:.3f} | - | {fwd_alone:.3f} | - |")

        def both(dec_stream: torch.cuda.Stream, fwd_stream: torch.cuda.Stream) -> tuple[float, float]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dec_stream.wait_stream(torch.cuda.current_stream())
            fwd_stream.wait_stream(torch.cuda.current_stream())
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.cuda.stream(fwd_stream):
                for _ in range(reps):
                    forward()
            with torch.cuda.stream(dec_stream):
                start.record()
                for _ in range(args.steps):
                    graph.replay()
                end.record()
            torch.cuda.synchronize()
            return time.perf_counter() - t, start.elapsed_time(end) / args.steps

        def row(case: str, wall: float, per_step: float) -> None:
            hidden = (decode_alone + fwd_alone - wall) / fwd_alone
            print(f"| {rows} | {case} | {wall:.3f} | {per_step:.3f} | - | {100 * hidden:.0f}% |")

        def threaded(carveout: int | None, decode: bool = True, fwd: bool = True) -> tuple[float, float]:
            """Decode loop here, the forward in a second host thread (module doc); either alone."""
            dec_stream, fwd_stream = torch.cuda.Stream(priority=-10), torch.cuda.Stream(priority=0)
            dec_stream.wait_stream(torch.cuda.current_stream())
            fwd_stream.wait_stream(torch.cuda.current_stream())
            torch.cuda.synchronize()
            blas = torch.backends.cuda.preferred_blas_library()
            if carveout is not None:  # the carve-out reaches cuBLASLt's calls only
                torch.backends.cuda.preferred_blas_library("cublaslt")
                torch._C._set_sm_carveout_experimental(carveout)

            def forward_thread() -> None:
                with torch.cuda.stream(fwd_stream):
                    marks: list[torch.cuda.Event] = []
                    for _ in range(reps):
                        xs = big
                        for w in ws:
                            xs = layers(xs, [w], heads * d)
                            ev = torch.cuda.Event()
                            ev.record()
                            marks.append(ev)
                            if len(marks) > 2:
                                marks.pop(0).synchronize()  # releases the GIL while it waits
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            worker = threading.Thread(target=forward_thread if fwd else (lambda: None))
            worker.start()
            with torch.cuda.stream(dec_stream):
                start.record()
                previous = None
                for _ in range(args.steps if decode else 0):
                    graph.replay()
                    ev = torch.cuda.Event()
                    ev.record()
                    if previous is not None:
                        previous.synchronize()
                    previous = ev
                end.record()
            worker.join()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
            if carveout is not None:
                torch._C._set_sm_carveout_experimental(None)
                torch.backends.cuda.preferred_blas_library(blas)
            return wall, start.elapsed_time(end) / args.steps

        switch = sys.getswitchinterval()
        sys.setswitchinterval(5e-5)  # the decode loop gets the GIL back within 50 us of its wait ending
        try:
            decode_alone, _ = threaded(None, fwd=False)
            fwd_alone, _ = threaded(None, decode=False)
            print(f"| {rows} | decode loop alone (a wait per step) | {decode_alone:.3f} | | | |")
            print(f"| {rows} | forward thread alone (a layer at a time) | {fwd_alone:.3f} | | | |")
            row("thread: decode loop + forward thread, priorities", *threaded(None))
            for k in args.carveout:
                row(f"thread, forward GEMMs carve out {k} SMs (cuBLASLt)", *threaded(k))
        finally:
            sys.setswitchinterval(switch)
        if not args.legacy:
            continue
        row("both, same priority", *both(torch.cuda.Stream(), torch.cuda.Stream()))
        # a priority outside the device's range maps to its end: -10 the highest, 0 the lowest (default)
        row("both, decode high priority", *both(torch.cuda.Stream(priority=-10), torch.cuda.Stream(priority=0)))
        try:
            from torch.cuda.green_contexts import GreenContext

            for k in args.sms:
                gd, gf = GreenContext.create(num_sms=k), GreenContext.create(num_sms=sms - k)
                row(f"green contexts: decode {k} SMs, forward {sms - k}", *both(gd.Stream(), gf.Stream()))
        except Exception as exc:  # a beta API: absent from some builds, or refused by the driver
            print(f"| {rows} | green contexts | not run: {type(exc).__name__}: {str(exc)[:120]} | | | |")


if __name__ == "__main__":
    main()
