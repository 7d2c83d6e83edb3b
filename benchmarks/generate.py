"""Rollout throughput: trinity's megatron-core generation vs HF `generate`, next to the decode floor.

    python benchmarks/generate.py --shape tiny --device cpu
    python benchmarks/generate.py --shape 0.5b --device cuda --batches 1 32 256
    python benchmarks/generate.py --shape 7b --device cuda --lengths lognormal --batches 512 \
        --prompt-len 256 --new-tokens 1024 --no-hf      # variable lengths: continuous vs static batch

With `--lengths fixed|uniform|lognormal` each of `--batches` rows gets a response length drawn from
the distribution (the benchmark-only EOS schedule of benchmarks/eos_schedule.py; lognormal: mean 30%
of `--new-tokens`) and one whole rollout is timed per engine: the continuous-batching engine
(`--max-num-seqs` slots, `--kv-gib` budget) and the static batch (decoding to the longest row).
"Useful tokens/s" counts the drawn lengths only; the floor of the continuous run is, summed over its
decode steps, (weight bytes + the live rows' KV bytes) / bandwidth.

Fixed-length decoding (no EOS) of `--new-tokens` tokens after `--prompt-len` random prompt tokens, on a
random-weight Qwen2 of the chosen shape. "decode ms/step" is the time of one decode step alone: a
`generate` call of `--new-tokens` tokens minus one of 2 tokens (prefill, CUDA-graph capture and one
step), divided by the difference in steps; "call" columns time the whole call (prefill included).
The floor of one decode step is (weight bytes + KV-cache bytes at the mean context length) / memory
bandwidth, the bandwidth being the bytes a large device-to-device copy moves per second (its reads
and writes both counted). On CPU the "bandwidth" is that of a memory copy. The weight bytes are those a
step reads: all of them but an untied input embedding (the 7B shape's 1.09 GB), of which a step reads
its tokens' rows only (counted whole, the 7B floor would be ~6% too high).
"""

from __future__ import annotations

import argparse
import tempfile
import time

from pathlib import Path

import torch

SHAPES = {
    "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=320),
    "0.5b": dict(num_hidden_layers=24, hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936),
    "1.5b": dict(num_hidden_layers=28, hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936),
    "7b": dict(num_hidden_layers=28, hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064),
}


def bandwidth(device: torch.device) -> float:
    """Bytes/s of a 1 GiB (256 MiB on CPU) copy, read + write counted."""
    n = (1 << 28) if device.type == "cuda" else (1 << 26)
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    _sync(device)
    t0 = time.perf_counter()
    reps = 10
    for _ in range(reps):
        b.copy_(a)
    _sync(device)
    return 2 * a.numel() * 4 * reps / (time.perf_counter() - t0)


def matmul_rate(device: torch.device) -> float:
    """FLOP/s of a bf16 4096^3 matmul (fp32 2048^3 on CPU)."""
    n, dtype = (4096, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    a @ a
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    _sync(device)
    return 2 * n**3 * 20 / (time.perf_counter() - t0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bucket_table(stats, call_s: float, engine: str, weight_bytes: int, kv_per_token: int, bw: float,
                 s_per_token: float) -> str:
    """Per batch bucket of one continuous call (`--buckets`): its decode steps, their GPU time, and the floor
    of what they read (the weights once per step + the KV the kernel reads, a prompt's keys once where
    its samples share them) and of what they compute (2 x params per live row at the matmul rate)."""
    lines = [f"\nper batch bucket: {engine} ({call_s:.2f} s call)",
             "| bucket | steps | live rows per step | ms per step | s | share of the call | read floor ms per step "
             "| % of it | compute floor ms per step | % of max(floors) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    total = 0.0
    for b in sorted(stats.buckets, reverse=True):
        t = stats.buckets[b]
        ms = t.ms / t.steps
        read = (weight_bytes + t.read_kv_tokens / t.steps * kv_per_token) / bw * 1e3
        compute = t.live_rows / t.steps * s_per_token * 1e3
        total += t.ms / 1e3
        lines.append(f"| {b} | {t.steps} | {t.live_rows / t.steps:.0f} | {ms:.3f} | {t.ms / 1e3:.2f} | "
                     f"{100 * t.ms / 1e3 / call_s:.1f}% | {read:.3f} | {100 * read / ms:.1f}% | {compute:.3f} | "
                     f"{100 * max(read, compute) / ms:.1f}% |")
    lines.append(f"| all | {stats.decode_steps} | | | {total:.2f} | {100 * total / call_s:.1f}% | | | | |")
    lines.append(f"(the rest of the call, {call_s - total:.2f} s: prefills, the host's gaps between steps, the output)")
    return "\n".join(lines)


def hf_config(shape: str, dtype: torch.dtype):
    """The HF Qwen2 config of a benchmark shape (the 7B shape unties its embeddings, as Qwen2.5-7B does;
    32768 positions as Qwen2.5's configs give, so that long-sequence runs validate)."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, tie_word_embeddings=shape != "7b", torch_dtype=dtype)
    cfg.architectures = ["Qwen2ForCausalLM"]
    return cfg


def make_model(shape: str, out: str, dtype: torch.dtype) -> str:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(hf_config(shape, dtype)).to(dtype).save_pretrained(out, safe_serialization=True)
    return out


def make_config_only(shape: str, out: str, dtype: torch.dtype) -> str:
    """`out/config.json` only: the model is built with megatron's random initialisation on the device
    (`--random-init`), which skips creating, saving and loading a 15 GB HF checkpoint at 7B (minutes)."""
    hf_config(shape, dtype).save_pretrained(out)
    return out


def make_job_model(shape: str, root: Path, device: str) -> Path:
    """`root/model`: a random-weight model of `shape` (bf16 on cuda, fp32 on cpu) with the tiny local
    tokenizer beside its weights, as `trinity run` jobs of the benchmarks load it."""
    from trinity.testing.tiny_assets import make_tiny_tokenizer

    model = Path(make_model(shape, str(root / "model"), torch.bfloat16 if device == "cuda" else torch.float32))
    make_tiny_tokenizer(root / "tok")
    for f in (root / "tok").iterdir():
        if f.is_file():
            (model / f.name).write_bytes(f.read_bytes())
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--no-hf", action="store_true", help="skip HF generate")
    ap.add_argument("--random-init", action="store_true",
                    help="megatron's random initialisation on the device instead of an HF checkpoint (implies --no-hf)")
    ap.add_argument("--attention", default="auto",
                    help="--lengths: comma list of decode paths to time the continuous engine with: auto (the split-KV "
                         "kernel and the fused RoPE/SwiGLU kernels where they run, a prompt's samples reading one copy "
                         "of its keys), unshared (the same, each sample reading its own copy), unfused (split-KV only), sdpa")
    ap.add_argument("--blas", default="default",
                    help="--lengths: comma list of BLAS libraries for torch to prefer (default, cublas, cublaslt; "
                         "torch.backends.cuda.preferred_blas_library): one row each")
    ap.add_argument("--ladder", default="tuned",
                    help="--lengths: comma list of batch-bucket ladders for the continuous engine: tuned (the "
                         "engine's: buckets slower than a larger one left out, trinity.rollout.buckets), fixed "
                         "(DecodeKernels(tuned_buckets=False): every power of two, then every multiple of 64)")
    ap.add_argument("--full-grid", default="",
                    help="--lengths: comma list of split-KV thresholds (rows x groups from which a row is one program; "
                         "DecodeKernels.full_grid) to time the continuous engine with besides the engine's (128)")
    ap.add_argument("--buckets", action="store_true",
                    help="--lengths: time every decode step of the continuous engine on the GPU and print, per batch "
                         "bucket, its steps, ms per step and the floor of its reads (RolloutStats.time_buckets)")
    ap.add_argument("--eager", action="store_true", help="decode steps without CUDA graphs")
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    ap.add_argument("--profile", action="store_true", help="profile one trinity call at the last batch size")
    ap.add_argument("--lengths", choices=["fixed", "uniform", "lognormal"], default=None,
                    help="time whole rollouts with per-row response lengths (continuous vs static engine)")
    ap.add_argument("--max-num-seqs", type=int, nargs="+", default=[512],
                    help="--lengths: slots of the continuous engine (one row of the table each)")
    ap.add_argument("--kv-gib", type=float, default=None, help="--lengths: KV-cache budget (default: 0.8 of free memory)")
    ap.add_argument("--engines", default="continuous,static", help="--lengths: engines to time")
    ap.add_argument("--temperature", type=float, default=0.0, help="--lengths: 0 greedy (default); RL samples at 1.0")
    ap.add_argument("--samplers", default="fused",
                    help="--lengths: comma list of the continuous engine's samplers: fused (one Triton pass, in the "
                         "decode step's CUDA graph), torch (the torch ops, outside it)")
    ap.add_argument("--n", type=int, default=8, help="--lengths: rows per distinct prompt (RL's rollout.n)")
    ap.add_argument("--static-max-batch", type=int, default=256,
                    help="--lengths: skip the static engine above this many rows (its unchunked prefill and full cache)")
    args = ap.parse_args()
    if args.new_tokens < 3:
        ap.error("--new-tokens: at least 3 (decode steps are timed against a 2-token call)")

    from transformers import AutoModelForCausalLM

    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    bw = bandwidth(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = (make_config_only if args.random_init else make_model)(args.shape, tmp, dtype)
        args.no_hf = args.no_hf or args.random_init
        facts = ModelFacts.from_hf_dir(path)
        init_parallel(device=args.device, layout=MegatronConfig().layout(), seed=0)
        try:
            (gpt,) = build_model(facts, MegatronConfig(), device=args.device, dtype=dtype)
            if not args.random_init:
                load_hf_weights([gpt], path, facts)
            hf = None if args.no_hf else AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
            # what a decode step must read: every weight once, except an untied input embedding, of which
            # it reads only the rows of its batch's tokens (a tied one is read whole as the output layer)
            weight_bytes = sum(p.numel() * p.element_size() for p in gpt.parameters())
            if not gpt.share_embeddings_and_output_weights:
                emb = gpt.embedding.word_embeddings.weight
                weight_bytes -= emb.numel() * emb.element_size()
            kv_per_token = 2 * facts.num_layers * facts.num_query_groups * facts.head_dim * torch.finfo(dtype).bits // 8
            params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
            print(f"shape {args.shape} on {args.device} ({'eager' if args.eager else 'CUDA graphs'}{', compiled' if args.compile else ''} decode steps): {weight_bytes / 2**30:.3f} GiB weights read per step, "
                  f"copy bandwidth {bw / 1e9:.1f} GB/s (read + write), prompt {args.prompt_len}, {args.new_tokens} new tokens")
            if args.lengths:
                rollout_table(args, gpt, facts, device, weight_bytes, kv_per_token, bw)
                return
            rows = []
            for batch in args.batches:
                g = torch.Generator().manual_seed(batch)
                prompts = torch.randint(1, facts.vocab_size, (batch, args.prompt_len), generator=g).tolist()

                def timed(new_tokens: int) -> float:
                    p = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
                    t0 = time.perf_counter()
                    reference_generate(gpt, prompts, p, vocab_size=facts.vocab_size, pad_id=0, cuda_graphs=not args.eager, compile=args.compile)
                    _sync(device)
                    return time.perf_counter() - t0

                # The first call at a shape pays torch.compile's work and lazy kernel loading: timed
                # apart, and each shape (the cache length follows the new-token count) is warmed first.
                first_s = timed(args.new_tokens)
                timed(2)
                call_s = min(timed(args.new_tokens) for _ in range(2))
                # Decode steps alone: the same call with 2 new tokens (prefill, graph capture, one step)
                # subtracted, so prefill and capture are out of the per-step time.
                short_s = min(timed(2) for _ in range(2))
                step_s = (call_s - short_s) / (args.new_tokens - 2)
                hf_tps, hf_ms = float("nan"), float("nan")
                if hf is not None:
                    ids = torch.tensor(prompts, device=device)
                    with torch.no_grad():
                        hf.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
                        _sync(device)
                        t1 = time.perf_counter()
                        hf.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
                        _sync(device)
                    hf_dt = time.perf_counter() - t1
                    hf_tps, hf_ms = batch * args.new_tokens / hf_dt, hf_dt / args.new_tokens * 1e3
                mean_ctx = args.prompt_len + args.new_tokens / 2
                # The floor reads every weight and the KV cache of the mean context once per step, at the
                # rate the copy moved bytes (its reads and writes both counted in `bw`).
                floor_s = (weight_bytes + batch * mean_ctx * kv_per_token) / bw
                rows.append((batch, batch * args.new_tokens / call_s, call_s, short_s, step_s, first_s, hf_tps, hf_ms, floor_s))
            print(f"\n{'batch':>5} | {'call tok/s':>10} | {'call s':>7} | {'prefill+1 s':>11} | {'decode ms/step':>14} | "
                  f"{'first call s':>12} | {'HF tok/s':>9} | {'HF ms/step':>10} | {'floor ms/step':>13} | {'% of floor':>10}")
            for batch, tps, call_s, short_s, step_s, first_s, hf_tps, hf_ms, floor_s in rows:
                print(f"{batch:>5} | {tps:>10.0f} | {call_s:>7.3f} | {short_s:>11.3f} | {step_s * 1e3:>14.3f} | {first_s:>12.2f} | "
                      f"{hf_tps:>9.0f} | {hf_ms:>10.2f} | {floor_s * 1e3:>13.3f} | {100 * floor_s / step_s:>9.1f}%")
            if args.profile:
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                with profile(activities=acts) as prof:
                    reference_generate(gpt, prompts, params, vocab_size=facts.vocab_size, pad_id=0, cuda_graphs=not args.eager, compile=args.compile)
                    _sync(device)
                for key in ("self_cpu_time_total", "self_cuda_time_total" if device.type == "cuda" else None):
                    if key:
                        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
        finally:
            destroy()


def rollout_table(args, gpt, facts, device, weight_bytes: int, kv_per_token: int, bw: float) -> None:
    """Whole rollouts with per-row lengths: continuous-batching engine vs static batch."""
    from eos_schedule import draw_response_lengths
    from trinity.rollout.continuous import KVBudget, RolloutStats, generate_continuous
    from trinity.rollout.kernels import DecodeKernels
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams

    rate = matmul_rate(device)
    n_params = sum(p.numel() for p in gpt.parameters())
    print(f"matmul {rate / 1e12:.0f} TFLOP/s; floor = (weights + live KV bytes) / bandwidth summed over decode steps; "
          f"shared-prompt floor: the same with a prompt's keys read once per step for all its live samples "
          f"(what the engine reads where they share them); compute floor = 2 x params x tokens / matmul rate")
    print(f"\n| engine | rows | lengths | useful tokens | call s | useful tok/s | decode steps | mean batch | "
          f"graph captures (s) | floor s | % of floor | shared-prompt floor s | % of it | compute floor s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    bucket_tables: list[str] = []
    for batch in args.batches:
        g = torch.Generator().manual_seed(batch)
        # batch rows = batch / n prompts, each n times (the continuous engine prefills a prompt once)
        distinct = torch.randint(1, facts.vocab_size, (max(1, batch // args.n), args.prompt_len), generator=g).tolist()
        prompts = [p for p in distinct for _ in range(args.n)][:batch]
        lengths = draw_response_lengths(args.lengths, batch, args.new_tokens, seed=batch)
        useful = sum(lengths)
        engines = [(e, m, a, smp, lib, ladder, grid) for e in args.engines.split(",") for m in (args.max_num_seqs if e == "continuous" else [0])
                   for a in (args.attention.split(",") if e == "continuous" else ["-"])
                   for smp in (args.samplers.split(",") if e == "continuous" else ["torch"])
                   for lib in args.blas.split(",")
                   for ladder in (args.ladder.split(",") if e == "continuous" else ["-"])
                   for grid in ([""] + [g for g in args.full_grid.split(",") if g] if e == "continuous" else [""])
                   if e == "continuous" or batch <= args.static_max_batch]
        warmed: set[str] = set()
        for engine, max_num_seqs, attention, smp, lib, ladder, grid in engines:
            if device.type == "cuda":
                torch.backends.cuda.preferred_blas_library(lib)
            # sdpa: SDPA decode attention; unfused: the split-KV kernel without the fused RoPE/SwiGLU
            # kernels (trinity.rollout.decode_fused); unshared: each sample reads its own copy of its
            # prompt's keys; auto: what the engine picks
            kernels = DecodeKernels(split_kv=attention != "sdpa", fused=attention not in ("sdpa", "unfused"),
                                    shared_prompt_keys=attention != "unshared", fused_sampler=smp == "fused",
                                    tuned_buckets=ladder != "fixed",
                                    **({"full_grid": int(grid)} if grid else {}))
            # the first call of an attention loads (and for Triton compiles) its kernels: timed apart; each
            # call captures its own graphs
            first = (attention, smp) not in warmed
            warmed.add((attention, smp))
            for attempt in (("warm-up", "timed") if first else ("timed",)):
                stats = RolloutStats(time_buckets=args.buckets and attempt == "timed")
                _sync(device)
                t0 = time.perf_counter()
                if engine == "continuous":
                    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.new_tokens)
                    generate_continuous(gpt, prompts, params, vocab_size=facts.vocab_size, pad_id=0,
                                        budget=KVBudget(max_num_seqs, None, args.kv_gib),
                                        response_lengths=lengths, stats=stats, kernels=kernels,
                                        generator=torch.Generator(device=device).manual_seed(0))
                else:  # the static batch decodes every row to the longest
                    params = SamplingParams(temperature=args.temperature, max_new_tokens=max(lengths))
                    reference_generate(gpt, prompts, params, vocab_size=facts.vocab_size, pad_id=0,
                                       fused_sampler=smp == "fused")
                _sync(device)
                dt = time.perf_counter() - t0
            if engine == "continuous":
                floor = (stats.decode_steps * weight_bytes + stats.live_kv_tokens * kv_per_token) / bw
                shared = (stats.decode_steps * weight_bytes + stats.read_kv_tokens * kv_per_token) / bw
                engine = (f"continuous ({stats.attention}, {stats.sampler} sampler"
                          f"{' in the graph' if stats.graph_tail else ''}, {stats.slots} slots"
                          f"{'' if lib == 'default' else ', ' + lib}"
                          f"{', fixed buckets' if ladder == 'fixed' else ''}"
                          f"{', one program per row from ' + grid + ' programs' if grid else ''}"
                          f"{'; ' + stats.bucket_note if stats.bucket_note else ''})")
                extra = (f"{stats.decode_steps} | {stats.slot_steps / max(1, stats.decode_steps):.0f} | "
                         f"{stats.graph_captures} ({stats.capture_s:.2f}) | {floor:.2f} | {100 * floor / dt:.1f}% | "
                         f"{shared:.2f} | {100 * shared / dt:.1f}%")
            else:
                steps = max(lengths)
                floor = (steps * weight_bytes + batch * steps * (args.prompt_len + steps / 2) * kv_per_token) / bw
                extra = f"{steps} | {batch} | - | {floor:.2f} | {100 * floor / dt:.1f}% (of its own reads) | - | -"
            print(f"| {engine} | {batch} | {args.lengths} (mean {useful / batch:.0f}) | {useful} | {dt:.2f} | "
                  f"{useful / dt:.0f} | {extra} | {2 * n_params * useful / rate:.2f} |", flush=True)
            if engine != "static" and stats.buckets:
                bucket_tables.append(bucket_table(stats, dt, engine, weight_bytes, kv_per_token, bw,
                                                  2 * n_params / rate))
        for table in bucket_tables:
            print(table)
        bucket_tables = []
    if args.profile:  # one more continuous call at the last batch size, under the profiler
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            generate_continuous(gpt, prompts, params, vocab_size=facts.vocab_size, pad_id=0,
                                budget=KVBudget(args.max_num_seqs[0], None, args.kv_gib), response_lengths=lengths,
                                generator=torch.Generator(device=device).manual_seed(0))
            _sync(device)
        wall = time.perf_counter() - t0
        from trinity.trainer.profiling import kernel_kind_table, kernel_kind_totals

        events = prof.key_averages()
        print("\n".join(kernel_kind_table(kernel_kind_totals(events), wall)))
        for key in ("self_cpu_time_total", "self_cuda_time_total" if device.type == "cuda" else None):
            if key:
                print(events.table(sort_by=key, row_limit=30, max_name_column_width=70))


if __name__ == "__main__":
    main()
