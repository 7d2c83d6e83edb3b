"""The seed documents' own text, as users paste it: Trinity-RFT's Megatron guide, verl's Megatron backend
doc and ROLL's Megatron strategy doc (verbatim copies in tests/fixtures/seeds/, sources in its README).

Each snippet goes through `trinity validate` (commands.validate, --json) on a job that supplies what the
snippet leaves out (model, data, cluster: see `_base`). It passes, or the only problems are the named
limits of this machine (no TransformerEngine / grouped_gemm here for `moe_grouped_gemm`); with those
installed, as in the Docker image, it passes. The ROLL keys are also followed into megatron-core's own
TransformerConfig and DDP config.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shlex
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import FIXTURES, HF_CONFIGS, REPO
from trinity.cli import commands

SEEDS = FIXTURES / "seeds"
GROUPED_GEMM_LIMIT = (".moe_grouped_gemm: needs the grouped_gemm package or TransformerEngine, neither is "
                      "installed; set it to false or use the Docker image (scripts/docker_for_megatron)")
HAVE_GROUPED_GEMM = any(importlib.util.find_spec(m) for m in ("grouped_gemm", "transformer_engine"))


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _base(algorithm: str, model: str = "qwen2_5_7b", nnodes: int = 1) -> dict:
    """What a seed snippet leaves out: the model (config.json fixtures, no weights), data, cluster."""
    rl = algorithm != "sft"
    job = {
        "algorithm": {"name": algorithm},
        "model": {"path": str(HF_CONFIGS / model)},
        "data": {"train_files": [str(FIXTURES / "data" / ("prompts.jsonl" if rl else "sft.jsonl"))]},
        "cluster": {"device": "cuda", "nnodes": nnodes, "nproc_per_node": 8},
        "trainer": {"total_steps": 5},
    }
    if rl:  # KL loss: the ref role exists, so the seeds' ref blocks are used
        job["actor_rollout_ref"] = {"actor": {"use_kl_loss": True, "ppo_mini_batch_size": 8}, "rollout": {"n": 4}}
    return job


def _validate(job: dict, tmp_path: Path, overrides: list[str] = ()) -> tuple[int, dict]:
    """`trinity validate --json` on the job: (exit code, the JSON answer)."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = commands.validate(path, list(overrides), json_out=True)
    return code, json.loads(out.getvalue())


def _override_lines(name: str) -> list[str]:
    """verl's shell lines (`key=value \\`, `# comments`) as dotted overrides."""
    lines = []
    for line in (SEEDS / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip().rstrip("\\").strip()
        if line:
            lines.append(line)
    return lines


def _with_te(monkeypatch) -> None:
    """As inside the Docker image: TransformerEngine importable."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "transformer_engine" else real(n, *a))


# --- Trinity-RFT's Megatron guide ------------------------------------------------------------------


def _trinity_rft_block() -> dict:
    # The guide elides the rest of each section with a line `...`; everything else is taken as written.
    text = "\n".join(line for line in (SEEDS / "trinity_rft_megatron.yaml").read_text().splitlines()
                     if line.strip() != "...")
    return yaml.safe_load(text)


def test_trinity_rft_actor_ref_critic_block_validates(tmp_path):
    code, answer = _validate(_merge(_base("ppo"), _trinity_rft_block()), tmp_path)
    assert code == 0, answer
    from trinity.config.loader import load_config

    cfg = load_config(tmp_path / "job.yaml").config
    assert cfg.actor_rollout_ref.actor.strategy == "megatron" and cfg.critic.strategy == "megatron"
    for m in cfg.roles().values():  # actor, ref and critic, each as the guide sets it
        assert m.tensor_model_parallel_size == 2
        assert m.override_transformer_config.recompute_kwargs() == {
            "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    assert set(cfg.roles()) == {"actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"}


def test_trinity_rft_block_without_kl_refuses_the_ref_block_it_cannot_use(tmp_path):
    """Without KL a PPO job has no ref role: the guide's ref block would be read by nothing, so each key it
    sets (at a value other than the default) is refused with the reason, and nothing else is reported."""
    job = _merge(_base("ppo"), _trinity_rft_block())
    job["actor_rollout_ref"]["actor"]["use_kl_loss"] = False
    code, answer = _validate(job, tmp_path)
    why = ("no KL is used: actor_rollout_ref.actor.use_kl_loss and algorithm.use_kl_in_reward are false, set one "
           "to use a ref")
    assert code == 2 and answer["problems"] == [
        f"actor_rollout_ref.ref.megatron.{key}: the ref role does not exist in this job ({why}); remove the key"
        for key in ("override_transformer_config", "tensor_model_parallel_size")], answer
    del job["actor_rollout_ref"]["ref"]
    code, answer = _validate(job, tmp_path)
    assert code == 0, answer
    assert [r["path"] for r in answer["roles"]] == ["actor_rollout_ref.actor", "critic"], answer["roles"]


@pytest.mark.parametrize("where", ["actor", "critic"])
def test_strategy_other_than_megatron_is_refused(tmp_path, where):
    block = _trinity_rft_block()
    (block["actor_rollout_ref"]["actor"] if where == "actor" else block["critic"])["strategy"] = "fsdp"
    code, answer = _validate(_merge(_base("ppo"), block), tmp_path)
    path = "actor_rollout_ref.actor" if where == "actor" else "critic"
    assert code == 2 and answer["problems"] == [
        f"{path}.strategy: 'fsdp' is not available: this toolkit trains with megatron-core only; "
        "set it to megatron or remove the key"]


def test_trinity_rft_install_line_names_an_existing_extra():
    line = (SEEDS / "trinity_rft_commands.sh").read_text().splitlines()[0]
    words = shlex.split(line)
    assert words[:3] == ["pip", "install", "-e"]
    extra = re.fullmatch(r"\.\[(\w+)\]", words[3]).group(1)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extra == "megatron" and extras[extra], extras


def test_trinity_rft_docker_run_line_opens_a_shell_in_workspace():
    """The guide's `docker run -it ... -v $PWD:/workspace ... IMAGE` with our image: no command after
    the image, so Docker runs ENTRYPOINT + CMD = NVIDIA's entrypoint + bash, in WORKDIR /workspace."""
    from tests.unit.test_docker_files import NVIDIA_ENTRYPOINT, _after_image, _docker_run_commands, _instructions

    text = (SEEDS / "trinity_rft_commands.sh").read_text()
    (words,) = _docker_run_commands(f"```bash\n{text}```")
    image, command = _after_image(words)
    assert image == "trinity-rft-megatron:latest" and command == []
    assert "-it" in words and "$PWD:/workspace" in words
    ins = _instructions()
    entry = json.loads([r for n, r in ins if n == "ENTRYPOINT"][-1])
    cmd = json.loads([r for n, r in ins if n == "CMD"][-1])
    assert entry + (command or cmd) == [NVIDIA_ENTRYPOINT, "/bin/bash"]
    assert [r for n, r in ins if n == "WORKDIR"][-1] == "/workspace"


# --- verl's Megatron backend doc ---------------------------------------------------------------------


def test_verl_offload_lines_validate_for_rl(tmp_path):
    overrides = _override_lines("verl_offload_actor_ref.txt") + _override_lines("verl_offload_critic.txt")
    assert len(overrides) == 7
    code, answer = _validate(_base("ppo"), tmp_path, overrides)
    assert code == 0, answer
    from trinity.config.loader import load_config

    cfg = load_config(tmp_path / "job.yaml", overrides).config
    a, r, c = cfg.actor_rollout_ref.actor.megatron, cfg.actor_rollout_ref.ref.megatron, cfg.critic.megatron
    assert a.param_offload and a.grad_offload and a.optimizer_offload
    assert r.param_offload and not r.grad_offload
    assert c.param_offload and c.grad_offload and c.optimizer_offload


def test_verl_offload_lines_in_sft_optimizer_honoured_params_and_grads_refused(tmp_path):
    """In SFT, optimizer_offload keeps the optimizer on the host (accepted); param_offload and grad_offload
    cannot lower a single-phase step's memory and are refused with the reason (and the ref's flag: SFT
    has no ref)."""
    code, answer = _validate(_base("sft"), tmp_path, _override_lines("verl_offload_actor_ref.txt"))
    assert code == 2
    refused = [m.group(1) for p in answer["problems"]
               if (m := re.search(r"actor_rollout_ref\.actor\.megatron\.(\w+): cannot lower the GPU memory of a sft step", p))]
    assert refused == ["param_offload", "grad_offload"], answer
    assert not any(p.startswith("actor_rollout_ref.actor.megatron.optimizer_offload") for p in answer["problems"]), answer
    assert any("actor_rollout_ref.ref.megatron.param_offload: the ref role does not exist" in p
               for p in answer["problems"]), answer
    # the actor's optimizer line alone validates
    code, answer = _validate(_base("sft"), tmp_path, ["actor_rollout_ref.actor.megatron.optimizer_offload=True"])
    assert code == 0, answer
    code, answer = _validate(_base("sft"), tmp_path, ["actor_rollout_ref.actor.megatron.optimizer_offload=True",
                                                      "model.dtype=fp16"])
    assert code == 2 and any(p.startswith("actor_rollout_ref.actor.megatron.optimizer_offload: not available with "
                                          "model.dtype fp16") for p in answer["problems"]), answer


def test_verl_profiler_lines_validate_and_profile_the_first_step_on_rank_0(tmp_path):
    overrides = _override_lines("verl_profiler.txt")
    code, answer = _validate(_base("grpo"), tmp_path, overrides)
    assert code == 0, answer
    from trinity.config.loader import load_config
    from trinity.trainer.profiling import StepProfiler

    cfg = load_config(tmp_path / "job.yaml", overrides).config
    assert cfg.actor_rollout_ref.actor.profile.save_path == "./profile"
    rank0 = StepProfiler.from_config(cfg, tmp_path / "out", 0, torch.device("cpu"))
    assert rank0.steps == {1} and rank0.folder == Path("./profile")  # verl's step 0 is trinity's step 1
    assert StepProfiler.from_config(cfg, tmp_path / "out", 3, torch.device("cpu")).steps == frozenset()


def test_verl_profiler_range_past_the_last_step_is_refused(tmp_path):
    overrides = _override_lines("verl_profiler.txt")[:-2] + ["actor_rollout_ref.actor.profile.step_end=9"]
    code, answer = _validate(_base("grpo"), tmp_path, overrides)
    assert code == 2 and any(p.endswith(
        "actor_rollout_ref.actor.profile.step_end: 9 is past the last step (trainer.total_steps = 5, steps 0 to 4 "
        "counted from 0); lower it") for p in answer["problems"]), answer


# --- ROLL's Megatron strategy doc ----------------------------------------------------------------------


def _roll(name: str, role: str) -> dict:
    return yaml.safe_load((SEEDS / name).read_text())[role]["strategy_args"]["strategy_config"]


def _expect_pass_or_grouped_gemm_limit(code: int, answer: dict, roles: list[str]) -> None:
    if HAVE_GROUPED_GEMM:
        assert code == 0, answer
    else:
        assert code == 2 and answer["problems"] == [f"{r}.megatron{GROUPED_GEMM_LIMIT}" for r in roles], answer


def _roll_train_job() -> dict:
    """ROLL's actor_train on 32 GPUs (device_mapping range(0, 32)) as an SFT job: strategy_config is the
    megatron block; per_device_train_batch_size 1 x gradient_accumulation_steps 32 x DP 8 = 256 rows."""
    job = _base("sft", model="qwen3_30b_a3b", nnodes=4)
    job["trainer"].update(global_batch_size=256, micro_batch_size=1)
    job["actor_rollout_ref"] = {"actor": {"megatron": _roll("roll_megatron_train.yaml", "actor_train")}}
    return job


def test_roll_train_strategy_config_validates(tmp_path, monkeypatch):
    code, answer = _validate(_roll_train_job(), tmp_path)
    _expect_pass_or_grouped_gemm_limit(code, answer, ["actor_rollout_ref.actor"])
    _with_te(monkeypatch)
    code, answer = _validate(_roll_train_job(), tmp_path)
    assert code == 0, answer
    (role,) = answer["roles"]
    assert role["layout"] == "TP=2 PP=2 VPP=8 CP=1 EP=4 ETP=2 DP=8" and role["microbatches"] == 32, role


def test_roll_reference_strategy_config_validates_as_the_ref_role(tmp_path, monkeypatch):
    """ROLL's megatron_infer block for the reference; roles share one layout here, so the actor takes
    the same block."""
    block = _roll("roll_megatron_infer.yaml", "reference")
    job = _base("grpo", model="qwen3_30b_a3b", nnodes=4)
    job["data"]["train_batch_size"] = 32
    job["actor_rollout_ref"]["actor"].update(megatron=block, ppo_mini_batch_size=32)
    job["actor_rollout_ref"]["ref"] = {"megatron": block}
    code, answer = _validate(job, tmp_path)
    _expect_pass_or_grouped_gemm_limit(code, answer, ["actor_rollout_ref.actor", "actor_rollout_ref.ref"])
    _with_te(monkeypatch)
    code, answer = _validate(job, tmp_path)
    assert code == 0, answer
    assert [r["layout"] for r in answer["roles"]] == ["TP=1 PP=1 CP=1 EP=4 ETP=1 DP=32"] * 2, answer["roles"]


def test_roll_moe_keys_reach_megatron_transformer_config():
    """moe_layer_recompute, moe_grouped_gemm and moe_token_dispatcher_type as ROLL sets them end up in
    megatron-core's TransformerConfig (built by trinity.models.build, as the workers do)."""
    from trinity.config.megatron import MegatronConfig
    from trinity.compat import quiet
    from trinity.models.build import transformer_config
    from trinity.models.facts import ModelFacts

    facts = ModelFacts.from_hf_dir(HF_CONFIGS / "qwen3_30b_a3b")
    m = MegatronConfig(**_roll("roll_megatron_train.yaml", "actor_train"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # megatron-core's deprecation of the flag must not reach the user
        with quiet.hidden():
            tc = transformer_config(facts, m, device="cpu", dtype=torch.float32)
    assert (tc.moe_grouped_gemm, tc.moe_token_dispatcher_type) == (True, "alltoall")
    # megatron-core turns moe_layer_recompute into selective recompute of the MoE layers
    assert tc.moe_layer_recompute and tc.recompute_granularity == "selective" and "moe" in tc.recompute_modules
    assert (tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size, tc.virtual_pipeline_model_parallel_size,
            tc.expert_model_parallel_size, tc.sequence_parallel) == (2, 2, 8, 4, True)
    other = transformer_config(facts, m.model_copy(update={"moe_token_dispatcher_type": "allgather",
                                                           "moe_grouped_gemm": False, "moe_layer_recompute": False}),
                               device="cpu", dtype=torch.float32)
    assert (other.moe_token_dispatcher_type, other.moe_grouped_gemm, other.moe_layer_recompute) == ("allgather", False, False)
    assert other.recompute_granularity is None


def test_moe_layer_recompute_with_full_recompute_is_refused_at_validate(tmp_path):
    job = _roll_train_job()
    job["actor_rollout_ref"]["actor"]["megatron"]["override_transformer_config"] = {
        "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    _, answer = _validate(job, tmp_path)
    assert ("actor_rollout_ref.actor.megatron.moe_layer_recompute: megatron-core refuses it with "
            "override_transformer_config.recompute_granularity: full, which already recomputes whole layers; "
            "remove one of the two") in answer["problems"], answer


def test_moe_keys_on_a_dense_model_are_refused_not_ignored(tmp_path):
    job = _base("sft")
    job["actor_rollout_ref"] = {"actor": {"megatron": {"moe_layer_recompute": True, "moe_grouped_gemm": True}}}
    code, answer = _validate(job, tmp_path)
    assert code == 2 and answer["problems"] == [
        f"actor_rollout_ref.actor.megatron.{k}: has no effect on the dense Qwen2ForCausalLM (it has no MoE layers); "
        "remove it" for k in ("moe_grouped_gemm", "moe_layer_recompute")], answer


@pytest.mark.skipif(HAVE_GROUPED_GEMM, reason="grouped_gemm or TransformerEngine is installed here")
def test_moe_grouped_gemm_without_te_is_refused_at_validate_not_a_crash(tmp_path):
    job = _roll_train_job()
    code, answer = _validate(job, tmp_path)
    assert code == 2 and answer["problems"] == [f"actor_rollout_ref.actor.megatron{GROUPED_GEMM_LIMIT}"]


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_grad_reduce_reaches_megatron_ddp(tiny_qwen2_tp1, overlap):
    """ROLL's overlap_grad_reduce becomes megatron-core DDP's overlap_grad_reduce (its bucketed
    reduction during backward), and the schedule gets DDP's no_sync to defer it between micro batches."""
    from trinity.config.megatron import MegatronConfig
    from trinity.config.schema import OptimConfig
    from trinity.models.build import build_model
    from trinity.trainer.engine.setup import build_train_state

    facts, _ = tiny_qwen2_tp1
    m = MegatronConfig(overlap_grad_reduce=overlap)
    chunks = build_model(facts, m, device="cpu", dtype=torch.float32)
    state = build_train_state(chunks, m, OptimConfig(lr=1e-3), dtype=torch.float32, total_steps=2)
    assert state.model[0].ddp_config.overlap_grad_reduce is overlap
    assert (state.config.no_sync_func == state.model[0].no_sync) is overlap
