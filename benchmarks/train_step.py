"""One training step (forward + backward + AdamW, bf16, random weights) of Qwen2.5 shapes: our
megatron-core model (`trinity.models.build.build_model`, our spec) next to HF transformers with
`attn_implementation="sdpa"`, same process, same GPU.

    python benchmarks/train_step.py --shape qwen2_5_0_5b --seq 4096 --mbs 2
    python benchmarks/train_step.py --shape qwen2_5_7b --recompute none,selective,full --compile none,layers
    python benchmarks/train_step.py --shape qwen2_5_0_5b --packed no,varlen,flex,dense --engines mcore
    python benchmarks/train_step.py --shape qwen2_5_1_5b --engines mcore --optimizer torch-fused,trainer,megatron-stock
    python benchmarks/train_step.py --shape tiny --device cpu --seq 128 --steps 2 --warmup 1   # CPU smoke

Every combination of --engines x --recompute x --compile x --packed x --optimizer is one case (cases an
engine cannot run are skipped: HF has no selective recompute, no per-layer compile, no packed rows and
only torch's fused AdamW here).
TFLOP/s = (6 * params * tokens + 12 * layers * hidden * seq * tokens) / step time, params counted from
the HF shape (tied embeddings once); packed rows use the same count (their attention does less work, so
tokens/s is the fair comparison); --packed names the kernel of the packed rows (`yes` = what
`document_packed_params` picks, see trinity.models.attention.PACKED_KERNELS). Both engines use bf16 params
and, with `--optimizer torch-fused` (the default), torch's fused AdamW over them (fp32 on CPU).
`--optimizer trainer` steps ours as `trinity run` does: megatron-core DDP (fp32 grad buffer), its
mixed-precision optimizer (fp32 master weights, gradient clipping at 1.0) on the fused kernels of
`trinity.compat.fused_optimizer`; `megatron-stock` is the same with megatron-core's own fallbacks
without TE/apex (foreach AdamW, a host sync per parameter in the gradient norm).
ours takes the loss through `trinity.models.logprobs` (chunked, no full-vocabulary fp32 logits), HF
through its own loss. Peak memory = torch.cuda.max_memory_allocated, reset per case. Warm-up steps
(compile included) are timed separately as "first s".
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from trinity.trainer.profiling import kernel_kind_table, kernel_kind_totals

SHAPES: dict[str, dict[str, Any]] = {  # config.json fields of the Qwen2.5 releases
    "qwen2_5_7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2_5_1_5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2_5_0_5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True),
}


@dataclass(frozen=True)
class Case:
    engine: str
    recompute: str  # none | selective | full
    compile: str  # none | layers | model
    packed: str  # no | a trinity.models.attention.PACKED_KERNELS name
    optimizer: str = "torch-fused"  # torch-fused | trainer | megatron-stock


def hf_config_dict(shape: str, seq: int) -> dict[str, Any]:
    return dict(SHAPES[shape], model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_act="silu",
                max_position_embeddings=max(seq, 4096), rope_theta=1e6, rms_norm_eps=1e-6,
                attention_dropout=0.0, use_sliding_window=False)


def param_count(cfg: dict[str, Any]) -> int:
    h, f, n, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    per_layer = h * h + 2 * h * kv + h + 2 * kv + h * h + 3 * h * f + 2 * h  # q,k,v (+bias), o, mlp, norms
    return n * per_layer + v * h * (1 if cfg["tie_word_embeddings"] else 2) + h


def step_flops(params: int, layers: int, hidden: int, seq: int, tokens: int) -> float:
    return 6.0 * params * tokens + 12.0 * layers * hidden * seq * tokens


def make_batch(vocab: int, seq: int, mbs: int, packed: bool, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """Random tokens; packed rows hold documents of random lengths (64..seq/2) back to back. `doc_ids`
    stay on the CPU, where the trainer's data loader has them."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (mbs, seq), generator=g)
    doc_ids = torch.zeros(mbs, seq, dtype=torch.long)
    if packed:
        for row in range(mbs):
            start, doc = 0, 0
            while start < seq:
                length = int(torch.randint(64, max(65, seq // 2), (1,), generator=g))
                doc_ids[row, start:start + length] = doc
                start, doc = start + length, doc + 1
    return {"tokens": tokens.to(device), "labels": torch.roll(tokens, -1, 1).to(device),
            "position_ids": torch.arange(seq).expand(mbs, seq).contiguous().to(device),
            "doc_ids": doc_ids}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def optimizer(params: Any, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=device.type == "cuda")


def mcore_step(cfg_dir: Path, case: Case, device: torch.device, dtype: torch.dtype, args: Any) -> Callable[[], None]:
    from trinity.config.megatron import MegatronConfig
    from trinity.models.attention import document_packed_params
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts
    from trinity.models.logprobs import decoder_hidden, token_logprobs

    block = MegatronConfig()
    if case.recompute != "none":
        block.override_transformer_config.recompute_granularity = case.recompute
    megatron = block.model_copy(update={"torch_compile": case.compile})
    (model,) = build_model(ModelFacts.from_hf_dir(cfg_dir), megatron, device=device.type, dtype=dtype)
    model.train()
    batch = make_batch(model.vocab_size, args.seq, args.mbs, case.packed != "no", device)
    kernel = None if case.packed == "no" else case.packed
    if case.optimizer == "torch-fused":
        opt = optimizer(model.parameters(), device)
        zero_grad, finish = (lambda: opt.zero_grad(set_to_none=True)), opt.step
    else:
        zero_grad, finish = trainer_optimizer(model, megatron, dtype, stock=case.optimizer == "megatron-stock")

    def step() -> None:
        zero_grad()
        # once per batch, as the trainer does
        packed = document_packed_params(batch["doc_ids"], device=device, kernel=kernel) if kernel else None
        hidden = decoder_hidden(model, batch["tokens"], batch["position_ids"], None, packed_seq_params=packed)
        loss = -token_logprobs(model, hidden, batch["labels"], chunk_tokens=args.chunk_tokens).mean()
        loss.backward()
        finish()

    return step


def trainer_optimizer(model: Any, megatron: Any, dtype: torch.dtype, stock: bool) -> tuple[Callable[[], None], ...]:
    """(zero_grad, finish) of the trainer's DDP + megatron optimizer around `model` (whose forward the
    caller keeps calling: DDP's grad hooks are on its params)."""
    from trinity.config.schema import OptimConfig
    from trinity.testing.optim_checks import megatron_stock
    from trinity.trainer.engine.setup import build_train_state

    with megatron_stock() if stock else contextlib.nullcontext():
        state = build_train_state([model], megatron, OptimConfig(lr=1e-5, weight_decay=0.0, clip_grad=1.0),
                                  dtype=dtype, total_steps=1000)
    ddp = state.model[0]

    def zero_grad() -> None:
        ddp.zero_grad_buffer()
        state.optimizer.zero_grad()

    def finish() -> None:
        ddp.finish_grad_sync()
        ok, _, _ = state.optimizer.step()
        assert ok

    return zero_grad, finish


def hf_step(cfg_dir: Path, case: Case, device: torch.device, dtype: torch.dtype, args: Any) -> Callable[[], None]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(cfg_dir))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.train()
    if case.recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if case.compile == "model":
        model.compile()
    opt = optimizer(model.parameters(), device)
    ids = make_batch(config.vocab_size, args.seq, args.mbs, False, device)["tokens"]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    return step


ENGINES: dict[str, Callable[..., Callable[[], None]]] = {"mcore": mcore_step, "hf": hf_step}


def supported(case: Case) -> bool:
    if case.engine == "hf":
        return (case.recompute != "selective" and case.compile != "layers" and case.packed == "no"
                and case.optimizer == "torch-fused")
    return True


def profile_step(step: Callable[[], None], device: torch.device, out: Path | None, rows: int = 30) -> None:
    """One profiled step: GPU time per kind of kernel and the top kernels/ops by device time, printed
    (and a Chrome trace under `out`)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        sync(device)
        wall = time.perf_counter() - t0
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    if device.type == "cuda":
        print("\n".join(kernel_kind_table(kernel_kind_totals(prof.key_averages()), wall)), flush=True)
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70), flush=True)
    if out is not None:
        prof.export_chrome_trace(str(out))


def run_case(cfg_dir: Path, case: Case, device: torch.device, dtype: torch.dtype, args: Any) -> dict[str, Any]:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch._dynamo.reset()
    step = ENGINES[case.engine](cfg_dir, case, device, dtype, args)
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync(device)
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    if args.profile:
        tag = f"{case.engine}-{case.recompute}-{case.compile}-{case.packed}-{case.optimizer}"
        print(f"--- profile {tag}", flush=True)
        profile_step(step, device, args.profile / f"trace-{tag}.json" if args.profile.is_dir() else None,
                     rows=args.profile_rows)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    del step
    return {"first_s": first, "step_s": sorted(times)[len(times) // 2], "peak_gib": peak}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2_5_0_5b")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--engines", default="hf,mcore")
    p.add_argument("--recompute", default="none", help="comma list of none, selective, full")
    p.add_argument("--compile", default="none", help="comma list of none, layers, model")
    p.add_argument("--packed", default="no", help="comma list of no, yes, varlen, flex, dense")
    p.add_argument("--optimizer", default="torch-fused", help="comma list of torch-fused, trainer, megatron-stock")
    p.add_argument("--chunk-tokens", type=int, default=None, help="ours: log-probs over chunks of this many tokens")
    p.add_argument("--profile", type=Path, default=None, help="profile one step per case; a folder gets traces")
    p.add_argument("--profile-rows", type=int, default=30, help="--profile: how many top kernels/ops to list")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args()

    from trinity.distributed import parallel
    from trinity.distributed.layout import ParallelLayout

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = hf_config_dict(args.shape, args.seq)
    params, tokens = param_count(cfg), args.seq * args.mbs
    flops = step_flops(params, cfg["num_hidden_layers"], cfg["hidden_size"], args.seq, tokens)
    cases = [Case(e, r, c, "auto" if pk == "yes" else pk, o) for e in args.engines.split(",")
             for r in args.recompute.split(",") for c in args.compile.split(",") for pk in args.packed.split(",")
             for o in args.optimizer.split(",")]
    rows: list[dict[str, Any]] = []
    parallel.init_parallel(device=args.device, layout=ParallelLayout(), seed=1234)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(cfg))
            for case in filter(supported, cases):
                try:
                    result = run_case(Path(tmp), case, device, dtype, args)
                except torch.OutOfMemoryError:
                    result = {"first_s": float("nan"), "step_s": float("nan"), "peak_gib": float("inf")}
                row = {**asdict(case), "shape": args.shape, "params_b": params / 1e9, "seq": args.seq,
                       "mbs": args.mbs, **result, "tokens_per_s": tokens / result["step_s"],
                       "tflops": flops / result["step_s"] / 1e12}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        parallel.destroy()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print_table(rows, device)


def print_table(rows: list[dict[str, Any]], device: torch.device) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\ntraining step on {name}, torch {torch.__version__}")
    head = ("engine", "shape", "seq x mbs", "recompute", "compile", "packed", "optimizer", "first s", "step s",
            "tokens/s", "TFLOP/s", "peak GiB")
    print(" | ".join(head))
    for r in rows:
        print(" | ".join([r["engine"], r["shape"], f"{r['seq']} x {r['mbs']}", r["recompute"], r["compile"],
                          r["packed"], r["optimizer"], f"{r['first_s']:.1f}", f"{r['step_s']:.4f}",
                          f"{r['tokens_per_s']:.0f}", f"{r['tflops']:.1f}", f"{r['peak_gib']:.2f}"]))


if __name__ == "__main__":
    main()
