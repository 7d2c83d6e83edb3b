"""What `trinity run` gives an SFT user: tokens/s, TFLOP/s and peak memory from the job's own per-step
metrics, next to `benchmarks/train_step.py`'s bare model step of the same shape.

    python benchmarks/sft_run.py --shape 0.5b --seq 4096 --mbs 2 --steps 8
    python benchmarks/sft_run.py --shape 0.5b --seq 4096 --mbs 2 --steps 8 --profile-step 6
    python benchmarks/sft_run.py --shape 0.5b --seq 4096 --mbs 2 --layouts 1gpu,dp2,tp2        # 2 GPUs
    python benchmarks/sft_run.py --shape 1.5b --seq 4096 --mbs 2 --layouts 1gpu,dp2,tp2,dp4,tp2dp2   # 4 GPUs
    python benchmarks/sft_run.py --shape 0.5b --layouts 1gpu,dp2 --megatron overlap_grad_reduce=true
    python benchmarks/sft_run.py --shape tiny --device cpu --seq 256 --mbs 2 --steps 3    # CPU smoke
    python benchmarks/sft_run.py --shape 1.5b --seq 4096 --mbs 2 --optimizer-offload no,yes
    python benchmarks/sft_run.py --shape 7b --seq 4096 --mbs 1 --steps 5 --optimizer-offload yes --no-final-checkpoint
    python benchmarks/sft_run.py --shape 7b --seq 4096 --mbs 1 --steps 5 --lora-rank 16 --no-final-checkpoint
    python benchmarks/sft_run.py --shape 7b --seq 32768 --mbs 1 --steps 5 --cp 2 --unpacked --no-final-checkpoint \
        --megatron 'override_transformer_config={recompute_granularity: full, recompute_method: uniform, recompute_num_layers: 1}'
        # context parallelism: --cp ranks per layout GPU (--cp 2 on 1gpu: 2 GPUs; on tp2: 4)

Each case is a real `trinity run` (validation, HF -> dist checkpoint cache, torchrun, the SFT loop with
megatron-core's schedule, DDP and mixed-precision optimizer) on a random-weight Qwen2 of the shape
(benchmarks/generate.py's shapes) with the tiny local tokenizer (one token per byte) and synthetic
documents of 256-3072 bytes packed into rows of --seq tokens. One optimizer step per global batch of
--mbs rows (one micro batch, as train_step.py measures). Numbers are medians over the steps after the
first two (compilation), the profiled step left out. TFLOP/s count 6 * params * tokens + 12 * layers *
hidden * seq * tokens, as train_step.py does.

`--layouts` runs the same job on 1 GPU and at DP=2 / TP=2 (benchmarks/scaling.py's layouts), each
data-parallel rank training --mbs rows per step: efficiency = tokens/s per GPU against one GPU, through
the trainer's own reducer and optimizer (fp32 grad buffer, distributed optimizer by default), where
scaling.py times the bare model step. `--megatron KEY=VALUE` sets a field of the actor's `megatron:`
block for every layout (overlap_grad_reduce, use_distributed_optimizer, sequence_parallel, ...).
`--optimizer-offload no,yes` runs each layout without and with `optimizer_offload` (the optimizer in host
memory, stepped on the CPU: trinity.trainer.engine.host_optimizer); "host optim s" is the part of the step
spent in that host step (device -> host gradients, AdamW on the CPU, host -> device weights).
`--lora-rank 0,16` runs each case with full fine-tuning (0) and with LoRA adapters of that rank on every
linear (actor.lora, alpha = 2 x rank; docs/lora.md): the frozen bf16 base plus the adapters' gradients and
optimizer, against full fine-tuning, which at 7B fits one H100 only with optimizer_offload.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import SHAPES, make_job_model  # noqa: E402
from rl_step import run_case  # noqa: E402
from scaling import LAYOUTS  # noqa: E402
from train_step import step_flops  # noqa: E402


def write_documents(path: Path, n: int, seed: int, seq: int, whole_rows: bool = False) -> Path:
    """n {"prompt", "response"} samples of printable ASCII, seq/16 to 3 seq/4 bytes each (256-3072 at
    seq 4096; a quarter prompt); `whole_rows`: 7/8 to 15/16 of seq (one long sample per row)."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz      .,0123456789\n"
    low, high = (7 * seq // 8, 15 * seq // 16) if whole_rows else (seq // 16, 3 * seq // 4)
    with path.open("w") as f:
        for _ in range(n):
            size = rng.randint(low, high)
            text = "".join(rng.choices(alphabet, k=size))
            f.write(json.dumps({"prompt": text[: size // 4], "response": text[size // 4:]}) + "\n")
    return path


def main() -> None:
    import signal

    # an outer `timeout` sends SIGTERM: end as an exception, so that the running case prints its log and
    # stops its job
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=2, help="rows per micro batch = per step and data-parallel rank")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layouts", default="1gpu",
                    help=f"comma list of {', '.join(LAYOUTS)}: one `trinity run` each (dp2 / tp2 need 2 GPUs, dp4 / tp2dp2 / tp4 need 4)")
    ap.add_argument("--megatron", action="append", default=[], metavar="KEY=VALUE",
                    help="a field of the actor's megatron: block (YAML value), e.g. overlap_grad_reduce=true; "
                         "repeatable")
    ap.add_argument("--optimizer-offload", default="no", help="comma list of no,yes: one run each, with "
                    "actor_rollout_ref.actor.megatron.optimizer_offload off / on")
    ap.add_argument("--no-final-checkpoint", action="store_true",
                    help="stop each job once its last step's metrics are written, before the checkpoint every job "
                         "saves at its end (7B: ~106 GB with the optimizer state, more than a lent machine's disk)")
    ap.add_argument("--cp", type=int, default=1,
                    help="context_parallel_size: each layout's GPUs times CP (a row's tokens split over the CP ranks; "
                         "--seq a multiple of 2 x CP, x TP with sequence_parallel)")
    ap.add_argument("--unpacked", action="store_true",
                    help="one sample of 7/8 to 15/16 of --seq per row (data.packing: false), as long sequences "
                         "are trained; at --cp > 1 such rows attend through the ring's flash kernel, packed rows "
                         "through its fp32 document-masked kernel")
    ap.add_argument("--compile", choices=["none", "layers", "model"], default="none", help="megatron.torch_compile")
    ap.add_argument("--lora-rank", default="0", help="comma list of LoRA ranks, one run each (0 = full fine-tuning; "
                    "actor_rollout_ref.actor.lora.rank, all linears, alpha = 2 x rank)")
    ap.add_argument("--timeout", type=int, default=500, help="seconds for each run")
    ap.add_argument("--profile-step", type=int, default=None,
                    help="trainer.profile_step: profile this step and print GPU time per kind of kernel")
    ap.add_argument("--profile-dir", type=Path, default=None, help="copy rank 0's trace of the profiled step here")
    args = ap.parse_args()
    layouts = args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        ap.error(f"--layouts: unknown {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    megatron = {"torch_compile": args.compile, **dict(_key_value(kv, ap) for kv in args.megatron)}

    results = []
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    extra = " ".join(args.megatron) or "defaults"
    print(f"trinity run (SFT) on {where}, shape {args.shape}, seq {args.seq}, {args.mbs} rows per DP rank, "
          f"{args.steps} steps, torch_compile {args.compile}, megatron: {extra}, torch {torch.__version__}", flush=True)
    ranks = [int(r) for r in args.lora_rank.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_job_model(args.shape, root, args.device)
        hf = json.loads((model / "config.json").read_text())
        params = sum(p.numel() for p in _meta_model(model).parameters())
        cases = [(layout, off, rank) for layout in layouts for off in args.optimizer_offload.split(",") for rank in ranks]
        for layout, off, rank in cases:
            if off not in ("no", "yes"):
                ap.error(f"--optimizer-offload: {off!r} is not no or yes")
            gpus, tp = LAYOUTS[layout]
            dp = gpus // tp
            gpus *= args.cp  # context parallelism: CP ranks per TP x DP rank, the rows split between them
            rows_per_step = args.mbs * dp  # every data-parallel rank gets --mbs rows, as scaling.py does
            # enough documents for every step's rows (~2.5 a row); the first term alone was the count
            # before --layouts, kept so that runs at seq 4096 train on the same data as before
            n_docs = max(args.steps * rows_per_step * args.seq // 1000, args.steps * rows_per_step * 3) + 16
            docs = write_documents(root / f"sft_{layout}.jsonl", n_docs, seed=0, seq=args.seq, whole_rows=args.unpacked)
            out = root / f"run_{layout}_offload-{off}_lora-{rank}"
            cfg = {
                "algorithm": {"name": "sft"},
                "model": {"path": str(model)},
                "data": {"train_files": [str(docs)], "seq_length": args.seq, "packing": not args.unpacked},
                "cluster": {"device": args.device, "nproc_per_node": gpus},
                "trainer": {"total_steps": args.steps, "global_batch_size": rows_per_step,
                            "micro_batch_size": args.mbs, "output_dir": str(out), "save_interval": None,
                            "log_interval": 1, "tensorboard": False, "export_hf": False,
                            "profile_step": args.profile_step},
                "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-4 if rank else 1e-5, "weight_decay": 0.0},
                                                "megatron": {**megatron, "tensor_model_parallel_size": tp,
                                                             "context_parallel_size": args.cp,
                                                             "optimizer_offload": off == "yes"}}},
            }
            if rank:
                cfg["actor_rollout_ref"]["actor"]["lora"] = {"rank": rank, "alpha": 2.0 * rank,
                                                             "target_modules": ["all-linear"]}
            job = root / f"job_{layout}_offload-{off}_lora-{rank}.yaml"
            rows = (run_steps_only(cfg, job, args.timeout, args.steps) if args.no_final_checkpoint
                    else run_case(cfg, job, args.timeout))
            if args.profile_step:
                _show_profile(out, args.profile_step, args.profile_dir, layout)
            steady = [r for r in rows[2:] if not r.get("profiled")] or rows
            step_s = statistics.median(r["step_time_s"] for r in steady)
            tokens = args.seq * rows_per_step
            flops = step_flops(params, hf["num_hidden_layers"], hf["hidden_size"], args.seq, tokens)
            host_s = statistics.median(r.get("host_optimizer_s", 0.0) for r in steady)
            results.append({"layout": layout, "offload": off, "lora": rank, "host_s": host_s, "gpus": gpus, "step_s": step_s,
                            "tokens_per_s": tokens / step_s,
                            "tflops_per_gpu": flops / step_s / 1e12 / gpus,
                            "peak_gib": max(r["mem_peak_gib"] for r in rows),
                            "loss": (rows[0]["loss"], rows[-1]["loss"])})
            # each row as its case ends: a run cut short (a device call's time limit) keeps what it measured
            print("case: " + _row(results[-1], results), flush=True)

    # TFLOP/s count full training's 6 x params x tokens also for LoRA (which skips the base weight gradients)
    print("\nlayout | optimizer offload | lora rank | gpus | step s | host optim s | tokens/s | tokens/s per gpu | "
          "efficiency | TFLOP/s per gpu | peak GiB (rank 0) | loss first -> last")
    for r in results:
        print(_row(r, results))


def _row(r: dict, results: list[dict]) -> str:
    """One table row; efficiency = tokens/s per GPU against the one-GPU case of the same offload and LoRA
    rank ("-" until that case has run)."""
    base = next((b["tokens_per_s"] for b in results if b["gpus"] == 1 and b["offload"] == r["offload"]
                 and b["lora"] == r["lora"]), None)
    per_gpu = r["tokens_per_s"] / r["gpus"]
    eff = f"{per_gpu / base:.2f}" if base else "-"
    return (f"{r['layout']} | {r['offload']} | {r['lora']} | {r['gpus']} | {r['step_s']:.4f} | {r['host_s']:.4f} | "
            f"{r['tokens_per_s']:.0f} | {per_gpu:.0f} | {eff} | "
            f"{r['tflops_per_gpu']:.1f} | {r['peak_gib']:.2f} | {r['loss'][0]:.3f} -> {r['loss'][1]:.3f}")


def run_steps_only(cfg: dict, path: Path, timeout: int, steps: int) -> list[dict]:
    """`run_case` that ends the job (its whole process group: the CLI, torchrun and the workers) once
    metrics.jsonl holds `steps` rows, i.e. before the final checkpoint is written."""
    import os
    import signal
    import subprocess
    import time

    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    metrics = Path(cfg["trainer"]["output_dir"]) / "metrics.jsonl"
    code = f"import sys; from trinity.cli.commands import run; sys.exit(run({str(path)!r}, []))"
    log = path.with_suffix(".log")
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        start = time.monotonic()
        deadline = start + timeout
        rows: list[dict] = []
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                if metrics.exists():
                    seen = len(rows)
                    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
                    for r in rows[seen:]:  # where a case cut off by a device call's limit got to
                        print(f"  [{time.monotonic() - start:4.0f} s] {path.stem}: step {r.get('step')} "
                              f"{r.get('step_time_s', 0):.2f} s", flush=True)
                    if len(rows) >= steps:
                        break
                time.sleep(1)
        except BaseException:  # SIGTERM (an outer `timeout`) or Ctrl-C: say how far the job got
            print(f"case {path.stem} stopped after {time.monotonic() - start:.0f} s; its log ends:\n"
                  + log.read_text()[-3000:], flush=True)
            raise
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
    if len(rows) < steps:
        print(log.read_text()[-3000:])
        raise SystemExit(f"case {path.stem}: {len(rows)} of {steps} steps in {timeout} s (exit code {proc.returncode})")
    return rows


def _key_value(text: str, ap: argparse.ArgumentParser) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        ap.error(f"--megatron {text!r}: expected KEY=VALUE, e.g. overlap_grad_reduce=true")
    return key, yaml.safe_load(value)


def _show_profile(out: Path, step: int, profile_dir: Path | None, layout: str) -> None:
    from trinity.trainer.profiling import summary_path, trace_path

    print(f"--- {layout}, rank 0")
    print(summary_path(out, step, 0).read_text())
    if profile_dir:
        profile_dir.mkdir(parents=True, exist_ok=True)
        trace = trace_path(out, step, 0)
        (profile_dir / f"{layout}.{trace.name}").write_bytes(trace.read_bytes())


def _meta_model(path: Path) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)))


if __name__ == "__main__":
    main()
