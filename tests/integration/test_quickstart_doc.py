"""Runs every command of docs/quickstart.md, in order, in a temporary copy of configs/.

Each ```bash block runs as one `bash -euo pipefail` script (so heredocs work and a failing line fails
the block). Skipped: `pip install` lines (the test environment is installed already) and the test
suite itself (`python -m pytest`, which would run this test again); the test asserts the doc has both.
The SFT run must print a last loss well below its first, and the GRPO run's mean reward over its last
10 steps must exceed the first 10 steps' by REWARD_GAIN (measured on torch 2.13.0+cpu, 2 cores:
0.425 -> 0.466; with trainer.seed=7, standing in for another machine's float rounding, 0.443 -> 0.459;
docs/rl.md and docs/quickstart.md state the numbers). A run that stops ending its answers drops to a
reward near 0 and fails by a wide margin.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "quickstart.md"
BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
SKIPPED = ("pip install", "python -m pytest")
README_LINES = (
    "pip install torch==2.13.0 -e .",
    'pip install torch==2.13.0 -e ".[test]"',
    "python -m pytest -q",
)
LOSS_LINE = re.compile(r"first loss ([0-9.]+) \(step 1\), last loss ([0-9.]+) \(step (\d+)\)")
BLOCK_TIMEOUT_S = 600
# Below both measured gains (0.041, 0.016): another machine samples another trajectory (the same config
# at kl_loss_coef 0.001 rose by 0.056 in an earlier session and collapsed here).
REWARD_GAIN = 0.01


def bash_blocks(text: str) -> list[str]:
    return [m.group(1) for m in BLOCK.finditer(text)]


def runnable(block: str) -> str:
    return "\n".join(line for line in block.splitlines() if not line.lstrip().startswith(SKIPPED))


def test_doc_has_the_readme_commands():
    lines = [line.strip() for block in bash_blocks(DOC.read_text()) for line in block.splitlines()]
    for expected in README_LINES:
        assert expected in lines, f"docs/quickstart.md: no ```bash line {expected!r}"
    readme = (REPO / "README.md").read_text()
    # The README's commands are the doc's lines joined with &&.
    assert "pip install torch==2.13.0 -e . && trinity tiny-assets quickstart_assets && trinity run --config configs/quickstart.yaml" in readme
    assert 'pip install torch==2.13.0 -e ".[test]" && python -m pytest -q' in readme
    assert "trinity tiny-assets quickstart_assets" in lines and "trinity run --config configs/quickstart.yaml" in lines


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_quickstart_doc_commands_run(tmp_path: Path):
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    scripts = [runnable(b) for b in bash_blocks(DOC.read_text())]
    scripts = [s for s in scripts if s.strip()]
    assert len(scripts) >= 6, f"docs/quickstart.md: expected the quickstart's command blocks, found {len(scripts)}"
    ran_sft = False
    for script in scripts:
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=BLOCK_TIMEOUT_S,
        )
        tail = "\n".join(proc.stdout.splitlines()[-40:])
        assert proc.returncode == 0, f"docs/quickstart.md block failed (exit {proc.returncode}):\n{script}\n--- output ---\n{tail}"
        if "trinity run --config configs/quickstart.yaml\n" in script + "\n":
            found = LOSS_LINE.search(proc.stdout)
            assert found, f"the quickstart run printed no 'first loss ... last loss' line:\n{tail}"
            first, last, step = float(found.group(1)), float(found.group(2)), int(found.group(3))
            assert step == 60 and last < 0.5 * first, f"loss did not fall enough: first {first}, last {last} (step {step})"
            ran_sft = True
    assert ran_sft, "docs/quickstart.md never runs `trinity run --config configs/quickstart.yaml`"
    assert (tmp_path / "runs" / "quickstart" / "hf_step60" / "config.json").is_file()
    metrics = tmp_path / "runs" / "grpo_tiny" / "metrics.jsonl"
    rewards = [json.loads(line)["reward/mean"] for line in metrics.read_text().splitlines()]
    assert len(rewards) == 50
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + REWARD_GAIN, f"GRPO mean reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}"
