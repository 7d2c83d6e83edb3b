"""What a run shows and leaves for its user: the live bar on a terminal and plain lines elsewhere (through
the launchers' prefixed relays, as `trinity run` starts them), printed samples, the closing summary and
`trinity plot`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from trinity.launch.console import TTY_ENV, live_console
from trinity.trainer.progress import console_is_terminal, line_due, rate

# --- which steps print, and where a bar is drawn ---------------------------------------------------


def test_lines_at_the_first_step_every_interval_and_the_last():
    due = [s for s in range(1, 26) if line_due(s, interval=10, start_step=0, total_steps=25)]
    assert due == [1, 10, 20, 25]
    resumed = [s for s in range(31, 61) if line_due(s, interval=10, start_step=30, total_steps=60)]
    assert resumed == [31, 40, 50, 60]


class _Tty:
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("env,expected", [
    ({}, True), ({"CI": "true"}, False), ({"CI": "1"}, False), ({"CI": "false"}, True), ({"TERM": "dumb"}, False),
])
def test_no_live_bar_under_ci_or_a_dumb_terminal(env, expected):
    assert live_console(env, _Tty()) is expected
    assert console_is_terminal(env, _Tty()) is expected
    assert console_is_terminal({**env, TTY_ENV: "1"}, _Tty()) is True  # what `trinity run` decided wins


def test_rate_reads_as_seconds_per_step_or_steps_per_second():
    assert [rate(None), rate(0.25), rate(4.0)] == ["-- s/step", "4.00 s/step", "4.0 steps/s"]


# --- what the user sees: `trinity run`'s relay of rank 0 onto a terminal or a pipe ---------------------

_DRIVER = """
import json, os, sys
from trinity.launch.torchrun import supervise, worker_env
sys.exit(supervise(json.loads(sys.argv[1]), env=worker_env(os.environ, sys.stdout)))
"""


def _launcher(kind: str, out: Path, go: Path) -> list[str]:
    """The worker stand-in started as `trinity run` starts a job of one process, or under torchrun."""
    worker = ["-m", "trinity.testing.progress_worker", str(out), str(go)]
    if kind == "single":
        return [sys.executable, "-m", "trinity.launch.single", "--log-dir", str(out / "logs"), *worker]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "--max-restarts", "0",
            "--log-dir", str(out / "logs"), "--redirects", "3", "--tee", "3", "--local-ranks-filter", "0", *worker]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", TTY_ENV, "COLUMNS", "TERM")}
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])), **extra}


def screen(data: bytes, width: int = 160) -> list[str]:
    """The rows a terminal of `width` columns shows after receiving `data`: text, newlines, carriage
    returns and the cursor / erase sequences rich and the relays use; other sequences (colours, cursor
    visibility) change nothing on screen."""
    rows, row, col = [[]], 0, 0
    for m in re.finditer(r"\x1b\[([0-9;?]*)([A-Za-z])|\r|\n|[^\x1b\r\n]", data.decode(errors="replace")):
        token, arg, cmd = m.group(0), m.group(1), m.group(2)
        if token == "\r" or cmd == "G":
            col = 0
        elif token == "\n":
            row += 1
        elif cmd == "A":
            row = max(0, row - int(arg or 1))
        elif cmd == "K":
            rows[row] = [] if arg == "2" else rows[row][:col]
        elif cmd is None:
            if col >= width:
                row, col = row + 1, 0
            while len(rows) <= row:
                rows.append([])
            rows[row] += [" "] * (col + 1 - len(rows[row]))
            rows[row][col] = token
            col += 1
        while len(rows) <= row:
            rows.append([])
    return ["".join(r).rstrip() for r in rows if "".join(r).strip()]


def _on_a_terminal(cmd: list[str], go: Path, env: dict[str, str]) -> tuple[int, bytes]:
    """Run `cmd` with stdout and stderr on a 160-column pseudo-terminal; write `go` once the terminal
    received step 2's bar frame. (exit code, all the terminal received)."""
    from tests.console import on_a_terminal

    def step_2_seen(received: bytes) -> None:
        if b"2/4" in received and not go.exists():
            go.write_text("seen")

    return on_a_terminal(cmd, cwd=REPO, env=env, timeout=150, columns=160, on_output=step_2_seen)


def _step_line(step: int) -> str:
    return f"[default0]:step {step}/4 | loss {4.0 / step:.4f} | lr 0.0010 | grad_norm 0.5000 | 1000 tok/s | 0.100 s/step | mem 0.25 GiB | elapsed"


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["single", "torchrun"])
def test_a_terminal_gets_a_live_bar_and_the_lines(tmp_path, kind):
    """Under `trinity run` on a terminal: the bar moves with every step as it comes (step 2's frame, an
    unfinished line, reaches the screen while the worker waits for it), the step lines start at step 1,
    and the screen ends with the lines a pipe gets (prefix included), the stopped bar, an escaped sample
    and the summary."""
    out, go = tmp_path / "run", tmp_path / "go"
    cmd = [sys.executable, "-c", _DRIVER, json.dumps(_launcher(kind, out, go))]
    code, raw = _on_a_terminal(cmd, go, _env(TERM="xterm-256color"))
    rows = screen(raw)
    assert code == 0 and go.exists(), (code, rows)
    bars = [r for r in rows if "━" in r]
    assert len(bars) == 1, rows
    assert re.fullmatch(r"\[default0\]:train ━{30} 4/4 \d+\.\d+ (s/step|steps/s) eta 0:00:00 loss 1\.0000", bars[0]), rows
    assert [r.split(" | ")[0] for r in rows if r.startswith("[default0]:step ")] == [f"[default0]:step {s}/4" for s in (1, 3, 4)]
    assert rows[0].startswith(_step_line(1)), rows
    # the model's escape sequence is text, not a cleared screen
    assert rows[3:6] == ["[default0]:  sample 1/8 of step 4 | reward 1.000 | answer 4",
                         "[default0]:    prompt:   What is 2+2?\\nAnswer:", "[default0]:    response: 4\\x1b[2J\\ufffd"], rows
    assert rows[6] == bars[0] and rows[7:10] == [f"[default0]:run summary: {out}", "[default0]:  loss     4.0000 (step 1) -> 1.0000 (step 4)",
                                                 f"[default0]:  metrics  {out / 'metrics.jsonl'}"], rows


@pytest.mark.multiproc
def test_a_pipe_gets_plain_lines_from_step_1(tmp_path):
    out, go = tmp_path / "run", tmp_path / "go"
    cmd = [sys.executable, "-c", _DRIVER, json.dumps(_launcher("single", out, go))]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=150)
    text = proc.stdout.decode()
    assert proc.returncode == 0, text
    assert "\x1b" not in text and "\r" not in text and "━" not in text
    lines = [line for line in text.splitlines() if line.startswith("[default0]:step ")]
    assert [line.split(" | ")[0] for line in lines] == ["[default0]:step 1/4", "[default0]:step 3/4", "[default0]:step 4/4"]
    assert lines[0].startswith(_step_line(1))
    assert f"[default0]:run summary: {out}\n" in text


# --- printed samples ----------------------------------------------------------------------------------


def test_samples_are_escaped_and_cut_without_cutting_an_escape():
    from trinity.trainer.samples import sample_text, shown

    # control characters, invisible ones and the tokenizer's U+FFFD for bytes that are not UTF-8
    assert shown("a\x1b[31mb\ufffd\u200b\t\n c\u00e9", 100) == "a\\x1b[31mb\\ufffd\\u200b\\t\\n c\u00e9"
    assert shown("x" * 300, 240) == "x" * 240 + "..."
    assert shown("ab\ufffd", 3) == "ab..."  # `\ufffd` is 6 characters: left out whole
    assert shown("Q: 1+1?\nA:", 6, tail=True) == "...1?\\nA:"
    assert shown(12, 40) == "12"
    row = {"prompt": "p" * 200 + "What is 2+2?", "response": "\ufffd\ufffd4", "reward": 0.5, "answer": "4"}
    assert sample_text(row, 0, 128, 7).splitlines() == [
        "  sample 1/128 of step 7 | reward 0.500 | answer 4",
        "    prompt:   ..." + "p" * 148 + "What is 2+2?",
        "    response: \\ufffd\\ufffd4",
    ]
    assert sample_text(row, 1, 4, 0, val=True).startswith("  val sample 2/4 of step 0 |")


def test_sample_text_is_printed_as_written_under_the_bar(tmp_path, monkeypatch):
    """rich would read `[/x]` as markup (and fail) and `:smile:` as an emoji; the logger prints text."""
    import io

    from trinity.trainer import metrics as M

    monkeypatch.setenv(TTY_ENV, "1")
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    logger = M.MetricsLogger(tmp_path, enabled=True, total_steps=2, start_step=0, log_interval=1, tensorboard=False,
                             line=lambda m: [f"x {m['x']}"])
    logger.log({"step": 1, "x": 1})
    logger.print("response: [/b] :smile: [bold]x")
    logger.close()
    assert "[default0]:response: [/b] :smile: [bold]x\n" in out.getvalue()


# --- the closing summary -----------------------------------------------------------------------------


def _metrics(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "lo')  # a run killed mid-write


def test_summary_names_existing_paths_and_first_last_values(tmp_path):
    from trinity.trainer.summary import summary_lines

    out = tmp_path / "run"
    _metrics(out / "metrics.jsonl", [
        {"step": 0, "val/reward_mean": 0.25},
        {"step": 1, "reward/mean": float("nan"), "actor/pg_loss": 0.1},
        {"step": 2, "reward/mean": 0.125, "actor/pg_loss": 0.1},
        {"step": 3, "reward/mean": 0.5, "actor/pg_loss": 0.1},
        {"step": 3, "val/reward_mean": 0.75},
    ])
    for folder in ("logs", "samples", "checkpoints/step_2", "checkpoints/step_3"):
        (out / folder).mkdir(parents=True)
    (out / "checkpoints" / "step_2" / "complete").write_text("")  # step_3 is not complete: not listed
    from trinity.trainer.summary import read_metrics

    lines = summary_lines(out, read_metrics(out / "metrics.jsonl"), [("wandb", "https://wandb.ai/x/y")])
    assert lines == [
        f"run summary: {out}",
        "  reward/mean      0.1250 (step 2) -> 0.5000 (step 3)",
        "  val/reward_mean  0.2500 (step 0) -> 0.7500 (step 3)",
        f"  metrics          {out / 'metrics.jsonl'}",
        f"  logs             {out / 'logs'}",
        f"  checkpoint       {out / 'checkpoints' / 'step_2'}",
        f"  samples          {out / 'samples'}",
        "  wandb            https://wandb.ai/x/y",
    ]


def test_summary_of_an_sft_run_with_an_export_and_curves(tmp_path):
    from trinity.trainer.summary import read_metrics, summary_lines

    _metrics(tmp_path / "metrics.jsonl", [{"step": 1, "loss": 5.76449}, {"step": 60, "loss": 1.35121}])
    (tmp_path / "hf").mkdir()
    (tmp_path / "curves.png").write_bytes(b"png")
    assert summary_lines(tmp_path, read_metrics(tmp_path / "metrics.jsonl"))[1:] == [
        "  loss       5.7645 (step 1) -> 1.3512 (step 60)",
        f"  metrics    {tmp_path / 'metrics.jsonl'}",
        f"  hf export  {tmp_path / 'hf'}",
        f"  curves     {tmp_path / 'curves.png'}",
    ]


# --- trinity plot --------------------------------------------------------------------------------------


def _plot(*args: str):
    from typer.testing import CliRunner

    from trinity.cli.main import app

    return CliRunner().invoke(app, ["plot", *args])


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's header, which must be there."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_plot_overlays_runs_into_a_png(tmp_path, monkeypatch):
    from trinity.trainer.curves import panels, run_names

    assert run_names([Path("x/run"), Path("y/run"), Path("z")]) == ["x/run", "y/run", "z"]  # a legend tells them apart

    sft = [{"step": s, "loss": 5.0 / s, "lr": 1e-3, "tokens_per_s": 900.0 + s} for s in range(1, 31)]
    rl = ([{"step": 0, "val/reward_mean": 0.1}]
          + [{"step": s, "reward/mean": s / 30, "actor/pg_loss": 0.01, "actor/lr": 1e-6,
              "tokens_per_s/rollout": 50.0, "tokens_per_s/update_actor": 70.0} for s in range(1, 31)]
          + [{"step": 30, "val/reward_mean": 0.9}])
    _metrics(tmp_path / "a" / "metrics.jsonl", sft)
    _metrics(tmp_path / "b" / "metrics.jsonl", rl)
    runs = {"a": sft, "b": rl}
    assert panels(runs) == [("loss", ["loss", "actor/pg_loss"]), ("reward", ["reward/mean"]), ("val", ["val/reward_mean"]),
                            ("learning rate", ["lr", "actor/lr"]),
                            ("throughput (tokens/s)", ["tokens_per_s", "tokens_per_s/rollout", "tokens_per_s/update_actor"])]
    out = tmp_path / "both.png"
    result = _plot(str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out))
    assert result.exit_code == 0, result.output
    assert result.output == f"wrote {out}\n"
    assert _png_size(out) == (880, 720) and out.stat().st_size < 100_000  # 5 panels: 2 columns x 3 rows
    monkeypatch.chdir(tmp_path / "a")  # one run: its own curves.png (the file a run writes at its end)
    assert _plot(".").exit_code == 0 and _png_size(tmp_path / "a" / "curves.png") == (880, 480)  # 3 panels


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    _metrics(tmp_path / "metrics.jsonl", [{"step": 1, "loss": 1.0}])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` meets when it is not installed
    result = _plot(str(tmp_path))
    assert result.exit_code == 2
    assert result.output == ('error: trinity plot needs matplotlib, which is not installed: '
                             'pip install "trinity-mcore[plot]" (or pip install -e ".[plot]" in a clone)\n')
    assert not (tmp_path / "curves.png").exists()


def test_plot_names_a_folder_without_metrics(tmp_path):
    result = _plot(str(tmp_path))
    assert result.exit_code == 2
    assert result.output == f"error: {tmp_path}: no metrics.jsonl in it; name a run's trainer.output_dir\n"


def test_trainer_curves_true_needs_matplotlib(small_job, write_job, monkeypatch):
    """trainer.curves: unset draws curves.png where matplotlib is installed; true where it is not is refused
    before any process starts (it could not take effect); false is always accepted."""
    import importlib.util

    from trinity.config.loader import load_config
    from trinity.errors import ConfigError

    job = {**small_job, "trainer": {**small_job["trainer"], "curves": True}}
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    with pytest.raises(ConfigError) as err:
        load_config(write_job(job))
    assert str(err.value) == ('trainer.curves: drawing curves.png needs matplotlib, which is not installed; run '
                              '`pip install "trinity-mcore[plot]"` or remove the key')
    job["trainer"]["curves"] = False
    assert load_config(write_job(job)).config.trainer.curves is False
    monkeypatch.undo()
    job["trainer"]["curves"] = True
    assert load_config(write_job(job)).config.trainer.curves is True
