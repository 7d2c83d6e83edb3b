"""One training step (forward + backward + Adam) of a random-weight Qwen2 shape: trinity's
megatron-core path vs HF transformers with `attn_implementation="sdpa"`, in the same process.

    python benchmarks/train_step.py --shape qwen2_5_7b --seq 4096            # one GPU, bf16
    python benchmarks/train_step.py --shape qwen2_5_0_5b --seq 4096 --mbs 2
    python benchmarks/train_step.py --shape tiny --device cpu --seq 128      # smoke run on CPU

TFLOP/s = (6 * params * tokens + 12 * layers * hidden * seq * tokens) / step time. Peak memory is
torch.cuda.max_memory_allocated per engine on GPU, the process' max RSS on CPU (cumulative: the
second engine's number includes the first's). megatron-core trains as `trinity run` does (DDP with
fp32 grads, distributed optimizer with fp32 master weights, our SDPA layer spec); HF uses bf16
params with torch AdamW, so it holds less optimizer memory than megatron's mixed precision.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2_5_7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2_5_0_5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True),
}


def hf_config(shape: str, seq: int) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        **SHAPES[shape], max_position_embeddings=max(seq, 4096), rope_theta=1e6, rms_norm_eps=1e-6,
        architectures=["Qwen2ForCausalLM"],
    )


def step_flops(params: int, layers: int, hidden: int, seq: int, tokens: int) -> float:
    return 6.0 * params * tokens + 12.0 * layers * hidden * seq * tokens


def peak_gib(device: torch.device) -> float:
    from trinity.trainer.metrics import peak_memory_gib

    return peak_memory_gib(device)


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def timed(step: Callable[[], None], device: torch.device, warmup: int, steps: int) -> float:
    """Mean seconds per step after `warmup` untimed steps."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / steps


def random_batch(vocab: int, seq: int, mbs: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (mbs, seq), generator=g)
    return {
        "tokens": tokens,
        "labels": torch.roll(tokens, -1, dims=1),
        "loss_mask": torch.ones(mbs, seq, dtype=torch.float32),
        "position_ids": torch.arange(seq).expand(mbs, seq).contiguous(),
        "doc_ids": torch.zeros(mbs, seq, dtype=torch.long),
    }


def bench_megatron(cfg_dir: Path, device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> float:
    from trinity.config.megatron import MegatronConfig
    from trinity.config.schema import OptimConfig
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts
    from trinity.trainer.setup import build_train_state
    from trinity.trainer.sft import train_step

    facts = ModelFacts.from_hf_dir(cfg_dir)
    megatron = MegatronConfig(use_distributed_optimizer=True)
    if args.recompute:
        megatron.override_transformer_config.recompute_granularity = args.recompute
    chunks = build_model(facts, megatron, device=device.type, dtype=dtype)
    state = build_train_state(chunks, megatron, OptimConfig(lr=1e-5), dtype=dtype, total_steps=1000)
    batch = random_batch(facts.vocab_size, args.seq, args.mbs)
    tokens = args.seq * args.mbs

    def step() -> None:
        train_step(state, [batch], loss_tokens=tokens, seq_len=args.seq, device=device)

    seconds = timed(step, device, args.warmup, args.steps)
    del state, chunks
    return seconds


def bench_hf(cfg_dir: Path, device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(cfg_dir))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.train()
    if args.recompute:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    batch = random_batch(config.vocab_size, args.seq, args.mbs)
    ids = batch["tokens"].to(device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    seconds = timed(step, device, args.warmup, args.steps)
    del model, opt
    return seconds


ENGINES: dict[str, Callable[[Path, torch.device, torch.dtype, argparse.Namespace], float]] = {
    "megatron-core": bench_megatron,
    "hf-sdpa": bench_hf,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2_5_7b")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--recompute", choices=["full", "selective"], default=None)
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ", ".join(ENGINES))
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args()

    from trinity.distributed import parallel
    from trinity.distributed.layout import ParallelLayout

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    config = hf_config(args.shape, args.seq)
    params = _param_count(config)
    tokens = args.seq * args.mbs
    flops = step_flops(params, config.num_hidden_layers, config.hidden_size, args.seq, tokens)
    rows = []
    parallel.init_parallel(device=args.device, layout=ParallelLayout(), seed=1234)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            config.save_pretrained(tmp)
            for name in args.engines.split(","):
                reset_memory(device)
                seconds = ENGINES[name](Path(tmp), device, dtype, args)
                rows.append({
                    "engine": name, "shape": args.shape, "params_b": params / 1e9, "seq": args.seq, "mbs": args.mbs,
                    "step_s": seconds, "tokens_per_s": tokens / seconds, "tflops": flops / seconds / 1e12,
                    "peak_gib": peak_gib(device), "recompute": args.recompute or "none",
                })
                reset_memory(device)
    finally:
        parallel.destroy()
    print_table(rows, device)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


def _param_count(config: Any) -> int:
    """Parameters of the HF model (tied embeddings counted once), from the shapes alone."""
    h, f, n, v = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = h * h + 2 * h * kv + h + 2 * kv + h * h + 3 * h * f + 2 * h  # q,k,v (+bias), o, mlp, norms
    embeddings = v * h * (1 if config.tie_word_embeddings else 2)
    return n * per_layer + embeddings + h


def print_table(rows: list[dict[str, Any]], device: torch.device) -> None:
    from rich.console import Console
    from rich.table import Table

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    table = Table(title=f"training step on {name}")
    for col in ("engine", "shape", "params", "seq x mbs", "recompute", "step s", "tokens/s", "TFLOP/s", "peak GiB"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["engine"], r["shape"], f"{r['params_b'] * 1e3:.1f} M" if r["params_b"] < 1 else f"{r['params_b']:.2f} B", f"{r['seq']} x {r['mbs']}", r["recompute"],
                      f"{r['step_s']:.3f}", f"{r['tokens_per_s']:.0f}", f"{r['tflops']:.1f}", f"{r['peak_gib']:.2f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
