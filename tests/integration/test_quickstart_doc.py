"""Runs docs/quickstart.md as a reader would, in order, in a temporary copy of configs/, and checks that
what the doc shows is what the commands print.

- Each ```bash block runs as one `bash -euo pipefail` script (so heredocs work and a failing line fails
  the block), with the environment a reader has: tests/conftest.py's OMP_NUM_THREADS=1 is removed,
  since the doc sets no such variable (the workers choose their threads themselves, from the cores
  they may run on: under pytest-xdist, this worker's share of them, `worker_cores`). Skipped: `pip
  install` lines (the test environment is installed already) and the test suite itself (`python -m
  pytest`, which would run this test again); the test asserts the doc has both.
- A ```text block whose first line is `$ <command>` runs that command and shows its output.
- Every other ```text block is output the doc claims: its lines must appear, in order, in what the
  commands run so far printed (after the previous block's match). `...` stands for lines or text left
  out, `<name>` for a word that differs per run or machine (a Python path, a cache key). Numbers must
  match within NUMBER_RTOL, except times, throughputs and memory, and the numbers of the sampled RL
  trajectory, which the doc says vary between machines (VOLATILE).
- Then the doc's claims about the two training runs, with the margins the doc states: the SFT's last
  loss below SFT_LOSS_RATIO of its first, and the GRPO's mean reward over its last 10 steps at least
  REWARD_GAIN above the first 10 steps'.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.console import noise

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "quickstart.md"
FENCE = re.compile(r"^```(bash|text)\n(.*?)^```", re.S | re.M)
PYTHON_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
SKIPPED = ("pip install", "python -m pytest")
README_LINES = (
    "pip install torch==2.13.0 -e .",
    'pip install torch==2.13.0 -e ".[test]"',
    "python -m pytest -q",
)
LOSS_LINE = re.compile(r"\]:  loss +([0-9.]+) \(step 1\) -> ([0-9.]+) \(step (\d+)\)\n")  # the run's summary
BLOCK_TIMEOUT_S = 600
# The runs are deterministic on one machine (seeded data order and sampling; the SFT weights were
# bit-identical with 1 and 2 threads); another CPU's float rounding moves the SFT losses by far less.
NUMBER_RTOL = 0.02
NUMBER = r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?"
# A number followed by one of these units, or preceded by one of these words, is not compared.
CLOCK = r"\d+:\d\d:\d\d"  # h:mm:ss
VOLATILE_AFTER = re.compile(r"\s*(tok/s|s/step|GiB)")
VOLATILE_BEFORE = re.compile(r"(reward|len|pg_loss|ref_kl|steps|reward/mean|reward/mean +\S+ \(step \d+\) ->)\s*$")
# docs/quickstart.md states both margins in its prose.
SFT_LOSS_RATIO = 0.3
REWARD_GAIN = 0.5  # measured +0.84, +0.84, +0.86 with trainer.seed 1234, 7, 42


def worker_cores() -> set[int]:
    """The cores a reader's machine would have for this test: this process's cores, split evenly over
    pytest-xdist's workers (at least one each), this worker taking its own slice. Under `-n 2` on 2 cores
    the doc's commands run on one core, as on a 1-core machine: their workers choose 1 torch thread
    (trinity.distributed.parallel.cpu_threads_per_rank reads the affinity mask), instead of 2 threads
    that the other worker's tests keep descheduling (tiny steps 30-100x slower). Alone (`-n 0`) they
    get every core, as on the machine the doc was captured on. The runs' numbers do not depend on the
    thread count (the doc says so, and this test compares them)."""
    cores = sorted(os.sched_getaffinity(0))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    share = max(1, len(cores) // max(1, workers))
    start = (worker * share) % len(cores)
    return set(cores[start:start + share])


def reader_shell(script: str, cores: set[int]) -> list[str]:
    """`bash -euo pipefail -c script` on `cores` (the affinity mask its children inherit)."""
    return [sys.executable, "-c", "import os, sys; os.sched_setaffinity(0, set(map(int, sys.argv[1].split(',')))); "
            "os.execvp('bash', ['bash', '-euo', 'pipefail', '-c', sys.argv[2]])",
            ",".join(map(str, sorted(cores))), script]


def fences(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def bash_blocks(text: str) -> list[str]:
    return [body for kind, body in fences(text) if kind == "bash"]


def runnable(block: str) -> str:
    return "\n".join(line for line in block.splitlines() if not line.lstrip().startswith(SKIPPED))


def line_pattern(doc_line: str) -> tuple[re.Pattern, list[bool]]:
    """A regex for one line the doc shows, and per number in it whether it is compared."""
    parts, compared, pos = [], [], 0
    for m in re.finditer(rf"\.\.\.|<[A-Za-z_ -]+>|{CLOCK}|(?<![\w.]){NUMBER}(?![\w])", doc_line):
        parts.append(re.escape(doc_line[pos:m.start()]))
        token = m.group(0)
        if token == "...":
            parts.append(".*?")
        elif re.fullmatch(CLOCK, token):  # elapsed / eta on a progress line: never compared
            parts.append(CLOCK)
        elif token.startswith("<"):
            parts.append(r"\S+")
        else:
            parts.append(f"({NUMBER})")
            volatile = VOLATILE_AFTER.match(doc_line, m.end()) or VOLATILE_BEFORE.search(doc_line[:m.start()])
            compared.append(not volatile)
        pos = m.end()
    parts.append(re.escape(doc_line[pos:]))
    return re.compile("".join(parts)), compared


def matches(doc_line: str, out_line: str) -> bool:
    pattern, compared = line_pattern(doc_line.strip())
    found = pattern.fullmatch(out_line.strip())
    if not found:
        return False
    wanted = re.findall(rf"(?<![\w.]){NUMBER}(?![\w])", re.sub(rf"<[A-Za-z_ -]+>|{CLOCK}", "", doc_line.strip()))
    for want, got, check in zip(wanted, found.groups(), compared, strict=True):
        if check and abs(float(got) - float(want)) > NUMBER_RTOL * abs(float(want)):
            return False
    return True


def find_in_order(doc_block: str, out_lines: list[str], start: int) -> tuple[int, str | None]:
    """Match the doc's lines in order from out_lines[start]; (index after the last match, first missing line)."""
    pos = start
    for doc_line in doc_block.splitlines():
        if not doc_line.strip() or doc_line.strip() == "...":
            continue
        for i in range(pos, len(out_lines)):
            if matches(doc_line, out_lines[i]):
                pos = i + 1
                break
        else:
            return pos, doc_line
    return pos, None


def test_line_matching_rules():
    assert matches("[default0]:step 10/60 | loss 2.7777 | 8674 tok/s | 0.236 s/step | mem 0.54 GiB",
                   "[default0]:step 10/60 | loss 2.7800 | 6001 tok/s | 0.301 s/step | mem 0.61 GiB")
    assert not matches("[default0]:step 10/60 | loss 2.7777 | 8674 tok/s", "[default0]:step 10/60 | loss 2.95 | 8674 tok/s")
    assert matches("converting a in <home>/.cache/trinity/mcore/<key> (cached)",
                   "converting a in /tmp/x/home/.cache/trinity/mcore/f14774c9b0a1c2d3-fp32-c1 (cached)")
    assert matches("command: <python> -m torch.distributed.run ... -m trinity.trainer.worker x.yaml",
                   "command: /usr/bin/python3 -m torch.distributed.run --nnodes 1 -m trinity.trainer.worker x.yaml")
    assert matches("step 2/50 | reward 0.446 | len 2.7", "step 2/50 | reward 0.112 | len 3.1")
    assert matches("step 2/50 | loss 1.0 | elapsed 0:00:24 | eta 0:11:49", "step 2/50 | loss 1.0 | elapsed 0:01:02 | eta 1:05:00")
    assert not matches("step 2/50 | loss 1.0 | elapsed 0:00:24", "step 2/50 | loss 1.5 | elapsed 0:00:24")
    assert not matches("step 2/50 | reward 0.446", "step 3/50 | reward 0.446")
    assert find_in_order("a 1\n...\nb 2\n", ["x", "a 1", "y", "b 2"], 0) == (4, None)
    assert find_in_order("b 2\na 1\n", ["a 1", "b 2"], 0) == (2, "a 1")


def test_doc_has_the_readme_commands():
    lines = [line.strip() for block in bash_blocks(DOC.read_text()) for line in block.splitlines()]
    for expected in README_LINES:
        assert expected in lines, f"docs/quickstart.md: no ```bash line {expected!r}"
    readme = (REPO / "README.md").read_text()
    # The README's commands are the doc's lines joined with &&.
    assert "pip install torch==2.13.0 -e . && trinity tiny-assets quickstart_assets && trinity run --config configs/quickstart.yaml" in readme
    assert 'pip install torch==2.13.0 -e ".[test]" && python -m pytest -q' in readme
    assert "trinity tiny-assets quickstart_assets" in lines and "trinity run --config configs/quickstart.yaml" in lines
    text = DOC.read_text()
    assert "OMP_NUM_THREADS" not in "".join(bash_blocks(text)), "the doc's commands set no thread count"
    # The margins this test checks are the ones the doc promises.
    assert f"{REWARD_GAIN}" in text and f"{SFT_LOSS_RATIO:.0%}" in text


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_quickstart_doc_commands_run(tmp_path: Path):
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "TRINITY_CACHE", "TRINITY_MCORE_CACHE")}
    # The reader's conversion cache, ~/.cache/trinity/mcore (the doc shows <home>/.cache/...), in the test's folder.
    env["XDG_CACHE_HOME"] = str(tmp_path / "home" / ".cache")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    blocks = fences(DOC.read_text())
    assert sum(kind == "bash" and runnable(body).strip() != "" for kind, body in blocks) >= 6, (
        "docs/quickstart.md: expected the quickstart's command blocks"
    )
    cores = worker_cores()
    out_lines: list[str] = []
    cursor, ran_sft, shown = 0, False, 0
    for kind, body in blocks:
        command = body.splitlines()[0][2:] if kind == "text" and body.startswith("$ ") else None
        if kind == "bash" or command:
            script = runnable(body) if kind == "bash" else command
            if not script.strip():
                continue
            proc = subprocess.run(
                reader_shell(script, cores), cwd=tmp_path, env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=BLOCK_TIMEOUT_S,
            )
            tail = "\n".join(proc.stdout.splitlines()[-40:])
            if command:  # the doc shows a mistake: it must be refused with exit code 2
                assert proc.returncode == 2, f"`{command}`: exit {proc.returncode}, the doc says 2:\n{tail}"
                cursor = len(out_lines)  # what the doc shows below the command is this command's output
            else:
                assert proc.returncode == 0, (
                    f"docs/quickstart.md block failed (exit {proc.returncode}):\n{script}\n--- output ---\n{tail}"
                )
            leaks = noise(proc.stdout)
            assert not leaks, f"docs/quickstart.md block printed what --debug alone shows:\n{script}\n" + "\n".join(leaks)
            out_lines += proc.stdout.splitlines()
            if kind == "bash" and "trinity run --config configs/quickstart.yaml\n" in script + "\n" and not ran_sft:
                found = LOSS_LINE.search(proc.stdout)
                assert found, f"the quickstart run's summary has no 'loss <first> (step 1) -> <last>' line:\n{tail}"
                first, last, step = float(found.group(1)), float(found.group(2)), int(found.group(3))
                assert step == 60 and last < SFT_LOSS_RATIO * first, (
                    f"loss did not fall enough: first {first}, last {last} (step {step})"
                )
                ran_sft = True
            if kind == "bash":
                continue
        expected = "\n".join(body.splitlines()[1:]) if command else body
        cursor, missing = find_in_order(expected, out_lines, cursor)
        assert missing is None, (
            f"docs/quickstart.md shows {missing!r}, but the commands printed no such line "
            "(in order, after the previous block's output); their last lines:\n" + "\n".join(out_lines[-40:])
        )
        shown += 1
    assert ran_sft, "docs/quickstart.md never runs `trinity run --config configs/quickstart.yaml`"
    assert shown >= 8, f"docs/quickstart.md: only {shown} output blocks checked"
    assert (tmp_path / "runs" / "quickstart" / "hf_step60" / "config.json").is_file()
    metrics = tmp_path / "runs" / "grpo_tiny" / "metrics.jsonl"
    rewards = [json.loads(line)["reward/mean"] for line in metrics.read_text().splitlines()]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= first + REWARD_GAIN, f"GRPO mean reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}"


def test_noise_rules():
    leak = ("job: sft\n\ncommand: x\n[default0]:/x/layers.py:738: UserWarning: When using async grad allreduce\n"
            "[default0]:  warnings.warn(\nWriting model shards: 100%|##########| 1/1 [00:00<00:00, 55.92it/s]\n"
            "warning: trainer.total_steps: trinity's own\n[default0]:warning: a.b: trinity's own\nstep 1/2 | loss 2\n")
    assert [f.split(": ")[0] + ": " + f.split(": ")[1] for f in noise(leak)] == [
        "line 2: a blank line", "line 4: a warning", "line 5: a warning", "line 6: a progress bar"]
    assert noise("Usage: trinity\n\nOptions\n", blank_lines=True) == []


def _doc_python(doc: str, marker: str) -> str:
    """The Python snippet of docs/<doc> that contains `marker`: a ```python block, or a ```bash block's
    `python - <<'EOF'` heredoc."""
    text = (REPO / "docs" / doc).read_text()
    blocks = PYTHON_FENCE.findall(text) + [b.split("<<'EOF'\n", 1)[1].rsplit("EOF", 1)[0]
                                            for b in bash_blocks(text) if "<<'EOF'" in b]
    (found,) = [b for b in blocks if marker in b]
    return found


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=BLOCK_TIMEOUT_S)
    assert proc.returncode == 0, f"{argv}: exit {proc.returncode}\n{proc.stdout[-3000:]}"
    return proc.stdout


def _peft_adapter(model: Path, out: Path) -> None:
    """A PEFT adapter folder on `model`, as a LoRA job's `adapter/` is (for docs/lora.md's snippet)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    get_peft_model(AutoModelForCausalLM.from_pretrained(model), LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(out)


VALIDATE_ALL = """
import sys
from trinity.cli.main import app
for config, *overrides in [line.split() for line in sys.argv[1:]]:
    try:
        app(["validate", "--config", config, *overrides])
    except SystemExit as end:
        assert end.code == 0, (config, end.code)
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_documented_commands_print_no_third_party_noise(tmp_path: Path):
    """`trinity --help`, `trinity validate` on the example configs and the docs' Python snippets
    (docs/pretraining.md's indexed-dataset builder, docs/real-model.md's evaluation, docs/quickstart.md's
    and docs/lora.md's loading in transformers / PEFT, on the tiny assets) print no third-party warning,
    progress bar or stray blank line. `trinity tiny-assets`, `trinity run` and `trinity convert` are
    checked where they run anyway: the quickstart's commands (test_quickstart_doc_commands_run, whose
    first block is `trinity tiny-assets quickstart_assets`) and the TP=2 run of
    tests/integration/test_sft_cpu.py; the assets here are made in this process (what the command
    calls), not by a second CLI process (~8 s of imports)."""
    from trinity.testing.tiny_assets import make_quickstart_assets

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    outputs = {"trinity --help": (_run(["trinity", "--help"], tmp_path, env), True)}
    make_quickstart_assets(tmp_path / "quickstart_assets")
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    fixtures = REPO / "tests" / "fixtures"
    cpu = [f"configs/{name}" for name in ("quickstart.yaml", "grpo_tiny_cpu.yaml", "lora_sft_cpu.yaml")]
    gpu = [f"{p} model.path={fixtures / 'hf_configs' / 'qwen2_5_7b'} data.train_files=[{fixtures / 'data' / 'prompts.jsonl'}]"
           for p in sorted(f"configs/{c.name}" for c in (REPO / "configs").glob("grpo_qwen2_5*.yaml"))]
    outputs["trinity validate"] = (_run([sys.executable, "-c", VALIDATE_ALL, *cpu, *gpu], tmp_path, env), False)
    assert outputs["trinity validate"][0].count("estimated peak per GPU") == len(cpu) + len(gpu)

    pretraining = _doc_python("pretraining.md", "IndexedDatasetBuilder").replace("/models/Qwen2.5-7B", "quickstart_assets/model")
    outputs["docs/pretraining.md"] = (_run([sys.executable, "-c", pretraining], tmp_path, env), False)
    assert (tmp_path / "corpus_text_document.idx").is_file()
    prompts = (tmp_path / "quickstart_assets" / "data" / "rl_prompts.jsonl").read_text().splitlines()[:4]
    (tmp_path / "val.jsonl").write_text("\n".join(prompts) + "\n")
    evaluation = _doc_python("real-model.md", "generate_answers").replace("real_assets/data/grpo_add_val.jsonl", "val.jsonl")
    evaluation = evaluation.replace('Path("runs/smollm2_grpo")', 'Path("quickstart_assets/model")')
    outputs["docs/real-model.md"] = (_run([sys.executable, "-c", evaluation], tmp_path, env), False)
    assert re.fullmatch(r"\d of 4\n", outputs["docs/real-model.md"][0]), outputs["docs/real-model.md"][0]

    loading = _doc_python("quickstart.md", "AutoModelForCausalLM").replace("runs/quickstart/hf_step60", "quickstart_assets/model")
    loading = loading.replace("runs/quickstart/hf", "quickstart_assets/model")
    outputs["docs/quickstart.md"] = (_run([sys.executable, "-c", loading], tmp_path, env), False)
    assert outputs["docs/quickstart.md"][0].endswith("same logits as quickstart_assets/model: True\n")
    _peft_adapter(tmp_path / "quickstart_assets" / "model", tmp_path / "runs" / "lora_sft" / "adapter")
    outputs["docs/lora.md"] = (_run([sys.executable, "-c", _doc_python("lora.md", "PeftModel")], tmp_path, env), False)

    leaks = {name: noise(text, blank_lines=blank) for name, (text, blank) in outputs.items()}
    assert not any(leaks.values()), "printed what --debug alone shows:\n" + json.dumps(leaks, indent=1)
