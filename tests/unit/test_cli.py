"""The CLI: instant help without heavy imports, exit codes, overrides, plan output, examples."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, HF_CONFIGS, REPO
from trinity.cli import commands
from trinity.config.schema import JobConfig
from trinity.launch.torchrun import launch_command, port_is_free, preflight, torchrun_command

HEAVY = ("torch", "megatron", "mbridge", "transformers")


def _trinity(*args, **kw):
    return subprocess.run([sys.executable, "-m", "trinity.cli.main", *args], capture_output=True, text=True, cwd=REPO, **kw)


@pytest.mark.parametrize("argv", [["--help"], ["validate", "--help"], ["convert", "--help"]])
def test_help_imports_nothing_heavy(argv):
    code = (
        "import sys\nfrom trinity.cli.main import app\n"
        f"try:\n    app({argv!r})\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_validate_imports_nothing_heavy(write_job, small_job):
    path = write_job(small_job)
    code = (
        "import sys\nfrom trinity.cli.main import app\n"
        f"try:\n    app(['validate', '--config', {str(path)!r}])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_what_trinity_run_checks_around_a_launch_imports_nothing_heavy(tmp_path):
    """The conversion cache's key and the complete checkpoints, which `trinity run` reads before and after
    every launch: importing torch for them cost ~2-6 s of CPU per job (py-spy, 2026-11-26)."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "checkpoints" / "step_3").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_3" / "complete").write_text("")
    (tmp_path / "checkpoints" / "step_5").mkdir()  # not complete
    code = (
        "import sys\nfrom pathlib import Path\n"
        "from trinity.convert.fingerprint import source_fingerprint\n"
        "from trinity.launch.run_folder import complete_checkpoints\n"
        "import trinity.cli.commands, trinity.cli.generate\n"
        f"root = Path({str(tmp_path)!r})\n"
        "print(len(source_fingerprint(root)), [s for s, _ in complete_checkpoints(root / 'checkpoints')])\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines() == ["16 [3]", "[]"]


def test_version_and_schema():
    from trinity import __version__

    out = _trinity("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"trinity-mcore {__version__}"
    schema = json.loads(commands.schema())
    megatron = schema["$defs"]["MegatronConfig"]["properties"]
    assert megatron["tensor_model_parallel_size"]["description"].startswith("TP:")
    assert schema["$defs"]["MegatronConfig"]["additionalProperties"] is False


def test_config_error_exit_2_clean_block(write_job, small_job):
    small_job["trainer"]["global_batch_size"] = 12
    small_job["trainer"]["bogus"] = 1
    out = _trinity("validate", "--config", str(write_job(small_job)))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.startswith("error: the config has 2 problems:")
    assert "  trainer.bogus: unknown key" in out.stderr
    assert "  trainer.global_batch_size: 12 is not divisible" in out.stderr


def test_missing_config_file_exit_2():
    out = _trinity("validate", "--config", "/nonexistent/job.yaml")
    assert out.returncode == 2 and out.stderr.strip() == "error: /nonexistent/job.yaml: config file not found"


def test_validate_json_plan(write_job, small_job, capsys):
    assert commands.validate(write_job(small_job), ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"], json_out=True) == 0
    plan = json.loads(capsys.readouterr().out)
    (role,) = plan["roles"]
    assert role["path"] == "actor_rollout_ref.actor" and role["dp"] == 4 and role["layout"].startswith("TP=2 PP=1")
    assert role["memory"]["active"] > role["memory"]["weights"] > 0


def test_internal_error_short_without_debug(capsys):
    from trinity.cli.report import run_guarded

    def boom():
        raise RuntimeError("kaput")

    assert run_guarded(boom, debug=False) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "internal error: RuntimeError: kaput (re-run with --debug for the traceback)\n"
    assert len(captured.err.splitlines()) == 1 and "Traceback" not in captured.err

    def boom_multiline():
        raise ValueError("first line\nsecond line")

    assert run_guarded(boom_multiline, debug=False) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == ["internal error: ValueError: first line second line (re-run with --debug for the traceback)"]

    with pytest.raises(RuntimeError):
        run_guarded(boom, debug=True)


EXAMPLES = {
    "grpo_qwen2_5_7b_8gpu.yaml": "qwen2_5_7b",
    "ppo_qwen2_5_7b_8gpu.yaml": "qwen2_5_7b",
    "grpo_qwen3_30b_a3b_32gpu.yaml": "qwen3_30b_a3b",
    "grpo_qwen3_moe_4gpu.yaml": "qwen3_30b_a3b",
}


GPU_EXAMPLES = sorted(p.name for p in (REPO / "configs").glob("*.yaml") if p.name != "quickstart.yaml" and "_cpu" not in p.name)


@pytest.mark.parametrize("name", GPU_EXAMPLES)
def test_gpu_example_configs_validate(name, capsys, monkeypatch):
    """GPU-scale example configs validate, with model facts from config.json fixtures (no weights),
    as they would inside the Docker image, where TransformerEngine is installed.

    The CPU examples (quickstart, *_cpu.yaml) are run for real by the integration tests."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "transformer_engine" else real(n, *a))
    fixture = EXAMPLES.get(name, "qwen2_5_7b")
    data = "prompts.jsonl" if "grpo" in name or "ppo" in name else "sft.jsonl"
    overrides = [f"model.path={HF_CONFIGS / fixture}", f"data.train_files=[{FIXTURES / 'data' / data}]"]
    assert commands.validate(REPO / "configs" / name, overrides) == 0
    assert "estimated peak per GPU" in capsys.readouterr().out


def test_configuration_reference_is_current():
    from trinity.config.reference import generate

    assert (REPO / "docs" / "configuration.md").read_text() == generate(), (
        "docs/configuration.md is stale: python -m trinity.config.reference > docs/configuration.md"
    )


def _cfg(**cluster):
    return JobConfig.model_validate({"model": {"path": "m"}, "cluster": cluster, "trainer": {"output_dir": "/o"}})


def test_torchrun_command_single_and_multi_node():
    single = torchrun_command(_cfg(device="cpu", nproc_per_node=2), "/o/r.yaml", python="py")
    assert single[:7] == ["py", "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    assert "--standalone" in single and single[-3:] == ["-m", "trinity.trainer.worker", "/o/r.yaml"]
    assert single[single.index("--log-dir") + 1] == "/o/logs"
    multi = torchrun_command(_cfg(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=1234, max_restarts=3), "c", python="py")
    for flag, value in [("--node-rank", "1"), ("--master-addr", "10.0.0.1"), ("--master-port", "1234"), ("--max-restarts", "3")]:
        assert multi[multi.index(flag) + 1] == value
    assert "--standalone" not in multi
    rdzv = torchrun_command(_cfg(nnodes=2, rdzv_endpoint="h:29400"), "c", python="py")
    assert rdzv[rdzv.index("--rdzv-endpoint") + 1] == "h:29400"


def test_a_job_of_one_process_starts_without_torchrun():
    """launch_command: one node, one process, no restarts -> trinity.launch.single; anything else torchrun."""
    one = launch_command(_cfg(device="cpu", nproc_per_node=1), "/o/r.yaml", python="py")
    assert one == ["py", "-m", "trinity.launch.single", "--log-dir", "/o/logs", "-m", "trinity.trainer.worker", "/o/r.yaml"]
    for cluster in ({"nproc_per_node": 2}, {"nproc_per_node": 1, "max_restarts": 1},
                    {"nproc_per_node": 1, "nnodes": 2, "master_addr": "10.0.0.1"}):
        cmd = launch_command(_cfg(device="cpu", **cluster), "/o/r.yaml", python="py")
        assert cmd == torchrun_command(_cfg(device="cpu", **cluster), "/o/r.yaml", python="py"), cluster


def test_preflight_refuses_cuda_without_gpu_and_taken_port():
    import socket

    import torch

    from trinity.errors import UserError

    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="cluster.device: cuda, but no GPU is visible"):
            preflight(_cfg(device="cuda"))
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not port_is_free(port)
        with pytest.raises(UserError, match=f"cluster.master_port: port {port} is in use"):
            preflight(_cfg(device="cpu", nnodes=2, master_port=port))


def test_gpu_preflight_names_the_key_for_too_many_processes_and_no_nccl():
    """The arithmetic of the GPU checks (this machine may have no GPU): more processes than visible GPUs,
    and several processes without NCCL, are refused before launch with one line naming the key."""
    from trinity.errors import UserError
    from trinity.launch.torchrun import gpu_preflight

    gpu_preflight(4, 4, 4, nccl=True)
    gpu_preflight(1, 1, 1, nccl=False)  # one process needs no collective backend
    with pytest.raises(UserError, match=r"^cluster.nproc_per_node: 4 processes need 4 GPUs, but 2 are visible .*lower it to 2$"):
        gpu_preflight(4, 4, 2, nccl=True)
    with pytest.raises(UserError, match=r"^cluster.device: cuda with 8 processes needs NCCL"):
        gpu_preflight(8, 4, 4, nccl=False)
    with pytest.raises(UserError, match="no GPU is visible"):
        gpu_preflight(1, 1, 0, nccl=True)


def test_dry_run_prints_command(write_job, small_job, capsys):
    small_job["cluster"] = {"device": "cpu", "nproc_per_node": 2}
    small_job["trainer"]["global_batch_size"] = 4
    assert commands.run(write_job(small_job), ["trainer.output_dir=/tmp/x"], dry_run=True) == 0
    out = capsys.readouterr().out
    assert "command: " in out and "--nproc-per-node 2" in out and "trinity.trainer.worker /tmp/x/resolved_config.yaml" in out
    assert not Path("/tmp/x/resolved_config.yaml").exists()


# --- help texts ------------------------------------------------------------------------------------------

HELP_ARGVS = [[], ["validate"], ["run"], ["schema"], ["tiny-assets"], ["generate"], ["convert"],
              ["convert", "hf-to-mcore"], ["convert", "mcore-to-hf"]]


def _help(*argv: str) -> str:
    """The rendered `trinity ... --help`, its panels' borders removed and whitespace collapsed."""
    from typer.testing import CliRunner

    from trinity.cli.main import app

    result = CliRunner().invoke(app, [*argv, "--help"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    return re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", result.output))


@pytest.mark.parametrize("argv", HELP_ARGVS, ids=lambda a: " ".join(a) or "trinity")
def test_help_shows_no_type_for_flags(argv):
    text = _help(*argv)
    assert "<bool>" not in text and "--help Show this message and exit." in text, text
    if argv == ["run"]:
        assert "--dry-run Print the plan and the launch command, start nothing." in text, text
    if "--debug" in text:  # every command that has it says what it shows besides tracebacks
        assert "--debug Show tracebacks of internal errors, and the third-party warnings and progress bars " \
               "hidden otherwise (trinity/compat/quiet.py)." in text, text


def test_top_level_help_lists_every_algorithm_from_the_config():
    from trinity.config.schema import AlgorithmName

    text = _help()
    names = ", ".join(a.value for a in AlgorithmName)
    assert f"Algorithms (algorithm.name): {names}; policy losses of any RL algorithm " \
           "(actor_rollout_ref.actor.policy_loss.loss_mode): gspo." in text, text
    for name in ("sft", "pt", "dpo", "grpo", "ppo", "rloo", "reinforce_plus_plus", "gspo", "dapo"):
        assert re.search(rf"[ :,]{name}[,;.]", text), name


def test_run_help_names_both_launch_paths_as_launch_command_takes_them():
    text = _help("run")
    found = re.search(r"A job of one process \((.*?)\) runs as one child process, without torchrun; any other job "
                      r"starts its processes on this node with torchrun\.", text)
    assert found, text
    assert "the console shows rank 0's output, prefixed [default0]:, and every rank's log is kept under " \
           "<output_dir>/logs." in text
    # Each condition the help names is one launch_command checks: the job of one process runs
    # trinity.launch.single, and breaking any one condition gives torchrun.
    conditions = dict(re.fullmatch(r"(?:no )?cluster\.(\w+)(?: (\w+))?", c.strip()).groups() for c in found.group(1).split(","))
    assert conditions == {"nnodes": "1", "nproc_per_node": "1", "max_restarts": "0", "rdzv_endpoint": None}
    assert "trinity.launch.single" in launch_command(_cfg(device="cpu"), "/o/r.yaml")
    broken = {"nnodes": {"nnodes": 2, "master_addr": "10.0.0.1"}, "nproc_per_node": {"nproc_per_node": 2},
              "max_restarts": {"max_restarts": 1}, "rdzv_endpoint": {"rdzv_endpoint": "h:29400"}}
    for key in conditions:
        cmd = launch_command(_cfg(device="cpu", **broken[key]), "/o/r.yaml")
        assert "torch.distributed.run" in cmd and "trinity.launch.single" not in cmd, key
