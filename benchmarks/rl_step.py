"""RL step phases through `trinity run`: time, tokens/s and peak GPU memory per phase, offload off/on,
1 and 2 GPUs, GRPO and PPO, next to the decode floor.

    python benchmarks/rl_step.py --shape 0.5b --gpus 1,2 --algos grpo,ppo --offload no,yes
    python benchmarks/rl_step.py --shape 1.5b --gpus 1 --algos grpo --offload no --lora-rank 0,16
    python benchmarks/rl_step.py --shape 0.5b --gpus 1 --algos grpo --offload no --prompts 64 --n 8 \
        --response-length 1024 --lengths lognormal --partial no,yes --steps 6   # partial rollouts
    python benchmarks/rl_step.py --shape 7b --gpus 4 --layout tp --algos grpo --offload yes --prompts 16 --n 8 \
        --response-length 3072 --lengths lognormal --steps 3                  # NeMo-RL's GRPO setting, 4 GPUs

Each case is a real `trinity run` (config validation, HF -> dist checkpoint cache, torchrun, the RL loop)
on a random-weight Qwen2 of the chosen shape with the tiny local tokenizer (sampled ids beyond its
vocabulary decode to nothing, so responses run to `--response-length`: fixed-length decoding, which is
what a throughput table wants). Numbers are medians over the steps after the first (which pays
compilation). `--lengths uniform|lognormal` ends each response after a drawn number of tokens (the
benchmark-only EOS schedule of benchmarks/eos_schedule.py, which benchmarks/eos_hook installs in the job's processes;
lognormal: mean 30% of `--response-length`), so the rollout and the training phases see real length
variation; `fixed:N` ends every response after N tokens under the same `--response-length` (the same
token budgets): a fixed-length run with the real tokens of a lognormal one. A comma list runs one case
each. tokens/s are real (response) tokens, and any `padding/...` metric the phases log is shown. "step
tokens/s/GPU" counts every token of the step (prompts and responses, through rollout, ref and update) per
GPU, as NeMo-RL's tables do; the phases' shares of the step follow the table.
`--partial no,yes` runs each case without and with partial rollouts (`actor_rollout_ref.rollout.partial`:
the rollout stops once the step's groups are complete and carries the unfinished answers over; with
`--lengths` each answer's length is drawn per sample, so a carried answer keeps its length; docs/rl.md).
The comparison the partial rollouts target: `--lengths lognormal --partial yes` against `--lengths fixed:N
--partial no` with N the lognormal case's response length mean (the same real tokens a step).
`--token-budget` sets the packed micro batches' tokens (`ppo_max_token_len_per_gpu`,
`log_prob_max_token_len_per_gpu`; 0: the config's default): N for every role, or A/R for the actor's
update and the forward-only passes (ref, critic); a comma list, one case each. On 2 GPUs the layout is DP=2 (`--layout tp` for TP=2). The decode floor is
the bytes of the weights read once per decode step over the copy bandwidth measured in this run; tokens/s are rank 0's.
With several GPUs `--layout dp` makes every GPU a data-parallel rank and `--layout tp` pairs them (TP=2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import bandwidth, make_job_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "reward", "ref", "old_logp", "values", "update_actor", "update_critic")


def _bandwidth(device: str) -> float:
    """generate.bandwidth, on CUDA in a child process: measured here, its CUDA context and cached 2 GiB
    stayed on GPU 0 for the whole benchmark (2.5 GiB that rank 0 of every job lacked; a 7B update ran out
    of memory beside it)."""
    if device != "cuda":
        return bandwidth(torch.device(device))
    code = "import sys, torch; sys.path.insert(0, sys.argv[1]); from generate import bandwidth; print(bandwidth(torch.device('cuda')))"
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], check=True, capture_output=True, text=True)
    return float(out.stdout.split()[-1])


def job(model: Path, prompts: Path, out: Path, *, algo: str, gpus: int, layout: str, offload: bool, args,
        lora: int = 0, budget: str = "0", partial: bool = False) -> dict:
    """`lora` > 0: LoRA adapters of that rank on every linear; the ref is then the actor with its adapters off
    (no ref block, no second model: docs/lora.md)."""
    par = {"tensor_model_parallel_size": 2} if gpus >= 2 and layout == "tp" else {}
    flags = {"param_offload": offload, "grad_offload": offload, "optimizer_offload": offload}
    cfg = {
        "algorithm": {"name": algo, "use_kl_in_reward": algo == "ppo"},
        "model": {"path": str(model)},
        "data": {"train_files": [str(prompts)], "max_prompt_length": 64, "train_batch_size": args.prompts * gpus},
        "cluster": {"device": args.device, "nproc_per_node": gpus},
        "trainer": {"total_steps": args.steps, "micro_batch_size": args.micro, "output_dir": str(out),
                    "save_interval": None, "save_last": False, "log_interval": 1, "tensorboard": False, "export_hf": False,
                    "profile_step": args.profile_step},
        "actor_rollout_ref": {
            "actor": {"ppo_mini_batch_size": args.prompts * gpus, "use_kl_loss": algo == "grpo",
                      "optim": {"lr": 1e-6, "weight_decay": 0.0}, "megatron": {**par, **flags}},
            "ref": {"megatron": {**par, "param_offload": offload}},
            "rollout": {"n": args.n, "response_length": args.response_length, "temperature": 1.0,
                        **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {})},
        },
        "reward": {"function": "trinity.rewards.arithmetic_reward:closeness"},
    }
    if algo == "ppo":
        cfg["critic"] = {"optim": {"lr": 1e-6, "weight_decay": 0.0}, "megatron": {**par, **flags}}
    # "N": every role's packed micro batches hold N tokens; "A/R": the actor's A, the ref's (and critic's) R
    train, infer = (int(x) for x in (budget.split("/") if "/" in budget else (budget, budget)))
    if train:
        cfg["actor_rollout_ref"]["actor"]["ppo_max_token_len_per_gpu"] = train
    if infer:
        if "ref" in cfg["actor_rollout_ref"]:
            cfg["actor_rollout_ref"]["ref"]["log_prob_max_token_len_per_gpu"] = infer
        if algo == "ppo":
            cfg["critic"]["ppo_max_token_len_per_gpu"] = infer
    if partial:
        cfg["actor_rollout_ref"]["rollout"]["partial"] = {
            "enable": True, "max_staleness": args.max_staleness,
            **({"over_sampling_batch_size": args.over_sampling * gpus} if args.over_sampling else {})}
    if lora:
        cfg["actor_rollout_ref"]["actor"]["lora"] = {"rank": lora, "alpha": 2.0 * lora, "target_modules": ["all-linear"]}
        del cfg["actor_rollout_ref"]["ref"]
    return cfg


def run_case(cfg: dict, path: Path, timeout: int, log_tail: int = 0, lengths: str = "fixed") -> list[dict]:
    """One `trinity run`; its output goes line by line to `<case>.log` beside the config and the step lines
    to this process's stdout as they come, so that a case cut off by `timeout` still shows how far it got."""
    import threading
    import time

    from eos_schedule import BENCH_LENGTHS_ENV

    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    code = f"import sys; from trinity.cli.commands import run; sys.exit(run({str(path)!r}, []))"
    # the EOS schedule: every process of the job imports eos_hook's sitecustomize (benchmarks/eos_schedule.py)
    hook = str(Path(__file__).resolve().parent / "eos_hook")
    pythonpath = os.pathsep.join(p for p in (hook, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, BENCH_LENGTHS_ENV: lengths, "PYTHONPATH": pythonpath}
    log = path.with_suffix(".log")
    lines: list[str] = []
    start = time.monotonic()
    with subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, start_new_session=True) as proc, log.open("w") as out:
        assert proc.stdout is not None
        # a job that prints nothing more is stopped too
        watchdog = threading.Timer(timeout, lambda: os.killpg(proc.pid, 9))
        watchdog.start()
        for line in proc.stdout:
            out.write(line)
            lines.append(line.rstrip("\n"))
            if line.partition("]:")[2 if "]:" in line else 0].startswith(("step ", "data:")):  # "[default0]:step 2/3 | ..."
                print(f"  [{time.monotonic() - start:6.0f} s] {line.rstrip()}", flush=True)
        code_ = proc.wait()
        watchdog.cancel()
    if time.monotonic() - start > timeout:
        print("\n".join(lines[-40:]))
        raise SystemExit(f"case {path.stem} ran past {timeout} s: stopped (its log: {log})")
    if log_tail:
        print("\n".join(lines[-log_tail:]), flush=True)
    if code_ != 0:
        print("\n".join(lines[-60:]))
        raise SystemExit(f"case {path.stem} failed with exit code {code_}")
    out_dir = Path(cfg["trainer"]["output_dir"])
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def summarize(rows: list[dict]) -> dict[str, float]:
    # the steps after the first (compiles, captures) that were not profiled; with none (--steps 2
    # --profile-step 2) the later steps, profiled or not, then the only one: never the first beside others
    steady = [r for r in rows[1:] if not r.get("profiled")] or rows[1:] or rows
    keys = {k for r in steady for k in r
            if k.startswith(("time/", "tokens_per_s/", "mem/", "padding", "response_length/", "rollout/"))
            or k == "step_time_s"}
    med = {k: statistics.median(r[k] for r in steady if k in r) for k in keys}
    med.update({k: max(r[k] for r in rows if k in r) for k in keys if k.endswith("_peak_gib")})
    return med


def phase_table(r: dict) -> None:
    print("| algo | GPUs | offload | phase | time s | tokens/s | peak GiB (rank 0) | at phase start GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for ph in PHASES:
        if f"time/{ph}_s" not in r:
            continue
        tps = r.get(f"tokens_per_s/{ph}")
        print(f"| {r['algo']} | {r['gpus']} | {r['offload']} | {ph} | {r[f'time/{ph}_s']:.3f} | "
              f"{'-' if tps is None else f'{tps:.0f}'} | {r.get(f'mem/{ph}_peak_gib', float('nan')):.2f} | "
              f"{r[f'mem/{ph}_gib']:.2f} |", flush=True)
    padding = {k: v for k, v in r.items() if k.startswith("padding")}
    if padding:
        print("padding fractions: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(padding.items())), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.5b", help="a shape of benchmarks/generate.py")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run (--shape tiny)")
    ap.add_argument("--gpus", default="1,2", help="processes per case (GPUs on cuda)")
    ap.add_argument("--algos", default="grpo,ppo")
    ap.add_argument("--offload", default="no,yes")
    ap.add_argument("--layout", choices=["dp", "tp"], default="dp",
                    help="several GPUs: dp (DP = GPUs) or tp (TP=2, DP = GPUs / 2)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per GPU per step")
    ap.add_argument("--n", type=int, default=4, help="responses per prompt")
    ap.add_argument("--response-length", type=int, default=128)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--lengths", default="fixed",
                    help="comma list, one case each: fixed (to --response-length), fixed:N, uniform, lognormal (mean 30%%)")
    ap.add_argument("--token-budget", default="0",
                    help="comma list of tokens per packed micro batch, N (every role) or A/R (actor / ref and critic); 0: default")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="actor_rollout_ref.rollout.max_num_seqs (default: the config's)")
    ap.add_argument("--timeout", type=int, default=400, help="seconds per case")
    ap.add_argument("--profile-step", type=int, default=None,
                    help="trainer.profile_step: profile this step of each case and print rank 0's GPU time per kind")
    ap.add_argument("--log-tail", type=int, default=0, help="print this many last lines of each job's output")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--lora-rank", default="0", help="comma list of actor LoRA ranks, one case each (0 = full training)")
    ap.add_argument("--partial", default="no", help="comma list of no / yes, one case each: actor_rollout_ref.rollout.partial")
    ap.add_argument("--over-sampling", type=int, default=0,
                    help="partial rollouts: prompts in flight per GPU (over_sampling_batch_size / GPUs; 0: the default, 2 x --prompts)")
    ap.add_argument("--max-staleness", type=int, default=1, help="partial rollouts: max_staleness")
    args = ap.parse_args()

    from trinity.testing.tiny_assets import write_prompt_dataset

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_job_model(args.shape, root, args.device)
        prompts = write_prompt_dataset(root / "prompts.jsonl", 512, seed=0)
        bw = _bandwidth(args.device)
        weight_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        floor_ms = weight_bytes / bw * 1e3  # one decode step reads every weight once
        print(f"lengths {args.lengths}; token budgets {args.token_budget}; shape {args.shape}: {weight_bytes / 2**30:.2f} GiB bf16 weights, copy bandwidth {bw / 1e9:.0f} GB/s, "
              f"decode floor {floor_ms:.3f} ms/step; {args.prompts} prompts x n={args.n} per GPU, "
              f"{args.response_length} new tokens, {args.layout.upper()} on several GPUs", flush=True)
        results = []
        for algo in args.algos.split(","):
            for gpus in (int(g) for g in args.gpus.split(",")):
                for off, lora, lengths, budget, part in ((o, int(r), ln, tb, p) for o in args.offload.split(",")
                                                         for r in args.lora_rank.split(",") for ln in args.lengths.split(",")
                                                         for tb in args.token_budget.split(",")
                                                         for p in args.partial.split(",")):
                    name = (f"{algo}_{gpus}gpu_offload-{off}" + (f"_lora-{lora}" if lora else "")
                            + (f"_{lengths.replace(':', '')}" if "," in args.lengths else "")
                            + (f"_budget-{budget.replace('/', '-')}" if budget != "0" else "")
                            + ("_partial" if part == "yes" else ""))
                    cfg = job(model, prompts, root / name, algo=algo, gpus=gpus, layout=args.layout,
                              offload=off == "yes", args=args, lora=lora, budget=budget, partial=part == "yes")
                    rows = run_case(cfg, root / f"{name}.yaml", args.timeout, args.log_tail, lengths)
                    med = summarize(rows)
                    # each step, so a median's spread shows (the update phase varies step to step)
                    print(f"{name}, per step (s): " + "; ".join(
                        f"{r.get('step_time_s', float('nan')):.2f} = rollout {r.get('time/rollout_s', float('nan')):.2f} "
                        f"+ ref {r.get('time/ref_s', float('nan')):.2f} + update {r.get('time/update_actor_s', float('nan')):.2f}"
                        for r in rows), flush=True)
                    if args.profile_step:
                        from trinity.trainer.profiling import summary_path

                        print(f"--- {name}, rank 0")
                        print(summary_path(root / name, args.profile_step, 0).read_text(), flush=True)
                    # Per rank, as the metrics are: DP ranks each decode their prompts with every weight;
                    # TP ranks decode all prompts with half the weights each.
                    tp = 2 if gpus >= 2 and args.layout == "tp" else 1
                    floor_tok_s = args.prompts * args.n * tp / (floor_ms / tp / 1e3)
                    # the whole step's throughput as NeMo-RL reports it: every token of every sequence
                    # (prompt and response), all phases, per GPU
                    seqs = args.prompts * gpus * args.n
                    all_tokens = seqs * (med.get("prompt_length/mean", 0.0) + med.get("response_length/mean", 0.0))
                    results.append({"case": name, "algo": algo, "gpus": gpus, "offload": off, **med,
                                    "floor_tokens_per_s": floor_tok_s,
                                    "step_tokens_per_s_per_gpu": all_tokens / med["step_time_s"] / gpus})
                    if part == "yes":  # what partial rollouts did (medians of the steady steps)
                        print(f"{name}: partial rollouts: carried over {med.get('rollout/carried_over', 0):.0f} answers, "
                              f"staleness mean {med.get('rollout/staleness_mean', 0):.3f}, restarted groups "
                              f"{med.get('rollout/restarted_groups', 0):.0f}, IS weight mean {med.get('rollout/is_weight_mean', 0):.4f} "
                              f"max {med.get('rollout/is_weight_max', 0):.3f}, clipped {med.get('rollout/is_clipped_fraction', 0):.4f}",
                              flush=True)
                    print(f"{name}: step {med['step_time_s']:.2f} s, response length mean "
                          f"{med.get('response_length/mean', float('nan')):.0f} max {med.get('response_length/max', float('nan')):.0f}; "
                          f"rollout: {med.get('rollout/decode_steps', 0):.0f} decode steps, {med.get('rollout/prefill_calls', 0):.0f} prefill forwards, "
                          f"{med.get('rollout/graph_captures', 0):.0f} graph captures in {med.get('rollout/graph_capture_s', 0):.3f} s",
                          flush=True)
                    phase_table(results[-1])  # per case, so a run cut short still reports what it measured
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
        print()
        print("| case | step s | rollout s | ref s | old_logp s | update_actor s | response mean / max | rollout tokens/s | decode-floor tokens/s | % of floor | step tokens/s/GPU |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results:
            tps = r["tokens_per_s/rollout"]
            t = {ph: (f"{r[f'time/{ph}_s']:.2f}" if f"time/{ph}_s" in r else "-") for ph in PHASES}
            print(f"| {r['case']} | {r['step_time_s']:.2f} | {t['rollout']} | {t['ref']} | {t['old_logp']} | {t['update_actor']} | "
                  f"{r.get('response_length/mean', float('nan')):.0f} / {r.get('response_length/max', float('nan')):.0f} | "
                  f"{tps:.0f} | {r['floor_tokens_per_s']:.0f} | {100 * tps / r['floor_tokens_per_s']:.1f} | "
                  f"{r['step_tokens_per_s_per_gpu']:.0f} |")
        print("\nShare of the step per phase (medians): " + "; ".join(
            f"{r['case']}: " + ", ".join(f"{ph} {100 * r[f'time/{ph}_s'] / r['step_time_s']:.0f}%"
                                         for ph in PHASES if f"time/{ph}_s" in r) for r in results))


if __name__ == "__main__":
    main()
