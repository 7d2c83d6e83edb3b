"""`trinity convert` through the Typer app (typer.testing.CliRunner): exit codes, the error block, and
the final report line users read (GB, GB/s and, with --verify, max/mean |Δ|)."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from trinity.cli.main import app
from trinity.testing.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.timeout(180)

# ... then where the time went, phase by phase: " [build 0.12 s, load 0.40 s, save 1.20 s]"
REPORT = r"wrote (\d+(?:\.\d+)?) GB to (\S+) in (\d+\.\d\d) s \((\d+(?:\.\d+)?) GB/s\) \[((?:\w+ \d+\.\d\d s(?:, )?)+)\]"
VERIFIED = r"; verified (.+): max \|Δ\| (\S+), mean \|Δ\| (\S+)$"


def _invoke(*args: str):
    return CliRunner().invoke(app, ["convert", *args])


def _last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def test_unsupported_architecture_exits_2_listing_supported(tmp_path):
    src = make_tiny_hf_model("qwen2", tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (src / "config.json").write_text(json.dumps(cfg))
    result = _invoke("hf-to-mcore", "--hf-path", str(src), "--output", str(tmp_path / "out"))
    assert result.exit_code == 2, result.output
    assert re.search(r"error: .*config.json: architecture 'GPT2LMHeadModel' is not supported; supported: .*Qwen2ForCausalLM", result.output)
    assert "Traceback" not in result.output and "internal error" not in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags,message",
    [(["--vpp", "2"], "--vpp: needs --pp > 1"), (["--ep", "2"], "--ep: EP=2 needs an MoE model")],
)
def test_invalid_layout_flags_exit_2_naming_the_flag(tmp_path, flags, message):
    src = make_tiny_hf_model("qwen2", tmp_path / "hf")
    result = _invoke("hf-to-mcore", "--hf-path", str(src), "--output", str(tmp_path / "out"), *flags)
    assert result.exit_code == 2, result.output
    assert f"error: {message}" in result.output and "internal error" not in result.output
    assert not (tmp_path / "out").exists()


def test_missing_paths_exit_2(tmp_path):
    result = _invoke("mcore-to-hf", "--mcore-path", str(tmp_path / "nope"), "--output", str(tmp_path / "out"))
    assert result.exit_code == 2 and "--mcore-path:" in result.output


def test_tiny_qwen2_both_ways_prints_report_lines(tmp_path):
    src = make_tiny_hf_model("qwen2", tmp_path / "hf")
    mc, back, again = tmp_path / "mc", tmp_path / "back", tmp_path / "again"

    result = _invoke("hf-to-mcore", "--hf-path", str(src), "--output", str(mc), "--dtype", "fp32", "--verify")
    assert result.exit_code == 0, result.output
    line = _last_line(result.stdout)
    m = re.match(r"hf-to-mcore: " + REPORT + VERIFIED, line)
    assert m, line
    assert float(m[1]) > 0 and float(m[4]) > 0 and m[2] == str(mc.resolve())
    phases = dict(p.rsplit(" ", 2)[:2] for p in m[5].split(", "))
    assert list(phases) == ["build", "load", "save"] and sum(map(float, phases.values())) <= float(m[3])
    assert m[6] == "logits vs transformers" and float(m[7]) <= 1e-4 and float(m[8]) <= float(m[7])

    result = _invoke("mcore-to-hf", "--mcore-path", str(mc), "--output", str(back), "--verify")
    assert result.exit_code == 0, result.output
    line = _last_line(result.stdout)
    m = re.match(r"mcore-to-hf: " + REPORT + VERIFIED, line)
    assert m, line
    assert [p.split(" ")[0] for p in m[5].split(", ")] == ["build", "load", "write"]
    assert "bit for bit" in m[6] and float(m[7]) == 0.0 and float(m[8]) == 0.0

    # Without --verify the line ends at the speed.
    result = _invoke("mcore-to-hf", "--mcore-path", str(mc), "--output", str(again))
    assert result.exit_code == 0, result.output
    assert re.fullmatch(r"mcore-to-hf: " + REPORT, _last_line(result.stdout)), result.stdout

    # An existing output is refused without --force: exit 2, and the folder is kept.
    result = _invoke("mcore-to-hf", "--mcore-path", str(mc), "--output", str(again))
    assert result.exit_code == 2 and "pass --force to replace it" in result.output
    assert (again / "config.json").is_file()
