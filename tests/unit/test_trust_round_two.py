"""Trust, round two: one line per bad input, naming the file and the cause; inputs checked against each
other; a run never writes into a folder of files that no trinity run wrote.

Each test asserts the exit code (or the UserError), that the message is one line without a traceback,
and that it names the file or key. Real failures where root can make them: a tmpfs mounted full or
read-only in a private mount namespace (`unshare -m`), /dev/full for ENOSPC.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.conftest import FIXTURES, HF_CONFIGS, REPO
from trinity.cli import commands
from trinity.cli.report import run_guarded
from trinity.config.loader import MAX_DEPTH, load_config
from trinity.errors import ConfigError, UserError

# Binary junk on one line: 127 ASCII bytes (NUL first), then 0x80, which no UTF-8 text has alone.
GARBAGE = bytes(b for b in range(256) if b != ord("\n")) * 8


def _guarded(fn, capsys) -> tuple[int, str]:
    code = run_guarded(fn, debug=False)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _problem_lines(text: str) -> list[str]:
    """The lines of an `error:` report, without the config report's header line."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("error: the config has")]


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def _unshare_sh(script: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`sh -c script` in a private mount namespace (a mount there is invisible to everyone else)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, env=env)


def _skip_unless_mounted(proc: subprocess.CompletedProcess) -> None:
    if "mount:" in proc.stderr or "unshare:" in proc.stderr:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer

    root = tmp_path_factory.mktemp("round_two")
    tok = make_tiny_tokenizer(root / "tokenizer")
    return make_tiny_qwen2(root / "model", tok, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2)


# --- 1: a training file of binary garbage ---------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_binary_training_file_is_refused_at_validate_naming_file_and_line(small_job, write_job, tmp_path, capsys,
                                                                         suffix):
    bad = tmp_path / f"train{suffix}"
    bad.write_bytes(b'{"prompt": "a", "response": "b"}\n' + GARBAGE)
    small_job["data"]["train_files"] = [str(bad)]
    code, out = _guarded(lambda: commands.validate(write_job(small_job), []), capsys)
    assert code == 2 and "Traceback" not in out
    [line] = _problem_lines(out)
    assert line.startswith(f"data.train_files.0: {bad}:2: not UTF-8 text (byte 0x80 at column 128);"), line
    small_job["data"].update(train_files=[str(FIXTURES / "data" / "sft.jsonl")], val_files=[str(bad)])
    code, out = _guarded(lambda: commands.validate(write_job(small_job), []), capsys)
    assert code == 2 and _problem_lines(out) == [line.replace("data.train_files.0", "data.val_files.0")]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_reader_names_the_line_that_is_not_utf8(tmp_path, suffix):
    from trinity.data.readers import read_records

    bad = tmp_path / f"d{suffix}"
    bad.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "caf\xe9", "response": "b"}\n')
    with pytest.raises(UserError) as exc:
        list(read_records([bad]))
    assert _one_line(exc).startswith(f"{bad}:2: not UTF-8 text (byte 0xe9 at column 16); ")


def test_pt_text_and_parquet_garbage_are_one_line(tmp_path):
    from trinity.data.pretrain import _text_documents, SourceKind
    from trinity.data.readers import read_records

    txt = tmp_path / "book.txt"
    txt.write_bytes(b"line one\nline two\n\xff\xfe rest")
    with pytest.raises(UserError) as exc:
        _text_documents(str(txt), SourceKind.text, "text")
    assert _one_line(exc).startswith(f"{txt}:3: not UTF-8 text (byte 0xff at column 1)")
    pytest.importorskip("pyarrow")
    pq = tmp_path / "t.parquet"
    pq.write_bytes(GARBAGE)
    with pytest.raises(UserError) as exc:
        list(read_records([pq]))
    assert _one_line(exc).startswith(f"{pq}: not a readable parquet file (")


def test_pt_binary_text_sources_are_refused_at_validate(write_job, tmp_path, capsys):
    bad, nul = tmp_path / "corpus.txt", tmp_path / "zeros.jsonl"
    bad.write_bytes(GARBAGE)
    nul.write_bytes(b"a\n" + bytes(64))  # valid UTF-8, but no text has NUL bytes
    job = {"algorithm": {"name": "pt"}, "model": {"path": str(HF_CONFIGS / "qwen2_5_0_5b")},
           "data": {"train_files": [str(bad), str(nul)], "seq_length": 64},
           "trainer": {"global_batch_size": 8, "micro_batch_size": 1}}
    code, out = _guarded(lambda: commands.validate(write_job(job), []), capsys)
    assert code == 2 and "Traceback" not in out
    assert _problem_lines(out) == [
        f"data.train_files.0: {bad}:1: not UTF-8 text (byte 0x80 at column 128); the file is binary or in another "
        "encoding: save it as UTF-8 text (e.g. iconv -f latin1 -t utf-8)",
        f"data.train_files.1: {nul}:2: not text (a NUL byte); the file is binary: give a UTF-8 text file"]


# --- 2: a full disk --------------------------------------------------------------------------------


def test_disk_error_is_found_under_what_wraps_it():
    from torch.distributed.checkpoint.api import CheckpointException

    from trinity.launch.failures import disk_error, disk_error_message

    full = OSError(errno.ENOSPC, "No space left on device", "/ckpt/step_5.tmp/__0_0.distcp")
    try:
        try:
            raise full
        except OSError as e:
            raise RuntimeError("Worker failure: [Errno 28]") from e
    except RuntimeError as wrapped:
        assert disk_error(wrapped) is full
        assert disk_error(CheckpointException("save failed", {1: (wrapped, None)})) is full
    assert disk_error(RuntimeError("a bug")) is None
    assert disk_error_message(full) == ("ENOSPC: no space left on device: /ckpt/step_5.tmp/__0_0.distcp; free space "
                                        "on that disk or write to a folder on another one")
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert disk_error_message(quota, "/runs/a").startswith("EDQUOT: disk quota exceeded: writing under /runs/a; ")


def test_worker_prints_one_line_for_a_full_disk_and_exits_2(monkeypatch, capsys, tmp_path):
    """/dev/full answers every write with ENOSPC, as a full disk does; the write names no file, the
    open file object in the failing frame does."""
    from trinity.trainer import worker

    def fill(_config: str) -> None:
        with open("/dev/full", "wb", buffering=0) as f:
            f.write(b"x" * 4096)

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    monkeypatch.setattr(worker, "run_worker", fill)
    monkeypatch.delenv("TRINITY_CLI_PID", raising=False)
    code = worker.main([str(tmp_path / "run" / "resolved_config.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("error (rank 0): ENOSPC: no space left on device: /dev/full; free space on "
                                            "that disk or write to a folder on another one")


_FULL_RANK = """
import sys
from trinity.trainer import worker

def fill(_config):
    with open("/dev/full", "wb", buffering=0) as f:
        f.write(b"x" * 4096)

worker.run_worker = fill
sys.exit(worker.main())
"""


def test_run_names_the_full_disk_a_rank_hit(tmp_path):
    """Through the real launcher (its rank logs): the CLI's last line is the rank's disk error."""
    from trinity.launch.failures import job_failure_line
    from trinity.launch.torchrun import supervise

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    (tmp_path / "full_rank.py").write_text(_FULL_RANK)
    out = tmp_path / "run"
    started = time.time()
    cmd = [sys.executable, "-m", "trinity.launch.single", "--log-dir", str(out / "logs"), "-m", "full_rank",
           str(out / "resolved_config.yaml")]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    env.pop("TRINITY_CLI_PID", None)
    code = supervise(cmd, env=env)
    assert code == 2
    assert job_failure_line(out, code, since=started) == (
        "error: ENOSPC: no space left on device: /dev/full; free space on that disk or write to a folder on another "
        f"one (rank 0; every rank's log is under {out / 'logs'})")
    # An older job's log in the same folder is not this job's cause.
    assert job_failure_line(out, code, since=time.time() + 60).startswith("job failed with exit code 2; ")


def test_run_on_a_full_disk_fails_in_conversion_with_one_line(tiny_model, tmp_path):
    """A 16 KiB tmpfs as output_dir and conversion cache: the lock and the run marker fit, the converted
    weights do not."""
    disk = tmp_path / "disk"
    disk.mkdir()
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_model)},
        "data": {"train_files": [str(FIXTURES / "data" / "sft.jsonl")], "seq_length": 64},
        "cluster": {"device": "cpu", "nproc_per_node": 1},
        "trainer": {"total_steps": 1, "global_batch_size": 2, "micro_batch_size": 1, "output_dir": str(disk / "run")},
    }))
    proc = _unshare_sh(f"mount -t tmpfs -o size=16k none {disk} && TRINITY_MCORE_CACHE={disk / 'cache'} "
                       f"exec {sys.executable} -m trinity.cli.main run -c {job}")
    _skip_unless_mounted(proc)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("error")]
    # Where the full disk surfaces decides whether the file is known (an OSError naming it, or torch's
    # writer's RuntimeError without one): the line names the file or the folder being written.
    assert line.startswith("error: ENOSPC: no space left on device: ") and f"{disk / 'cache'}" in line, line
    assert line.endswith("; free space on that disk or write to a folder on another one"), line


def test_convert_onto_a_full_disk_is_one_line(tiny_model, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = _unshare_sh(f"mount -t tmpfs -o size=16k none {disk} && exec {sys.executable} -m trinity.cli.main convert "
                       f"hf-to-mcore --hf-path {tiny_model} --output {disk / 'out'}")
    _skip_unless_mounted(proc)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("error")]
    assert line.startswith("error: ENOSPC: no space left on device: ") and str(disk) in line, line


# --- 3: a read-only output folder ----------------------------------------------------------------


def test_run_refuses_a_read_only_output_dir_before_launch(small_job, write_job, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    job = write_job(small_job)
    proc = _unshare_sh(f"mount -t tmpfs -o ro none {ro} && exec {sys.executable} -m trinity.cli.main run -c {job} "
                       f"trainer.output_dir={ro / 'run'}")
    _skip_unless_mounted(proc)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "command:" not in proc.stdout
    assert _problem_lines(proc.stderr) == [
        f"trainer.output_dir: {ro} is on a read-only file system; choose a folder on a writable disk"]


# --- 4: a truncated Megatron indexed dataset ------------------------------------------------------


def _indexed(prefix: Path, docs: list[list[int]]) -> Path:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in docs:
        builder.add_item(torch.tensor(doc))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


def test_truncated_bin_is_refused_at_validate_with_both_sizes(write_job, tmp_path, capsys):
    from trinity.data.pretrain import read_indexed

    prefix = _indexed(tmp_path / "corpus", [[5, 6, 7, 0], [8, 9, 0]] * 10)
    full = Path(f"{prefix}.bin").stat().st_size
    assert full == 2 * 70
    job = {"algorithm": {"name": "pt"}, "model": {"path": str(HF_CONFIGS / "qwen2_5_0_5b")},
           "data": {"train_files": [str(prefix)], "seq_length": 8},
           "trainer": {"global_batch_size": 2, "micro_batch_size": 1}}
    path = write_job(job)
    with open(f"{prefix}.bin", "r+b") as f:
        f.truncate(100)
    code, out = _guarded(lambda: commands.validate(path, []), capsys)
    assert code == 2 and "Traceback" not in out
    assert _problem_lines(out) == [
        f"data.train_files.0: {prefix}.bin is truncated: its index {prefix}.idx needs {full} bytes, the file has "
        "100; copy it again (a transfer cut short?) or preprocess the dataset again"]
    with pytest.raises(UserError) as exc:  # the workers' reader says the same
        read_indexed(str(prefix), eos=0, vocab_size=None)
    assert _one_line(exc).startswith(f"{prefix}.bin is truncated: ")


# --- 5: the config file and its overrides ---------------------------------------------------------


def test_deeply_nested_yaml_is_one_line(tmp_path, capsys):
    deep = tmp_path / "deep.yaml"
    deep.write_text("trainer:\n  x: " + "[" * 5000 + "]" * 5000 + "\n")
    code, out = _guarded(lambda: commands.validate(deep, []), capsys)
    assert code == 2 and "Traceback" not in out and "RecursionError" not in out
    assert out.strip() == (f"error: {deep}:2: mappings and lists nest more than {MAX_DEPTH} levels deep; a job "
                           "config is a few levels deep: look for unclosed brackets")
    nested = tmp_path / "nested.yaml"
    nested.write_text("".join("  " * i + f"k{i}:\n" for i in range(3000)))
    code, out = _guarded(lambda: commands.validate(nested, []), capsys)
    assert code == 2 and out.strip().startswith(f"error: {nested}:{MAX_DEPTH + 1}: mappings and lists nest more")


def test_deep_override_value_blames_the_override(small_job, write_job):
    item = "trainer.x=" + "[" * 3000 + "]" * 3000
    with pytest.raises(ConfigError) as exc:
        load_config(write_job(small_job), [item])
    assert exc.value.problems == [f"override {item!r}: mappings and lists nest more than {MAX_DEPTH} levels deep; "
                                  "give a plain value"]


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n"])
def test_empty_config_says_it_is_empty(tmp_path, capsys, text):
    empty = tmp_path / "job.yaml"
    empty.write_text(text)
    code, out = _guarded(lambda: commands.validate(empty, []), capsys)
    assert code == 2
    assert out.strip() == (f"error: {empty}: the config file is empty; write the job's sections (model:, data:, "
                           "trainer:, ...), e.g. starting from configs/quickstart.yaml")


def test_config_naming_a_folder_says_so(tmp_path, capsys):
    (tmp_path / "sft.yaml").write_text("model: {}\n")
    code, out = _guarded(lambda: commands.validate(tmp_path, []), capsys)
    assert code == 2
    assert out.strip() == f"error: --config: {tmp_path} is a folder, not a config file; pass the job's YAML file (it holds sft.yaml)"


def test_override_errors_blame_the_override(small_job, write_job):
    small_job["trainer"]["total_steps"] = 5  # a YAML line the override turns into a mapping
    path = write_job(small_job)
    with pytest.raises(ConfigError) as exc:
        load_config(path, ["trainer.total_steps.x=1"])
    [problem] = exc.value.problems
    assert problem.startswith("trainer.total_steps: ") and problem.endswith("(<override 1>: trainer.total_steps.x=1)")
    assert f"{path}:" not in problem
    with pytest.raises(ConfigError) as exc:
        load_config(path, ["trainer.total_steps"])
    assert exc.value.problems == ["override 'trainer.total_steps': must look like dotted.key=value"]


# --- 6: the tokenizer's vocabulary against the model's embedding ----------------------------------


def _model_with_vocab(tmp_path: Path, vocab_size: int) -> Path:
    model = tmp_path / "model"
    shutil.copytree(HF_CONFIGS / "qwen2_5_0_5b", model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "vocab_size": vocab_size}))
    return model


def test_tokenizer_larger_than_the_embedding_is_refused(small_job, write_job, tmp_path, capsys):
    model = _model_with_vocab(tmp_path, 200)  # the fixture's tokenizer has 259 tokens
    small_job["model"]["path"] = str(model)
    code, out = _guarded(lambda: commands.validate(write_job(small_job), []), capsys)
    assert code == 2 and "Traceback" not in out
    assert _problem_lines(out) == [
        f"model.path: {model} has vocab_size 200 (config.json), but its tokenizer has 259 tokens, so ids 200..258 "
        "would index past the embedding; use the tokenizer the model was made with, or a model whose vocab_size is "
        "at least the tokenizer's"]
    small_job["model"]["path"] = str(_model_with_vocab(tmp_path / "ok", 259))  # equal is fine
    assert run_guarded(lambda: commands.validate(write_job(small_job), []), debug=False) == 0


def test_tokenizer_size_is_what_transformers_loads(tiny_model):
    from transformers import AutoTokenizer

    from trinity.data.loader import tokenizer_size

    assert tokenizer_size(tiny_model) == len(AutoTokenizer.from_pretrained(str(tiny_model))) == 259


# --- 7: a prompt longer than the model's context --------------------------------------------------


def test_fit_prompts_refuses_or_truncates():
    from trinity.cli.generate import fit_prompts

    ids = [list(range(10)), [1, 2]]
    with pytest.raises(UserError) as exc:
        fit_prompts(ids, context=8, max_new_tokens=3, truncate=None, source="m/config.json")
    assert _one_line(exc).startswith("--prompt: prompt 1 is 10 tokens, but the model's context is 8 tokens "
                                     "(max_position_embeddings in m/config.json) and --max-new-tokens 3 leaves 5 ")
    assert fit_prompts(ids, context=8, max_new_tokens=3, truncate="left", source="") == [[5, 6, 7, 8, 9], [1, 2]]
    assert fit_prompts(ids, context=8, max_new_tokens=3, truncate="right", source="") == [[0, 1, 2, 3, 4], [1, 2]]
    with pytest.raises(UserError, match=r"^--max-new-tokens: 8 new tokens leave no room"):
        fit_prompts(ids, context=8, max_new_tokens=8, truncate="left", source="")


def test_generate_refuses_a_prompt_past_the_context_before_building_the_model(tiny_model, capsys):
    from trinity.cli import generate

    t0 = time.monotonic()
    code, out = _guarded(lambda: generate.run(tiny_model, ["1+1=" * 25_000], chat=False, max_new_tokens=16,
                                              temperature=0.0, top_p=1.0, seed=0, device="cpu"), capsys)
    assert code == 2 and "Traceback" not in out
    assert out.strip() == (
        f"error: --prompt: prompt 1 is 100000 tokens, but the model's context is 1024 tokens (max_position_embeddings "
        f"in {tiny_model / 'config.json'}) and --max-new-tokens 16 leaves 1008 for the prompt; shorten it, lower "
        "--max-new-tokens, or pass --truncate-prompt left (keep its end) or right (keep its start)")
    assert time.monotonic() - t0 < 60  # not minutes of decoding
    code, out = _guarded(lambda: generate.run(tiny_model, ["hi"], chat=False, max_new_tokens=4, temperature=0.0,
                                              top_p=1.0, seed=0, device="cpu", truncate_prompt="middle"), capsys)
    assert code == 2 and out.strip() == "error: --truncate-prompt: 'middle' is not one of left, right"


# --- 8: a run never writes into a folder of files no trinity run wrote -----------------------------


def _cpu_job(small_job: dict, out: Path) -> dict:
    small_job["cluster"] = {"device": "cpu", "nproc_per_node": 1}
    small_job["trainer"].update(output_dir=str(out), global_batch_size=2)
    return small_job


def test_foreign_output_dir_is_refused_unless_force(small_job, write_job, tmp_path, capsys):
    out = tmp_path / "home"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    (out / "data").mkdir()
    path = write_job(_cpu_job(small_job, out))
    code, text = _guarded(lambda: commands.run(path, [], dry_run=True), capsys)
    assert code == 2 and "Traceback" not in text and "command:" not in text
    [line] = [x for x in text.splitlines() if x.startswith("error")]
    assert line == (f"error: trainer.output_dir: {out} holds files no trinity run wrote (data, thesis.tex); choose a "
                    "new or empty folder, or pass --force to write into it (files of the same name would be replaced)")
    code, text = _guarded(lambda: commands.run(path, [], dry_run=True, force=True), capsys)
    assert code == 0 and "command:" in text


def test_new_empty_and_trinity_folders_are_accepted(tmp_path):
    from trinity.launch.ownership import RUN_MARKER, check_ownership, mark_run

    check_ownership(tmp_path / "new", force=False)
    (tmp_path / "empty").mkdir()
    check_ownership(tmp_path / "empty", force=False)
    legacy = tmp_path / "legacy"  # a run of a version without the marker: its resolved config
    (legacy / "checkpoints" / "step_2").mkdir(parents=True)
    (legacy / "resolved_config.yaml").write_text("trainer: {}\n")
    check_ownership(legacy, force=False)
    copied = tmp_path / "copied"  # a complete checkpoint copied in to resume from
    (copied / "checkpoints" / "step_4").mkdir(parents=True)
    (copied / "checkpoints" / "step_4" / "complete").write_text("{}")
    check_ownership(copied, force=False)
    (copied / "checkpoints" / "step_4" / "complete").unlink()  # an incomplete one says nothing
    with pytest.raises(UserError, match=r"holds files no trinity run wrote \(checkpoints\)"):
        check_ownership(copied, force=False)
    starting = tmp_path / "starting"  # a run that holds the lock, before its marker
    starting.mkdir()
    (starting / ".trinity.lock").write_text("{}")
    check_ownership(starting, force=False)
    marked = tmp_path / "marked"
    marked.mkdir()
    mark_run(marked)
    first = (marked / RUN_MARKER).read_text()
    mark_run(marked)  # a second run keeps the first one's marker
    assert (marked / RUN_MARKER).read_text() == first and json.loads(first)["tool"] == "trinity-mcore"
    (marked / "metrics.jsonl").write_text("{}\n")
    check_ownership(marked, force=False)


def test_a_run_marks_its_folder_and_a_rerun_resumes_there(small_job, write_job, tmp_path, capsys, monkeypatch):
    """The marker is written once the lock is held; the interrupted run's folder (marker, logs,
    checkpoints) is accepted for the next run, which resumes from it."""
    from trinity.launch import torchrun
    from trinity.launch.ownership import RUN_MARKER

    out = tmp_path / "run"
    path = write_job(_cpu_job(small_job, out))
    seen: list[list[str]] = []

    def interrupted_job(cmd, **_kw) -> int:  # what a job leaves: logs and a checkpoint
        seen.append(sorted(p.name for p in out.iterdir()))
        (out / "logs").mkdir(exist_ok=True)
        (out / "checkpoints" / "step_1").mkdir(parents=True, exist_ok=True)
        (out / "checkpoints" / "step_1" / "complete").write_text("{}")
        return 130

    monkeypatch.setattr(commands, "prepare_weights", lambda loaded, out, **_kw: None)
    monkeypatch.setattr(torchrun, "supervise", interrupted_job)
    monkeypatch.setattr(torchrun, "preflight", lambda cfg: None)
    assert run_guarded(lambda: commands.run(path, []), debug=False) == 130
    assert seen == [sorted([".trinity.lock", RUN_MARKER, "resolved_config.yaml"])]
    (out / "resolved_config.yaml").unlink()  # even without it, the marker says whose folder this is
    assert run_guarded(lambda: commands.run(path, []), debug=False) == 130
    assert len(seen) == 2 and "checkpoints" in seen[1]
    capsys.readouterr()


def test_run_help_and_docs_name_force():
    from typer.testing import CliRunner

    from trinity.cli.main import app

    result = CliRunner().invoke(app, ["run", "--help"])
    assert "--force" in result.output
    assert "--force" in (REPO / "README.md").read_text() and "--truncate-prompt" in (REPO / "README.md").read_text()
