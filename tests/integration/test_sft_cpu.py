"""SFT end to end on CPU through `trinity.cli.commands.run` (the real torchrun path, gloo, fp32).

A tiny Qwen2 (4 layers, hidden 64, character vocabulary) learns the arithmetic task of the
quickstart. Every job is a real `trinity run`: config validation, HF -> dist checkpoint cache,
torchrun, worker, megatron-core schedules, dist checkpoints, HF export.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import FIXTURES, private_conversion_cache, trinity_run, trinity_run_argv
from tests.console import noise

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer, write_sft_dataset

    root = tmp_path_factory.mktemp("sft_assets")
    tok = make_tiny_tokenizer(root / "tokenizer")
    # 4 layers so that PP=2 x VPP=2 has a layer per chunk.
    model = make_tiny_qwen2(root / "model", tok, num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2)
    data = write_sft_dataset(root / "sft.jsonl", 600, seed=0)
    return {"model": model, "data": data, "root": root}


def job(assets: dict[str, Path], out: Path, **sections) -> dict:
    """A small SFT job; keyword arguments replace or extend whole sections' keys."""
    cfg = {
        "algorithm": {"name": "sft"},
        "model": {"path": str(assets["model"])},
        "data": {"train_files": [str(assets["data"])], "seq_length": 64, "packing": True},
        "cluster": {"device": "cpu", "nproc_per_node": 1},
        "trainer": {
            "total_steps": 8, "global_batch_size": 8, "micro_batch_size": 2, "output_dir": str(out),
            "save_interval": None, "keep_last": 2, "log_interval": 1, "tensorboard": False, "export_hf": False,
        },
        "actor_rollout_ref": {"actor": {
            "optim": {"lr": 3e-3, "lr_warmup_steps": 2, "lr_scheduler": "constant", "weight_decay": 0.0, "clip_grad": 1.0},
            "megatron": {},
        }},
    }
    for section, values in sections.items():
        target = cfg["actor_rollout_ref"]["actor"] if section in ("optim", "megatron") else cfg
        target.setdefault(section, {}).update(values)
    return cfg


def run_job(cfg: dict, path: Path, env: dict[str, str] | None = None, *, reuse_conversion: bool = False) -> int:
    """`trinity run` in a child process; its exit code. reuse_conversion: see tests/conftest.py (off where
    a test checks the run's own conversion)."""
    return trinity_run(cfg, path, timeout=170, env=env, reuse_conversion=reuse_conversion).returncode


def run_job_on_a_terminal(cfg: dict, path: Path) -> tuple[int, str]:
    """`trinity run` with its stdout and stderr on a pseudo-terminal, as a user in a shell has it;
    returns (exit code, everything the terminal received)."""
    from tests.console import on_a_terminal

    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    # as a user's shell has it: not under CI (where no bar is drawn, trinity.trainer.progress)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TRINITY_TTY", "CI")}
    returncode, received = on_a_terminal(trinity_run_argv(path), cwd=REPO, env={**env, "TERM": "xterm-256color"},
                                         timeout=170, columns=120)
    text = received.decode(errors="replace")
    (path.parent / f"{path.stem}.out").write_text(text)
    return returncode, text


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _runs_worker(cmdline: list[str]) -> bool:
    """A worker rank (`python -u -m trinity.trainer.worker ...`), not torchrun's agent, whose first
    `-m` is torch.distributed.run."""
    return "-m" in cmdline and cmdline[cmdline.index("-m") + 1 :][:1] == ["trinity.trainer.worker"]


@pytest.fixture(scope="module")
def baseline_run(assets, tmp_path_factory) -> Path:
    """An uninterrupted 10-step run at TP=PP=DP=1 with checkpoints every 5 steps and an HF export.
    The lr is constant after a 2-step warm-up, so shorter runs of the same job follow the same schedule."""
    out = tmp_path_factory.mktemp("baseline")
    cfg = job(assets, out / "run", trainer={"total_steps": 10, "save_interval": 5, "export_hf": True, "profile_step": 3,
                                         "curves": None})  # curves.png when matplotlib is installed, as by default
    assert run_job(cfg, out / "job.yaml", reuse_conversion=True) == 0
    return out / "run"


@pytest.fixture(scope="module")
def baseline(baseline_run) -> dict[int, float]:
    return losses(baseline_run)


@pytest.mark.slow
def test_sft_single_process_learns_and_exports(assets, baseline_run):
    out = baseline_run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mem_peak_gib"):
        assert all(isinstance(r[key], float) and r[key] > 0 for r in rows), key
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert last < 0.75 * first, (first, last)
    assert rows[0]["lr"] == pytest.approx(1.5e-3) and rows[-1]["lr"] == pytest.approx(3e-3)  # 2 warm-up steps
    text = (out.parent / "job.out").read_text()
    # a redirected run: plain lines only, and the closing summary names what the run left
    assert "\x1b" not in text and "━" not in text
    summary = text[text.index(f"[default0]:run summary: {out}\n"):].splitlines()[1:]
    labels = ["loss", "metrics", "logs", "checkpoint", "hf export", "curves", "profile"]
    if importlib.util.find_spec("matplotlib") is None:  # no curves.png without it
        labels.remove("curves")
    assert [line.split()[1] for line in summary] == [label.split()[0] for label in labels], summary
    assert summary[0] == f"[default0]:  {'loss':10}  {first:.4f} (step 1) -> {last:.4f} (step 10)"
    assert summary[3] == f"[default0]:  {'checkpoint':10}  {out / 'checkpoints' / 'step_10'}"
    assert all(Path(line.split()[-1]).exists() for line in summary[1:]), summary
    # trainer.profile_step: one trace, that step's line marked, host ops summarised (the losses of the
    # other tests' unprofiled runs match this run's step 3 too)
    assert [r["step"] for r in rows if r.get("profiled")] == [3]
    assert sorted(p.name for p in (out / "profile").iterdir()) == ["step_3.rank_0.json.gz", "step_3.rank_0.txt"]
    assert f"profiled step 3: trace {out / 'profile' / 'step_3.rank_0.json.gz'}" in text
    assert "step 3/10 |" in text and "| profiled" in text
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_10", "step_5"]
    assert (ckpts / "step_10" / "complete").is_file() and (ckpts / "step_10" / "hf" / "config.json").is_file()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(str(out / "hf"))
    orig = AutoModelForCausalLM.from_pretrained(str(assets["model"]))
    AutoTokenizer.from_pretrained(str(out / "hf"))
    names = dict(orig.named_parameters())
    changed = [n for n, p in hf.named_parameters() if not torch.equal(p, names[n])]
    assert len(changed) == len(names), "every trained tensor differs from the initial model"

    # `trinity convert mcore-to-hf --verify` on a training checkpoint checks against the checkpoint
    # itself (the original HF model it was trained from differs by design) and equals the run's export.
    from trinity.convert.api import mcore_to_hf

    report = mcore_to_hf(str(ckpts / "step_10"), str(out.parent / "step10_hf"), verify=True)
    assert report.verified == "every tensor bit for bit against the dist checkpoint"
    again = dict(AutoModelForCausalLM.from_pretrained(str(out.parent / "step10_hf")).named_parameters())
    assert all(torch.equal(p, again[n]) for n, p in hf.named_parameters())


@pytest.mark.slow
def test_a_second_run_of_the_finished_job_launches_nothing(baseline_run):
    """`trinity run` of the baseline's config again: one line saying the job is complete and where its
    outputs are, exit 0, and nothing written (no log, no export, no checkpoint touched)."""
    import sys

    out = baseline_run
    record = json.loads((out / "trinity_done.json").read_text())
    assert {k: record[k] for k in ("step", "checkpoint", "exports")} == {
        "step": 10, "checkpoint": "checkpoints/step_10", "exports": ["hf"]}

    def snapshot() -> dict[str, int]:
        return {str(p): p.stat().st_mtime_ns for p in out.rglob("*")}

    before = snapshot()
    proc = subprocess.run([sys.executable, "-m", "trinity.cli.main", "run", "-c", str(out.parent / "job.yaml")],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.splitlines() == [
        f"job already complete: {out} trained all 10 steps (checkpoint {out / 'checkpoints' / 'step_10'}, "
        f"export {out / 'hf'}); nothing to run (raise trainer.total_steps to train on, or use a new "
        "trainer.output_dir to start over)"]
    assert snapshot() == before


@pytest.mark.slow
def test_stop_resume_and_kill_during_save(assets, baseline, tmp_path):
    """Stop after 6 steps; resume towards 10 and kill -9 while checkpoint 9 is being written; resume
    again: it starts from step 6 (the .tmp leftover of 9 is ignored) and steps 7-10 match the
    uninterrupted run."""
    import psutil

    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    assert run_job(job(assets, out, trainer={"total_steps": 6, "save_interval": 3}), tmp_path / "p1.yaml") == 0
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_3", "step_6"]
    # The conversion went to the job's own conversion cache (tests/conftest.py), not the output folder.
    (cache,) = [p for p in (tmp_path / "mcore_conversions").iterdir() if p.is_dir()]
    assert not (out / "mcore_cache").exists()
    assert f"converting {assets['model']} to a megatron-core checkpoint in {cache}" in (tmp_path / "p1.out").read_text()

    cfg = job(assets, out, trainer={"total_steps": 10, "save_interval": 3})
    path = tmp_path / "p2.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    # The worker stops itself (SIGSTOP) as it is about to write step 9's `complete` marker: everything else
    # of the checkpoint is written (tests/fixtures/stop_before_open/sitecustomize.py); it is killed there.
    hooks = str(FIXTURES / "stop_before_open")
    env = {**os.environ, **private_conversion_cache(tmp_path), "TRINITY_TEST_STOP_BEFORE_OPEN": "step_9.tmp/complete",
           "PYTHONPATH": os.pathsep.join(p for p in (hooks, os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen(trinity_run_argv(path), cwd=REPO, env=env,
                            stdout=(tmp_path / "p2.out").open("w"), stderr=subprocess.STDOUT)
    tmp_ckpt = ckpts / "step_9.tmp"
    try:
        deadline = time.time() + 150
        while True:
            assert time.time() < deadline and proc.poll() is None, "the save of step 9 never reached its marker"
            workers, stopped = [], []
            for p in psutil.Process(proc.pid).children(recursive=True):
                try:  # a short-lived child may end (or be a zombie) between the listing and the look
                    if _runs_worker(p.cmdline()):
                        workers.append(p)
                        stopped.append(p.status() == psutil.STATUS_STOPPED)
                except psutil.Error:
                    continue
            if workers and all(stopped):
                break
            time.sleep(0.2)
        assert len(workers) == 1 and (tmp_ckpt / "rng" / "rank_0.pt").is_file()
        os.kill(workers[0].pid, signal.SIGKILL)
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert tmp_ckpt.is_dir() and not (ckpts / "step_9").exists()
    reused = f"using the cached megatron-core checkpoint {cache}"
    p2 = (tmp_path / "p2.out").read_text()
    assert reused in p2 and "converting" not in p2, p2[-3000:]
    killed = losses(out)
    assert sorted(killed) == list(range(1, 10))

    assert run_job(cfg, tmp_path / "p3.yaml") == 0
    p3 = (tmp_path / "p3.out").read_text()
    assert f"resumed from {ckpts / 'step_6'} at step 6" in p3
    assert reused in p3 and "converting" not in p3
    resumed = losses(out)
    assert sorted(resumed) == list(range(1, 11))
    for step in range(1, 11):
        assert resumed[step] == pytest.approx(baseline[step], rel=1e-6, abs=0), step
    for step in (7, 8, 9):
        assert killed[step] == pytest.approx(baseline[step], rel=1e-6, abs=0), step
    # keep_last=2: 9 and 10 are the newest complete ones; the killed .tmp was replaced by step_9.
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_10", "step_9"]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(
    "layout",
    [
        {"tensor_model_parallel_size": 2},
        # PP=2 with 2 model chunks per stage: runs plain PP=2's code paths and the interleaved schedule
        {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
        {"use_distributed_optimizer": True, "overlap_grad_reduce": True},  # DP=2
    ],
    ids=["tp2", "pp2_vpp2", "dp2"],
)
def test_layouts_give_the_same_losses(assets, baseline, tmp_path_factory, layout):
    tmp = tmp_path_factory.mktemp("layout")
    cfg = job(assets, tmp / "run", trainer={"total_steps": 4}, cluster={"nproc_per_node": 2}, megatron=layout)
    assert run_job(cfg, tmp / "job.yaml", reuse_conversion=True) == 0
    b = losses(tmp / "run")
    assert sorted(b) == [1, 2, 3, 4]
    for step in b:
        assert b[step] == pytest.approx(baseline[step], rel=1e-4), (step, baseline, b)
    if layout.get("tensor_model_parallel_size") == 2:
        # A CPU run at TP=2 shows no third-party warning (megatron's CUDA_DEVICE_MAX_CONNECTIONS advice), bar
        # or stray blank line: `trinity run`'s console as the user sees it (the conversion is the session's)
        leaks = noise((tmp / "job.out").read_text())
        assert not leaks, "\n".join(leaks)
        # torchrun keeps every rank's output under <output_dir>/logs/<run>/attempt_0/<local rank>/.
        logs = tmp / "run" / "logs"
        for name in ("stdout.log", "stderr.log"):
            found = sorted(logs.glob(f"**/{name}"))
            assert [p.parent.name for p in found] == ["0", "1"], found
        for rank, out in enumerate(sorted(logs.glob("**/stdout.log"))):
            text = out.read_text()
            if rank == 0:
                assert "step 4/4 | loss" in text and "run summary: " in text, text[-2000:]
            else:
                assert "step 4/4" not in text  # rank 1 trains, rank 0 reports


@pytest.mark.slow
@pytest.mark.parametrize(
    "recompute",
    [
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        {"recompute_granularity": "selective"},
    ],
    ids=["full", "selective"],
)
def test_recompute_gives_the_same_losses(assets, baseline, tmp_path_factory, recompute):
    tmp = tmp_path_factory.mktemp("recompute")
    cfg = job(assets, tmp / "run", trainer={"total_steps": 4}, megatron={"override_transformer_config": recompute})
    assert run_job(cfg, tmp / "job.yaml", reuse_conversion=True) == 0
    b = losses(tmp / "run")
    assert sorted(b) == [1, 2, 3, 4]
    for step in b:
        assert b[step] == pytest.approx(baseline[step], rel=1e-5), step


@pytest.mark.slow
def test_dist_checkpoint_weights_give_the_baseline_loss_and_the_bar_on_a_terminal(assets, baseline_run, baseline, tmp_path):
    """Weights from `trinity convert hf-to-mcore` (use_dist_checkpointing) instead of the run's own
    conversion: the same first loss. Run from a terminal, rank 0's streamed output shows the progress
    bar while the step lines and metrics.jsonl stay as in a redirected run."""
    from trinity.convert.api import hf_to_mcore

    ckpt = tmp_path / "mcore"
    hf_to_mcore(str(assets["model"]), str(ckpt), dtype="fp32")
    cfg = job(assets, tmp_path / "run", trainer={"total_steps": 3, "log_interval": 5},
              megatron={"use_dist_checkpointing": True, "dist_checkpointing_path": str(ckpt)})
    code, text = run_job_on_a_terminal(cfg, tmp_path / "job.yaml")
    assert code == 0, text[-3000:]
    assert "converting" not in text and not (tmp_path / "run" / "mcore_cache").exists()
    b = losses(tmp_path / "run")
    assert sorted(b) == [1, 2, 3]
    assert b[1] == pytest.approx(baseline[1], rel=1e-5), (b, baseline)
    # What the terminal shows: the lines of the first and the last step (log_interval 5), rank 0's bar
    # (rich's, through trinity.launch.single's relay) stopped at 3/3 with its rate, then the summary.
    from tests.unit.test_run_output import screen

    rows = screen(text.encode(), width=120)
    assert [r.split(" | ")[:2] for r in rows if r.startswith("[default0]:step ")] == [
        ["[default0]:step 1/3", f"loss {b[1]:.4f}"], ["[default0]:step 3/3", f"loss {b[3]:.4f}"]], rows
    bars = [r for r in rows if "━" in r]
    assert len(bars) == 1 and re.fullmatch(rf"\[default0\]:train ━+ 3/3 [0-9.]+ (s/step|steps/s) eta 0:00:00 loss {b[3]:.4f}", bars[0]), rows
    assert "2/3" in text and "\x1b[" in text  # the bar was drawn at step 2 too
    assert f"[default0]:run summary: {tmp_path / 'run'}" in rows
    # metrics.jsonl as in the redirected baseline run: one object per step with the same keys.
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    keys = sorted(json.loads((baseline_run / "metrics.jsonl").read_text().splitlines()[0]))
    assert [r["step"] for r in rows] == [1, 2, 3] and all(sorted(r) == keys for r in rows)


@pytest.mark.slow
def test_mbridge_weights_give_the_baseline_loss(assets, baseline, tmp_path):
    """use_mbridge: the HF checkpoint loads through mbridge in the workers (no conversion first)."""
    cfg = job(assets, tmp_path / "run", trainer={"total_steps": 2}, megatron={"use_mbridge": True})
    assert run_job(cfg, tmp_path / "job.yaml") == 0
    text = (tmp_path / "job.out").read_text()
    assert "converting" not in text and not (tmp_path / "run" / "mcore_cache").exists()
    b = losses(tmp_path / "run")
    assert sorted(b) == [1, 2]
    assert b[1] == pytest.approx(baseline[1], rel=1e-5), (b, baseline)


def test_nonfinite_loss_skips_then_stops_before_saving_or_exporting(assets, tmp_path):
    """A learning rate of 1e30 (finite, so validation lets it through) blows the weights up at step 1: from
    step 2 on the loss is not finite. trainer.skip_nonfinite_steps: 1 skips step 2's update (its checkpoint
    holds step 1's weights), step 3 stops the run with the line naming the step and the phase; no later
    checkpoint, no HF export."""
    out = tmp_path / "run"
    cfg = job(assets, out, trainer={"total_steps": 4, "save_interval": 1, "export_hf": True, "skip_nonfinite_steps": 1},
              optim={"lr": 1e30, "lr_warmup_steps": 0})
    assert run_job(cfg, tmp_path / "job.yaml", reuse_conversion=True) == 2
    text = (tmp_path / "job.out").read_text()
    found = re.search(r"error \(rank 0\): step 3, update_actor: the (loss|gradient norm) is (nan|inf) after 1 skipped "
                      r"steps \(trainer.skip_nonfinite_steps = 1\); nothing was saved past step 2. Lower "
                      r"actor_rollout_ref.actor.optim.lr, check this step's data, or raise trainer.skip_nonfinite_steps", text)
    assert found, text[-3000:]
    assert re.search(r"step 2, update_actor: the (loss|gradient norm) is (nan|inf); the update was skipped \(1 of "
                     r"trainer.skip_nonfinite_steps = 1 steps\)", text), text[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped_nonfinite_steps"]) for r in rows] == [(1, 0), (2, 1)]
    assert math.isfinite(rows[0]["loss"]) and not math.isfinite(rows[1]["loss"] * rows[1]["grad_norm"])
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved == ["step_1", "step_2"] and not (out / "hf").exists()


def test_malformed_data_line_is_a_clean_error(assets, tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = assets["data"].read_text().splitlines()[:40]
    lines[17] = '{"prompt": "1+1=", "response": '
    bad.write_text("\n".join(lines) + "\n")
    cfg = job(assets, tmp_path / "run", data={"train_files": [str(bad)]}, trainer={"total_steps": 2, "global_batch_size": 2})
    assert run_job(cfg, tmp_path / "job.yaml", reuse_conversion=True) != 0
    text = (tmp_path / "job.out").read_text()
    assert f"{bad}:18" in text, text[-2000:]
    assert "error (rank 0)" in text
    assert "Traceback" not in text and "ChildFailedError" not in text, text[-3000:]
    # one process: no torchrun (trinity.launch.single), whose "rank 0 on <host> failed first" would repeat it
    assert "torchrun" not in text.split("command: ", 1)[1] and "job failed with exit code 2" in text, text[-3000:]


def test_missing_model_path_is_a_clean_error(assets, tmp_path):
    cfg = job(assets, tmp_path / "run", model={"path": str(tmp_path / "nope")})
    assert run_job(cfg, tmp_path / "job.yaml") != 0
    text = (tmp_path / "job.out").read_text()
    assert "model.path" in text and str(tmp_path / "nope") in text
    assert not (tmp_path / "run" / "logs").exists()  # refused before any process started


def test_port_in_use_is_a_clean_error(assets, tmp_path):
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = job(assets, tmp_path / "run", cluster={"nnodes": 2, "node_rank": 0, "master_port": port})
        assert run_job(cfg, tmp_path / "job.yaml") != 0
    text = (tmp_path / "job.out").read_text()
    assert "cluster.master_port" in text and str(port) in text



@pytest.mark.slow
@pytest.mark.multiproc
def test_optimizer_offload_at_dp2_gives_the_same_losses(assets, baseline, tmp_path):
    """optimizer_offload (the optimizer in host memory, stepped there) at DP=2 under the distributed
    optimizer (each rank steps its shard on the host, then the all-gather): the uninterrupted run's
    losses. (Save and resume of the host optimizer: tests/unit/test_offload.py.)"""
    out = tmp_path / "run"
    cfg = job(assets, out, trainer={"total_steps": 3}, cluster={"nproc_per_node": 2},
              megatron={"optimizer_offload": True, "use_distributed_optimizer": True})
    assert run_job(cfg, tmp_path / "job.yaml", reuse_conversion=True) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["host_optimizer_s"] > 0 for r in rows)
    for r in rows:
        assert r["loss"] == pytest.approx(baseline[r["step"]], rel=1e-4), (r, baseline)
