"""The decode work a rollout asks for, with and without partial rollouts: decode steps, rows per decode
step, the cached keys of the rows a decode step attends over (each row's own context, a prompt's keys
counted per answer) and decoded tokens per step of training, from the real engine (`generate_continuous`, `generate_partial`)
on the tiny Qwen2 on the CPU, or on a random-weight model of a benchmarks/generate.py shape on the GPU
(`--device cuda`). The last three columns time each call: its wall seconds, and the parts of them its decode
steps and its prefill forwards took (`RolloutStats.time_buckets`: on CUDA the GPU time between events
around each); the rest is the host's: admission, bookkeeping, kernels compiled for new shapes. On the CPU the times are the tiny model's and say
little; what counts there is the schedule, which a GPU step's time follows.

    python benchmarks/partial_schedule.py                       # 64 prompts x 8, up to 1024 tokens, lognormal
    python benchmarks/partial_schedule.py --staleness 1,2,4 --over-sampling 64,128
    python benchmarks/partial_schedule.py --device cuda --shape 0.5b --staleness 1,3 --host-profile  # one GPU

Cases: `lognormal` (one rollout of the batch to its longest answer), `fixed:N` (every answer N tokens, N
the lognormal mean: the same real tokens), and `partial s=S o=O` (`max_staleness` S, O prompts in flight)
with the lognormal lengths drawn per sample as benchmarks/eos_schedule.py draws them for rl_step.py.
Means over the calls after the first `--warmup` (partial rollouts reach their steady state from the second;
on the GPU the first calls also compile kernels for the batch buckets they reach first).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eos_schedule import draw_response_lengths, per_sample


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--response-length", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=7)
    ap.add_argument("--baselines", choices=["yes", "no"], default="yes", help="also the lognormal and fixed-length cases")
    ap.add_argument("--staleness", default="1,2,4", help="comma list of max_staleness, one partial case each")
    ap.add_argument("--over-sampling", default="", help="comma list of prompts in flight (default: 2 x --prompts)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="calls left out of the means: partial rollouts reach their steady state from the second, and "
                         "on the GPU a call's first batch buckets compile their kernels (leave out 4 or so there)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--shape", default="0.5b", help="--device cuda: a shape of benchmarks/generate.py (random weights, bf16)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="slots (actor_rollout_ref.rollout.max_num_seqs; default: the config's 1024 on cuda, unbounded on cpu)")
    ap.add_argument("--host-profile", action="store_true",
                    help="profile the partial cases' calls on the host (cProfile) and print where its time went")
    args = ap.parse_args()

    from trinity.rollout.continuous import KVBudget, generate_continuous
    from trinity.rollout.partial import fresh_group, generate_partial
    from trinity.rollout.types import RolloutStats, SamplingParams

    if args.device == "cpu":
        torch.set_num_threads(2)
        from trinity.testing.tiny_models import tiny_chunk_cpu

        gpt, facts, _ = tiny_chunk_cpu("qwen2", Path(tempfile.mkdtemp()))
    else:
        from generate import make_config_only

        from trinity.config.megatron import MegatronConfig
        from trinity.distributed.parallel import init_parallel
        from trinity.models.build import build_model
        from trinity.models.facts import ModelFacts

        facts = ModelFacts.from_hf_dir(make_config_only(args.shape, tempfile.mkdtemp(), torch.bfloat16))
        init_parallel(device="cuda", layout=MegatronConfig().layout(), seed=0)
        (gpt,) = build_model(facts, MegatronConfig(), device="cuda", dtype=torch.bfloat16)
    P, n, max_new = args.prompts, args.n, args.response_length
    gpt_device = next(gpt.parameters()).device
    g = torch.Generator().manual_seed(0)
    prompt_pool = [torch.randint(3, facts.vocab_size, (int(k),), generator=g).tolist()
                   for k in torch.randint(20, 48, (512,), generator=g)]
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new)
    budget = KVBudget(max_num_seqs=args.max_num_seqs or (100_000 if args.device == "cpu" else 1024))
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    profile = cProfile.Profile() if args.host_profile else None

    def timed(call, stats: RolloutStats, profiled: bool = False):
        """call() and its measures: wall seconds, the decode steps' seconds."""
        sync()
        t0 = time.perf_counter()
        if profiled and profile is not None:
            profile.enable()
        out = call()
        sync()
        if profiled and profile is not None:
            profile.disable()
        wall = time.perf_counter() - t0
        return out, {"call s": wall, "decode s": sum(b.ms for b in stats.buckets.values()) / 1e3,
                     "prefill s": stats.prefill_ms / 1e3}
    rows: list[tuple[str, dict[str, float]]] = []

    def add(name: str, calls: list[dict[str, float]]) -> None:
        steady = calls[args.warmup:] or calls
        # means, not medians: with partial rollouts the calls alternate (a step that waits for due groups,
        # then one that finds most of its groups complete)
        mean = {k: statistics.fmean(c[k] for c in steady) for k in steady[0]}
        # rows per decode step over all the calls' steps (a call that found its groups complete has none)
        steps = sum(c["decode steps"] for c in steady)
        for k in ("rows per step", "keys per step"):
            mean[k] = sum(c[k] * c["decode steps"] for c in steady) / max(1, steps)
        rows.append((name, mean))
        for i, c in enumerate(calls, 1):
            print(f"{name}, call {i}: " + ", ".join(f"{k} {v:.3f}" if k.endswith(" s") else f"{k} {v:.0f}" for k, v in c.items()), flush=True)

    def one_rollout(kind: str) -> list[dict[str, float]]:
        out = []
        for call in range(args.calls):
            prompts = [prompt_pool[(call * P + i) % len(prompt_pool)] for i in range(P) for _ in range(n)]
            lengths = draw_response_lengths(kind, P * n, max_new, seed=1000 + call)
            stats = RolloutStats(time_buckets=True)
            _, t = timed(lambda: generate_continuous(
                gpt, prompts, params, vocab_size=facts.vocab_size, pad_id=0, budget=budget, response_lengths=lengths,
                stats=stats, generator=torch.Generator(gpt_device).manual_seed(call)), stats)
            out.append({"decode steps": stats.decode_steps, "rows per step": stats.slot_steps / max(1, stats.decode_steps),
                        "keys per step": stats.live_kv_tokens / max(1, stats.decode_steps), "decoded tokens": stats.tokens, "trained tokens": sum(lengths), "prefill forwards": stats.prefill_calls, **t})
        return out

    mean = round(statistics.mean(draw_response_lengths("lognormal", 8192, max_new, seed=7)))
    if args.baselines == "yes":
        add("lognormal", one_rollout("lognormal"))
        add(f"fixed:{mean}", one_rollout(f"fixed:{mean}"))

    length = per_sample("lognormal", max_new)
    for s, o in itertools.product((int(x) for x in args.staleness.split(",")),
                                  (int(x) for x in (args.over_sampling or str(2 * P)).split(","))):
        counter = itertools.count()

        def fresh(counter=counter):
            uid = next(counter)
            return fresh_group(uid, uid, prompt_pool[uid % len(prompt_pool)], n)

        carry, calls = [], []
        for version in range(args.calls):
            stats = RolloutStats(time_buckets=True)
            res, t = timed(lambda: generate_partial(
                gpt, carry, fresh, params, n=n, need=P, inflight=o, version=version, max_staleness=s,
                longest_prompt=48, vocab_size=facts.vocab_size, pad_id=0, budget=budget, seed=11,
                response_length=length, stats=stats), stats, profiled=version > 0)
            carry = res.carry
            trained = sum(len(a.tokens) for grp in res.trained for a in grp.answers)
            calls.append({"decode steps": stats.decode_steps, "rows per step": stats.slot_steps / max(1, stats.decode_steps),
                          "keys per step": stats.live_kv_tokens / max(1, stats.decode_steps), "decoded tokens": stats.tokens, "trained tokens": trained, "prefill forwards": stats.prefill_calls, **t})
        add(f"partial s={s} o={o}", calls)

    if profile is not None:  # where the host's time went in the partial calls after the first
        buf = io.StringIO()
        pstats.Stats(profile, stream=buf).sort_stats("tottime").print_stats(25)
        print(buf.getvalue())
    print()
    print(f"{P} prompts x {n} answers, up to {max_new} tokens; {args.device}"
          f"{' ' + args.shape if args.device == 'cuda' else ''}; means of calls {args.warmup + 1}-{args.calls}")
    print("| case | decode steps | rows per step | keys per step | decoded tokens | trained tokens | prefill forwards "
          "| s per call | decode steps' s | prefill forwards' s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, m in rows:
        print(f"| {name} | {m['decode steps']:.0f} | {m['rows per step']:.0f} | {m['keys per step']:.0f} | "
              f"{m['decoded tokens']:.0f} | {m['trained tokens']:.0f} | {m['prefill forwards']:.0f} | "
              f"{m['call s']:.3f} | {m['decode s']:.3f} | {m['prefill s']:.3f} |")


if __name__ == "__main__":
    main()
