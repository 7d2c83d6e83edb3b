"""Every recipe and layout on 2 and 4 GPUs through `trinity run` (torchrun, NCCL, bf16), as a user runs them.

Two GPUs: every algorithm at DP=2 (GRPO with parameter, gradient and optimizer offload), GRPO and PPO at
TP=2 and PP=2, LoRA SFT and LoRA GRPO at DP=2, and a DP=2 GRPO job killed after a checkpoint that resumes
to the uninterrupted run's metrics. Four GPUs: SFT and GRPO at TP=2 x DP=2 and PP=2 (VPP=2) x DP=2, a
Qwen3-MoE at TP=2 x EP=2 and EP=4 (sequence parallel, distributed optimizer, alltoall dispatch), PPO at
TP=2 x DP=2, two "nodes" of two GPUs (the rendezvous scripts/slurm uses) and the 4-GPU example configs.

SFT, PT and DPO losses equal the one-GPU job's within bf16 tolerance; RL runs every phase, its reward rises,
its rollout log-probs match the training forward, and data-parallel ranks answer the same prompt
differently. Each case skips itself with too few GPUs.

Run on a 2- or 4-GPU machine: `python -m pytest tests/gpu/test_scale_gpu.py -q -s`. On 4 GPUs the 2-GPU
cases can run as two lanes (`TRINITY_GPU_LANES="0,1;2,3" python -m pytest -n 2 ...`, tests/gpu/conftest.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, trinity_run_argv
from tests.gpu.jobs import (
    assert_losses_match, check_ranks_differ, check_rl, losses, make_assets, metrics, note, rl_job, run_job,
    supervised_job,
)

torch = pytest.importorskip("torch")
GPUS = torch.cuda.device_count()
pytestmark = [pytest.mark.gpu, pytest.mark.multiproc, pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")]
four = pytest.mark.skipif(GPUS < 4, reason="needs 4 CUDA GPUs")

SP_DISTOPT = {"sequence_parallel": True, "use_distributed_optimizer": True, "overlap_grad_reduce": True}
OFFLOAD = {"param_offload": True, "grad_offload": True, "optimizer_offload": True}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    return make_assets(tmp_path_factory.mktemp("scale"))


# --- two GPUs ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["sft", "pt", "dpo"])
def test_supervised_dp2_matches_one_gpu(assets, tmp_path, algo):
    one = run_job(supervised_job(assets, algo, tmp_path / "one", 1, {}), tmp_path / "one.yaml")
    two = run_job(supervised_job(assets, algo, tmp_path / "two", 2, {"use_distributed_optimizer": True}),
                  tmp_path / "two.yaml")
    assert_losses_match(losses(two), losses(one), f"{algo} DP=2")
    assert losses(two)[-1] < losses(two)[0]


@pytest.mark.parametrize("algo", ["grpo", "ppo", "rloo", "reinforce_plus_plus", "gspo", "dapo", "cispo"])
def test_rl_dp2(assets, tmp_path, algo):
    """DP=2 (GRPO also with every offload): the update all-reduces its metrics and denominators over the
    data-parallel group, which NCCL takes only as GPU tensors."""
    out = tmp_path / algo
    rows = run_job(rl_job(assets, algo, out, 2, OFFLOAD if algo == "grpo" else {}), tmp_path / f"{algo}.yaml")
    check_rl(rows, algo, dp=2)
    check_ranks_differ(out, dp=2)
    if algo == "dapo":
        assert all(r["dapo/kept_groups"] + r["dapo/filled_groups"] == 16 for r in rows)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
@pytest.mark.parametrize("layout", [{"tensor_model_parallel_size": 2}, {"pipeline_model_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_rl_model_parallel(assets, tmp_path, algo, layout):
    rows = run_job(rl_job(assets, algo, tmp_path / "run", 2, layout), tmp_path / "job.yaml")
    check_rl(rows, algo)


def test_lora_sft_and_grpo_dp2(assets, tmp_path):
    lora = {"lora": {"rank": 8, "alpha": 16, "target_modules": ["all-linear"]}}
    cfg = supervised_job(assets, "sft", tmp_path / "sft", 2, {})
    cfg["actor_rollout_ref"]["actor"].update(lora)
    cfg["actor_rollout_ref"]["actor"]["optim"]["lr"] = 1e-2
    sft = losses(run_job(cfg, tmp_path / "sft.yaml"))
    note(f"  LoRA SFT DP=2: {[round(x, 4) for x in sft]}")
    assert sft[-1] < 0.9 * sft[0]
    cfg = rl_job(assets, "grpo", tmp_path / "grpo", 2)
    cfg["actor_rollout_ref"]["actor"].update(lora)
    cfg["actor_rollout_ref"]["actor"]["optim"]["lr"] = 1e-2
    rows = run_job(cfg, tmp_path / "grpo.yaml")
    check_rl(rows, "grpo", dp=2)
    check_ranks_differ(tmp_path / "grpo", dp=2)


def _kill_after_checkpoint(cfg: dict, path: Path, step: int, timeout: float = 300) -> None:
    """Start the job and kill -9 its whole process group once checkpoint `step` is complete."""
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    proc = subprocess.Popen(trinity_run_argv(path), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)
    done = Path(cfg["trainer"]["output_dir"]) / "checkpoints" / f"step_{step}" / "complete"
    deadline = time.monotonic() + timeout
    try:
        while not done.is_file():
            assert proc.poll() is None, f"the job ended (code {proc.returncode}) before checkpoint {step}"
            assert time.monotonic() < deadline, f"no checkpoint {step} in {timeout} s"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_grpo_dp2_killed_after_a_checkpoint_resumes_to_the_uninterrupted_metrics(assets, tmp_path):
    def job(out: Path) -> dict:
        return rl_job(assets, "grpo", out, 2, OFFLOAD, steps=4, trainer={"save_interval": 2, "keep_last": 2})

    whole = {r["step"]: r for r in run_job(job(tmp_path / "whole"), tmp_path / "whole.yaml")}
    cfg = job(tmp_path / "killed")
    _kill_after_checkpoint(cfg, tmp_path / "killed.yaml", 2)
    rows = {r["step"]: r for r in run_job(cfg, tmp_path / "killed.yaml")}  # same command: resumes at step 2
    assert {3, 4} <= set(rows), sorted(rows)
    for step in (3, 4):
        a, b = whole[step], rows[step]
        note(f"  resume step {step}: " + str({k: (round(a[k], 5), round(b[k], 5)) for k in ("reward/mean", "actor/pg_loss", "actor/grad_norm")}))
        # step 3 samples with the checkpoint's weights and RNG streams: the same answers and rewards; the
        # update's bf16 backward (atomics in attention) may differ in the last bits from there on
        assert b["reward/mean"] == pytest.approx(a["reward/mean"], abs=1e-6 if step == 3 else 0.05), step
        assert b["response_length/mean"] == pytest.approx(a["response_length/mean"], abs=1e-6 if step == 3 else 0.5)
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=0.05), step


# --- four GPUs -----------------------------------------------------------------------------------------------

LAYOUTS_4 = {
    "tp2_dp2": {"tensor_model_parallel_size": 2, **SP_DISTOPT},
    "pp2_vpp2_dp2": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2,
                     "use_distributed_optimizer": True},
}


@pytest.fixture(scope="module")
def one_gpu_sft(assets, tmp_path_factory):
    """The one-GPU SFT losses of the dense and the MoE model, each run once for the module's 4-GPU cases."""
    runs: dict[str, list[float]] = {}

    def losses_of(model: str) -> list[float]:
        if model not in runs:
            tmp = tmp_path_factory.mktemp(f"one_{model}")
            megatron = {"moe_token_dispatcher_type": "alltoall"} if model == "moe" else {}
            runs[model] = losses(run_job(supervised_job(assets, "sft", tmp / "run", 1, megatron, model=model),
                                         tmp / "job.yaml"))
        return runs[model]

    return losses_of


@four
@pytest.mark.parametrize("layout", sorted(LAYOUTS_4))
def test_sft_and_grpo_on_four_gpus(assets, one_gpu_sft, tmp_path, layout):
    four_ = run_job(supervised_job(assets, "sft", tmp_path / "four", 4, LAYOUTS_4[layout]), tmp_path / "four.yaml")
    assert_losses_match(losses(four_), one_gpu_sft("dense"), f"SFT {layout}")
    rows = run_job(rl_job(assets, "grpo", tmp_path / "grpo", 4, LAYOUTS_4[layout]), tmp_path / "grpo.yaml")
    check_rl(rows, "grpo", dp=2)
    check_ranks_differ(tmp_path / "grpo", dp=2)


MOE = {"moe_token_dispatcher_type": "alltoall", "use_distributed_optimizer": True}


@four
@pytest.mark.parametrize("layout", [{"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2,
                                     "sequence_parallel": True},
                                    {"expert_model_parallel_size": 4}], ids=["tp2_ep2", "ep4"])
def test_moe_sft_and_grpo_on_four_gpus(assets, one_gpu_sft, tmp_path, layout):
    got = run_job(supervised_job(assets, "sft", tmp_path / "four", 4, {**MOE, **layout}, model="moe"),
                  tmp_path / "four.yaml")
    assert_losses_match(losses(got), one_gpu_sft("moe"), f"MoE SFT {layout}")
    rows = run_job(rl_job(assets, "grpo", tmp_path / "grpo", 4, {**MOE, **layout}, model="moe"), tmp_path / "grpo.yaml")
    check_rl(rows, "grpo")


@four
def test_ppo_tp2_dp2(assets, tmp_path):
    rows = run_job(rl_job(assets, "ppo", tmp_path / "ppo", 4, {"tensor_model_parallel_size": 2}), tmp_path / "ppo.yaml")
    check_rl(rows, "ppo", dp=2)
    check_ranks_differ(tmp_path / "ppo", dp=2)


@four
def test_two_nodes_of_two_gpus_match_one_node(assets, tmp_path):
    """`cluster.nnodes=2` with torchrun's static rendezvous (what scripts/slurm runs on each node): two
    `trinity run` processes on one host, GPUs 0-1 and 2-3, give the losses of one node of 4 GPUs."""
    from trinity.distributed.parallel import free_port

    layout = {"tensor_model_parallel_size": 2}
    single = run_job(supervised_job(assets, "sft", tmp_path / "single", 4, layout), tmp_path / "single.yaml")
    port = free_port()
    cfg = supervised_job(assets, "sft", tmp_path / "nodes", 2, layout)
    cfg["cluster"].update(nnodes=2, master_addr="127.0.0.1", master_port=port)
    procs = []
    for node, gpus in enumerate(("0,1", "2,3")):
        path = tmp_path / f"node{node}.yaml"
        path.write_text(yaml.safe_dump({**cfg, "cluster": {**cfg["cluster"], "node_rank": node}}, sort_keys=False))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
        log = (tmp_path / f"node{node}.log").open("w")
        procs.append(subprocess.Popen(trinity_run_argv(path), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = [p.wait(timeout=420) for p in procs]
    assert codes == [0, 0], [(tmp_path / f"node{n}.log").read_text()[-3000:] for n in range(2)]
    assert_losses_match(losses(metrics(tmp_path / "nodes")), losses(single), "two nodes of 2 GPUs vs one node of 4")


EXAMPLES_4 = ["sft_qwen2_5_1_5b_4gpu.yaml", "grpo_qwen2_5_1_5b_4gpu.yaml", "ppo_qwen2_5_1_5b_4gpu.yaml",
              "grpo_qwen3_moe_4gpu.yaml"]


@four
@pytest.mark.parametrize("name", EXAMPLES_4)
def test_four_gpu_example_config_runs_as_written(assets, tmp_path, name):
    """configs/<name> with only the model, the data, the output folder and the step count changed: the
    8- and 32-GPU examples' algorithm and options, scaled to 4 GPUs (a tiny model of the same family)."""
    cfg = yaml.safe_load((REPO / "configs" / name).read_text())
    algo = cfg["algorithm"]["name"]
    cfg["model"]["path"] = str(assets["moe" if "moe" in name else "dense"])
    rl = algo != "sft"
    cfg["data"]["train_files"] = [str(assets["same_prompt" if rl else "sft"])]
    if rl:
        cfg["data"].update(max_prompt_length=64)
        cfg["actor_rollout_ref"]["rollout"]["response_length"] = 8
        cfg["reward"] = {"function": "trinity.rewards.arithmetic_reward:digit_fraction"}
    else:
        cfg["data"]["seq_length"] = 256
    cfg["trainer"].update(output_dir=str(tmp_path / "run"), total_steps=3, save_interval=3, log_interval=1,
                          tensorboard=False, export_hf=False)
    cfg["trainer"].pop("total_epochs", None)
    rows = run_job(cfg, tmp_path / name)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(v == v for r in rows for v in r.values() if isinstance(v, float))
    assert (tmp_path / "run" / "checkpoints" / "step_3" / "complete").is_file()
