"""What `trinity run` gives an SFT user: tokens/s, TFLOP/s and peak memory from the job's own per-step
metrics, next to `benchmarks/train_step.py`'s bare model step of the same shape.

    python benchmarks/sft_run.py --shape 0.5b --seq 4096 --mbs 2 --steps 8
    python benchmarks/sft_run.py --shape 0.5b --seq 4096 --mbs 2 --steps 8 --profile-step 6
    python benchmarks/sft_run.py --shape tiny --device cpu --seq 256 --mbs 2 --steps 3    # CPU smoke

Each case is a real `trinity run` (validation, HF -> dist checkpoint cache, torchrun, the SFT loop with
megatron-core's schedule, DDP and mixed-precision optimizer) on a random-weight Qwen2 of the shape
(benchmarks/generate.py's shapes) with the tiny local tokenizer (one token per byte) and synthetic
documents of 256-3072 bytes packed into rows of --seq tokens. One optimizer step per global batch of
--mbs rows (one micro batch, as train_step.py measures). Numbers are medians over the steps after the
first two (compilation), the profiled step left out. TFLOP/s count 6 * params * tokens + 12 * layers *
hidden * seq * tokens, as train_step.py does.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import SHAPES, make_job_model  # noqa: E402
from rl_step import run_case  # noqa: E402
from train_step import step_flops  # noqa: E402


def write_documents(path: Path, n: int, seed: int) -> Path:
    """n {"prompt", "response"} samples of printable ASCII, 256-3072 bytes each (a quarter prompt)."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz      .,0123456789\n"
    with path.open("w") as f:
        for _ in range(n):
            size = rng.randint(256, 3072)
            text = "".join(rng.choices(alphabet, k=size))
            f.write(json.dumps({"prompt": text[: size // 4], "response": text[size // 4:]}) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=2, help="rows per micro batch = per step")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--compile", choices=["none", "layers", "model"], default="none", help="megatron.torch_compile")
    ap.add_argument("--timeout", type=int, default=500, help="seconds for the run")
    ap.add_argument("--profile-step", type=int, default=None,
                    help="trainer.profile_step: profile this step and print GPU time per kind of kernel")
    ap.add_argument("--profile-dir", type=Path, default=None, help="copy rank 0's trace of the profiled step here")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_job_model(args.shape, root, args.device)
        # enough documents for every step's rows (about 1.7k tokens each)
        docs = write_documents(root / "sft.jsonl", args.steps * args.mbs * args.seq // 1000 + 16, seed=0)
        out = root / "run"
        cfg = {
            "algorithm": {"name": "sft"},
            "model": {"path": str(model)},
            "data": {"train_files": [str(docs)], "seq_length": args.seq},
            "cluster": {"device": args.device, "nproc_per_node": 1},
            "trainer": {"total_steps": args.steps, "global_batch_size": args.mbs, "micro_batch_size": args.mbs,
                        "output_dir": str(out), "save_interval": None, "log_interval": 1, "tensorboard": False,
                        "export_hf": False, "profile_step": args.profile_step},
            "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-5, "weight_decay": 0.0},
                                            "megatron": {"torch_compile": args.compile}}},
        }
        rows = run_case(cfg, root / "job.yaml", args.timeout)
        if args.profile_step:
            from trinity.trainer.profiling import summary_path, trace_path

            print(summary_path(out, args.profile_step, 0).read_text())
            if args.profile_dir:
                args.profile_dir.mkdir(parents=True, exist_ok=True)
                trace = trace_path(out, args.profile_step, 0)
                (args.profile_dir / trace.name).write_bytes(trace.read_bytes())
        hf = json.loads((model / "config.json").read_text())
        params = sum(p.numel() for p in _meta_model(model).parameters())

    steady = [r for r in rows[2:] if not r.get("profiled")] or rows
    step_s = statistics.median(r["step_time_s"] for r in steady)
    tokens = args.seq * args.mbs
    flops = step_flops(params, hf["num_hidden_layers"], hf["hidden_size"], args.seq, tokens)
    print(f"\ntrinity run (SFT) on {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, "
          f"shape {args.shape}, {args.steps} steps, torch {torch.__version__}")
    print("shape | seq x mbs | torch_compile | step s | tokens/s | TFLOP/s | peak GiB | loss first -> last")
    print(f"{args.shape} | {args.seq} x {args.mbs} | {args.compile} | {step_s:.4f} | {tokens / step_s:.0f} | "
          f"{flops / step_s / 1e12:.1f} | {max(r['mem_peak_gib'] for r in rows):.2f} | "
          f"{rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")


def _meta_model(path: Path) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)))


if __name__ == "__main__":
    main()
