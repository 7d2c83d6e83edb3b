"""How the rollout decodes a LoRA model, both ways (actor.lora.rollout_weights), on one GPU in bf16:

- merged (`auto` / `device` / `host`, trinity.trainer.recipes.lora_ref.rollout_weights): every adapted base
  weight becomes W + alpha/rank * B A for the decoders and gets its original bits back after, the
  originals kept in host memory (`host`, trinity.models.lora.adapters_merged) or as a copy on the GPU
  (`device`): the merge and restore times;
- `adapters`: nothing merged, the decoders add x A^T B^T beside each base GEMM (trinity.models.lora.linear /
  addmm, inside the decode CUDA graphs): what that adds to each decode step.

    python benchmarks/lora_merge.py --shapes 1.5b,7b --rank 16

A random-weight Qwen2 of each shape (benchmarks/generate.py's shapes) is built straight on the GPU
(megatron-core's init; no HF file), adapters of `--rank` go on every linear with random non-zero B, and
the benchmark checks that every base weight is bit for bit the same after the restore (torch.equal
against a GPU copy). Merge and restore times are medians of `--repeats`. Decode: the continuous-batching
engine (trinity.rollout.continuous, the RL rollout's), `--batch` prompts of `--prompt-len` tokens,
`--new-tokens` new tokens each, fixed length; ms per decode step = (rollout time - its CUDA graph capture
- the same rollout's time with 1 new token) / the decode steps between the two, second of two calls.
"break-even steps": decode steps after which the adapter path's extra time exceeds a device-kept merge
and restore.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import SHAPES, make_config_only  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _decode_ms(chunks: list, facts, prompts: list, new_tokens: int, device: str) -> tuple[float, float]:
    """(ms per decode step, the full rollout's seconds) of the continuous engine in the current weights
    state; second of two calls each."""
    from trinity.rollout.continuous import RolloutStats, generate_continuous
    from trinity.rollout.types import SamplingParams

    def run(n: int) -> tuple[float, RolloutStats]:
        stats = RolloutStats()
        gen = torch.Generator(device=device).manual_seed(0)
        _sync()
        t0 = time.perf_counter()
        generate_continuous(chunks[0], prompts, SamplingParams(temperature=1.0, max_new_tokens=n),
                            vocab_size=facts.vocab_size, pad_id=0, generator=gen, stats=stats)
        _sync()
        return time.perf_counter() - t0 - stats.capture_s, stats

    with torch.no_grad():
        for _ in range(2):
            full_s, full = run(new_tokens)
            short_s, short = run(1)
    steps = max(1, full.decode_steps - short.decode_steps)
    return 1000 * (full_s - short_s) / steps, full_s + full.capture_s


def measure(shape: str, rank: int, repeats: int, batch: int, prompt_len: int, new_tokens: int, device: str) -> dict:
    from trinity.config.megatron import MegatronConfig
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts
    from trinity.models.lora import apply_lora, lora_modules
    from trinity.trainer.recipes.lora_ref import rollout_weights

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        facts = ModelFacts.from_hf_dir(make_config_only(shape, tmp, dtype))
    chunks = build_model(facts, MegatronConfig(), device=device, dtype=dtype)
    lora = SimpleNamespace(rank=rank, alpha=2.0 * rank, dropout=0.0, target_modules=["all-linear"])
    apply_lora(chunks, lora)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for _, _, a in lora_modules(chunks):
            a.lora_B.normal_(0.0, 0.02, generator=g)
    weights = [m.weight for _, m, _ in lora_modules(chunks)]
    merged_bytes = sum(w.numel() * w.element_size() for w in weights)
    originals = [w.detach().clone() for w in weights]
    times: dict[str, tuple[float, float]] = {}
    exact = True
    for keep in ("host", "device"):
        merge_s, restore_s = [], []
        for _ in range(repeats):
            _sync()
            t0 = time.perf_counter()
            ctx = rollout_weights(chunks, keep=keep)
            ctx.__enter__()
            _sync()
            t1 = time.perf_counter()
            ctx.__exit__(None, None, None)
            _sync()
            t2 = time.perf_counter()
            merge_s.append(t1 - t0)
            restore_s.append(t2 - t1)
        times[keep] = (statistics.median(merge_s), statistics.median(restore_s))
        exact = exact and all(torch.equal(w, o) for w, o in zip(weights, originals))
    del originals
    if device == "cuda":
        torch.cuda.empty_cache()
    prompts = torch.randint(1, facts.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    decode: dict[str, tuple[float, float]] = {}
    for keep in ("device", "adapters"):  # merged (originals on the GPU) vs the adapter path
        with rollout_weights(chunks, keep=keep):
            decode["merged" if keep == "device" else keep] = _decode_ms(chunks, facts, prompts, new_tokens, device)
    out = {"shape": shape, "rank": rank, "merged_gib": merged_bytes / 2**30, "times": times, "exact": exact,
           "decode": decode, "rollout_s": decode["merged"][1]}
    del chunks, weights
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1.5b,7b", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run (--shapes tiny)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --device cpu --shapes tiny for a smoke run)")
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.compat import quiet

    quiet.install(False)
    init_parallel(device=args.device, layout=ParallelLayout(), seed=0)
    rows = []
    try:
        for shape in args.shapes.split(","):
            rows.append(measure(shape, args.rank, args.repeats, args.batch, args.prompt_len, args.new_tokens, args.device))
            r = rows[-1]
            print(f"{shape}: {r['times']}, decode {r['decode']}", flush=True)
    finally:
        destroy()
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (fp32)"
    print(f"\nLoRA merge/restore around a rollout on {where}, bf16 on GPU, rank {args.rank} on every "
          f"linear, rollout {args.batch} x ({args.prompt_len} prompt + {args.new_tokens} new tokens), torch {torch.__version__}")
    print("| shape | adapted weights GiB | originals kept on | merge s | restore s | bit-exact after restore | "
          "rollout s | (merge + restore) / rollout |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for keep, (merge, restore) in r["times"].items():
            share = (merge + restore) / r["rollout_s"]
            print(f"| {r['shape']} | {r['merged_gib']:.2f} | {keep} | {merge:.3f} | {restore:.3f} | {r['exact']} | "
                  f"{r['rollout_s']:.2f} | {100 * share:.1f}% |")
    print(f"\nDecode step of the continuous engine (batch {args.batch}, CUDA graphs on GPU): merged weights vs "
          "the adapter path (rollout_weights: adapters)")
    print("| shape | merged ms/step | adapters ms/step | adapter path extra | merge + restore (GPU copy) s | "
          "break-even decode steps | rollout s merged | rollout s adapters |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        (m_ms, m_s), (a_ms, a_s) = r["decode"]["merged"], r["decode"]["adapters"]
        merge = sum(r["times"]["device"])
        extra = a_ms - m_ms
        even = f"{1000 * merge / extra:.0f}" if extra > 0 else "never (adapters not slower)"
        print(f"| {r['shape']} | {m_ms:.2f} | {a_ms:.2f} | {100 * extra / m_ms:+.1f}% | {merge:.3f} | {even} | "
              f"{m_s:.2f} | {a_s:.2f} |")


if __name__ == "__main__":
    main()
