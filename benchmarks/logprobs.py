"""Per-token log-probs (forward + backward) over the output layer's logits: the trainer's
`vocab_parallel_log_probs` (compiled kernels on CUDA) against its eager fp32 chunks (its CPU path,
and what CUDA ran before), one compiled logsumexp + gather (what this benchmark's models used before,
TP=1 only), megatron-core's `vocab_parallel_cross_entropy` and a plain fp32 `log_softmax` + gather.
Same logits, same GPU; time and the peak memory above the logits.

    python benchmarks/logprobs.py --shape 0.5b,7b
    python benchmarks/logprobs.py --shape tiny --device cpu        # CPU smoke

Shapes: 0.5b = 8192 tokens (4096 x 2) x 151936, 7b = 4096 tokens x 152064 (Qwen2.5 vocabularies).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Callable, Iterator

import torch

SHAPES = {"0.5b": (8192, 151936), "7b": (4096, 152064), "tiny": (256, 4096)}


@contextlib.contextmanager
def eager_chunks(on: bool) -> Iterator[None]:
    """The trainer's log-probs without its compiled kernels (the path of CPU tensors) while `on`."""
    from trinity.algorithms import logprob

    original = logprob._kernel
    if on:
        logprob._kernel = lambda name, fn, logits: None
    try:
        yield
    finally:
        logprob._kernel = original


def cases() -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    from megatron.core import tensor_parallel

    from trinity.algorithms.logprob import vocab_parallel_log_probs

    def plain(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    compiled_plain = torch.compile(
        lambda logits, targets: logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1).float()
        - torch.logsumexp(logits.float(), dim=-1))

    def megatron(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return -tensor_parallel.vocab_parallel_cross_entropy(logits.unsqueeze(1), targets.unsqueeze(1)).squeeze(1)

    return {"trainer (compiled)": vocab_parallel_log_probs, "trainer (eager chunks)": vocab_parallel_log_probs,
            "compiled logsumexp + gather (TP=1 only)": compiled_plain, "megatron cross-entropy": megatron,
            "fp32 log_softmax": plain}


def measure(fn: Callable[..., torch.Tensor], logits: torch.Tensor, targets: torch.Tensor,
            steps: int) -> tuple[float, float]:
    cuda = logits.is_cuda

    def once() -> None:
        grad, = torch.autograd.grad(fn(logits, targets).sum(), logits)
        del grad

    for _ in range(2):
        once()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        once()
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / steps
    extra = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else float("nan")
    return seconds, extra


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="0.5b,7b")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()

    from trinity.distributed import parallel
    from trinity.distributed.layout import ParallelLayout

    parallel.init_parallel(device=args.device, layout=ParallelLayout(), seed=1)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    rows = []
    try:
        for shape in args.shape.split(","):
            tokens, vocab = SHAPES[shape]
            torch.manual_seed(0)
            logits = (torch.randn(tokens, vocab, device=args.device) * 2).to(dtype).requires_grad_(True)
            targets = torch.randint(0, vocab, (tokens,), device=args.device)
            for name, fn in cases().items():
                with eager_chunks(name == "trainer (eager chunks)"):
                    seconds, extra = measure(fn, logits, targets, args.steps)
                rows.append((shape, tokens, vocab, name, seconds, extra))
                print(rows[-1], flush=True)
    finally:
        parallel.destroy()
    print(f"\nlog-probs forward + backward, {args.device}, {dtype}, torch {torch.__version__}")
    print("shape | tokens x vocab | implementation | ms | peak GiB above the logits")
    for shape, tokens, vocab, name, seconds, extra in rows:
        print(f"{shape} | {tokens} x {vocab} | {name} | {seconds * 1e3:.2f} | {extra:.2f}")


if __name__ == "__main__":
    main()
