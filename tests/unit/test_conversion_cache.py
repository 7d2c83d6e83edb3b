"""The shared conversion cache of `trinity run` (trinity.convert.cache, commands.prepare_weights): one
conversion per model and dtype, locked, atomic and size-bounded; and the finished-job record
(trinity.trainer.finished) that makes a second run of a finished job do nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from trinity.cli import commands
from trinity.convert import cache

REPO = Path(__file__).resolve().parents[2]


def _job(model: Path, out: Path) -> dict:
    return {
        "model": {"path": str(model)},
        "data": {"train_files": [str(REPO / "tests" / "fixtures" / "data" / "sft.jsonl")], "seq_length": 64},
        "cluster": {"device": "cpu", "nproc_per_node": 1},
        "trainer": {"global_batch_size": 2, "micro_batch_size": 1, "total_steps": 2, "output_dir": str(out)},
    }


def _loaded(tmp_path: Path, job: dict, name: str):
    from trinity.config.loader import load_config

    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return load_config(path, [])


def test_two_output_folders_convert_once_and_no_cache_converts_into_the_run(tmp_path, monkeypatch, capsys):
    """The tiny model, converted for real: the second output folder reuses the first one's conversion
    (same files, untouched), `--no-cache` converts into <output_dir>/mcore_cache; the workers' resolved
    config gives the same job identity as the CLI's (trinity.trainer.finished)."""
    from trinity.config.schema import JobConfig
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer
    from trinity.trainer.finished import job_identity

    monkeypatch.setenv("TRINITY_MCORE_CACHE", str(tmp_path / "cache"))
    tok = make_tiny_tokenizer(tmp_path / "tokenizer")
    model = make_tiny_qwen2(tmp_path / "model", tok, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    key = cache.entry_key(model, "fp32")
    entry = tmp_path / "cache" / key

    first = _loaded(tmp_path, _job(model, tmp_path / "run1"), "a")
    identity = job_identity(first.config.model_dump(mode="json"))
    held = commands.prepare_weights(first, tmp_path / "run1")
    text = capsys.readouterr().out
    assert held.path == entry and held.converted
    assert f"converting {model} to a megatron-core checkpoint in {entry}" in text
    meta = os.stat(entry / "trinity_meta.json")
    held.release()

    second = _loaded(tmp_path, _job(model, tmp_path / "run2"), "b")
    again = commands.prepare_weights(second, tmp_path / "run2")
    text = capsys.readouterr().out
    again.release()
    assert again.path == entry and not again.converted
    assert text.strip() == f"using the cached megatron-core checkpoint {entry}"
    after = os.stat(entry / "trinity_meta.json")
    assert (after.st_ino, after.st_mtime_ns) == (meta.st_ino, meta.st_mtime_ns)
    for loaded in (first, second):
        m = loaded.config.actor_rollout_ref.actor.megatron
        assert m.use_dist_checkpointing and m.dist_checkpointing_path == str(entry)
    assert not (tmp_path / "run1" / "mcore_cache").exists() and not (tmp_path / "run2" / "mcore_cache").exists()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [key, f"{key}.lock"]

    resolved = tmp_path / "resolved.yaml"
    commands.write_resolved(second.config, resolved)
    workers = JobConfig.model_validate(yaml.safe_load(resolved.read_text()))
    assert job_identity(workers.model_dump(mode="json")) == identity

    # --no-cache: into the run's folder, where a converter of this host killed outright left a half-written copy.
    from trinity.convert.outdir import _host

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = tmp_path / "run3" / "mcore_cache" / f".{key}.tmp-{_host()}-{dead.stdout.strip()}-0123abcd"
    leftover.mkdir(parents=True)
    third = _loaded(tmp_path, _job(model, tmp_path / "run3"), "c")
    assert commands.prepare_weights(third, tmp_path / "run3", no_cache=True) is None
    own = tmp_path / "run3" / "mcore_cache" / key
    assert f"converting {model} to a megatron-core checkpoint in {own}" in capsys.readouterr().out
    assert cache.is_complete(own) and third.config.actor_rollout_ref.actor.megatron.dist_checkpointing_path == str(own)
    assert [p.name for p in own.parent.iterdir()] == [key]


def test_multi_node_jobs_convert_into_the_shared_output_folder(small_job):
    from trinity.config.schema import JobConfig

    small_job["trainer"]["output_dir"] = "/tmp/x"
    cfg = JobConfig.model_validate(small_job)
    assert commands.conversion_home(cfg, no_cache=False) == "cache"
    assert commands.conversion_home(cfg, no_cache=True) == "run"
    two = JobConfig.model_validate({**small_job, "cluster": {**small_job["cluster"], "nnodes": 2, "nproc_per_node": 4}})
    assert commands.conversion_home(two, no_cache=False) == "run"


def _write_entry(size: int = 100):
    """A builder writing a checkpoint-shaped folder of `size` bytes (the cache only moves folders)."""

    def build(dest: Path) -> None:
        dest.mkdir()
        (dest / "data.distcp").write_bytes(b"x" * size)
        (dest / cache.META).write_text("{}")

    return build


# A converter process: takes the entry of argv[2] in cache argv[1], its build writing a partial file
# then waiting for argv[3] to appear (or forever).
CONVERTER = """
import sys, time
from pathlib import Path
from trinity.convert import cache

def build(dest):
    dest.mkdir()
    (dest / "data.distcp").write_bytes(b"half")
    while not Path(sys.argv[3]).exists():
        time.sleep(0.05)
    (dest / cache.META).write_text("{}")

held = cache.use_entry(Path(sys.argv[1]), sys.argv[2], build)
print("converted" if held.converted else "reused", held.path, flush=True)
"""


def _converter(root: Path, key: str, go: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CONVERTER, str(root), key, str(go)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.time() + 60
    while not path.exists():
        assert proc.poll() is None and time.time() < deadline, "the converter never started building"
        time.sleep(0.05)


KEY = "0123456789abcdef-fp32-c1"


def test_a_second_job_waits_for_the_converter_and_reuses_its_entry(tmp_path):
    root, go = tmp_path / "cache", tmp_path / "go"
    proc = _converter(root, KEY, go)
    try:
        _wait_for(root / f".{KEY}.tmp" / "ckpt" / "data.distcp", proc)
        said, built, got = [], [], []
        waiter = threading.Thread(target=lambda: got.append(cache.use_entry(root, KEY, built.append, say=said.append)))
        waiter.start()
        deadline = time.time() + 30
        while not said and time.time() < deadline:
            time.sleep(0.05)
        assert said == [f"waiting for another trinity job that is converting into {root / KEY}"]
        assert not got  # still waiting: the entry is not complete
        go.touch()
        waiter.join(timeout=60)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert out.split() == ["converted", str(root / KEY)]
    (held,) = got
    assert held.path == root / KEY and not held.converted and built == []
    assert (root / KEY / "data.distcp").read_bytes() == b"half"
    held.release()


def test_a_killed_converters_lock_and_half_written_entry_are_recovered(tmp_path):
    root = tmp_path / "cache"
    proc = _converter(root, KEY, tmp_path / "never")
    _wait_for(root / f".{KEY}.tmp" / "ckpt" / "data.distcp", proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (root / KEY).exists()  # the half-written conversion never became the entry
    # A damaged entry (no metadata) beside it is not used either.
    (tmp_path / "damaged").mkdir()
    os.rename(tmp_path / "damaged", root / KEY)

    got: list = []
    worker = threading.Thread(target=lambda: got.append(cache.use_entry(root, KEY, _write_entry(7))))
    worker.start()
    worker.join(timeout=30)
    assert got, "the dead converter's lock was not recovered"
    assert got[0].converted and (root / KEY / "data.distcp").read_bytes() == b"x" * 7
    assert sorted(p.name for p in root.iterdir()) == [KEY, f"{KEY}.lock"]
    got[0].release()


def test_cleanup_removes_least_recently_used_entries_but_never_one_in_use(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    keys = [f"{i:016x}-bf16-c1" for i in range(4)]
    held = []
    for i, key in enumerate(keys):
        h = cache.use_entry(root, key, _write_entry(1000))
        os.utime(root / key, (1000 + i, 1000 + i))  # keys[0] least recently used
        held.append(h)
    for h in held[1:]:
        h.release()
    (root / f".{keys[3]}.tmp").mkdir()  # a dead conversion's leftovers
    monkeypatch.setenv("TRINITY_MCORE_CACHE_GB", "0.0000025")  # 2500 bytes: room for two entries
    assert cache.bound_bytes() == 2500

    removed = cache.clean(root, cache.bound_bytes())
    # keys[0] is the oldest but in use: keys[1] and keys[2] go, keys[3] (newest) stays.
    assert [(p.name, size) for p, size in removed] == [(keys[1], 1002), (keys[2], 1002)]
    assert sorted(p.name for p in root.iterdir()) == sorted([keys[0], f"{keys[0]}.lock", keys[3], f"{keys[3]}.lock"])
    held[0].release()
    assert [p.name for p, _ in cache.clean(root, 1500)] == [keys[0]]  # no longer in use
    assert cache.clean(root, 0) and sorted(p.name for p in root.iterdir()) == []

    monkeypatch.setenv("TRINITY_MCORE_CACHE_GB", "lots")
    with pytest.raises(Exception, match="TRINITY_MCORE_CACHE_GB: 'lots' is not a number of GB"):
        cache.bound_bytes()


def test_cache_location_honours_trinity_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("TRINITY_MCORE_CACHE", raising=False)
    monkeypatch.setenv("TRINITY_CACHE", str(tmp_path / "c"))
    assert cache.mcore_cache_dir() == tmp_path / "c" / "mcore"
    monkeypatch.setenv("TRINITY_MCORE_CACHE", str(tmp_path / "m"))
    assert cache.mcore_cache_dir() == tmp_path / "m"


def _finished(small_job: dict, out: Path, write_job) -> tuple[Path, object]:
    """A job config (path, JobConfig) whose run in `out` finished: its record, checkpoint and export."""
    from trinity.config.loader import load_config
    from trinity.trainer.finished import write_done

    small_job["cluster"] = {"device": "cpu", "nproc_per_node": 1}
    small_job["trainer"].update(output_dir=str(out), global_batch_size=2, total_steps=4)
    path = write_job(small_job)
    cfg = load_config(path, []).config
    (out / "checkpoints" / "step_4").mkdir(parents=True)
    (out / "checkpoints" / "step_4" / "complete").write_text("{}")
    (out / "hf").mkdir()
    (out / "hf" / "config.json").write_text("{}")
    write_done(out, config=cfg.model_dump(mode="json"), step=4, checkpoint=out / "checkpoints" / "step_4",
               exports=[out / "hf"])
    return path, cfg


def test_a_finished_job_runs_again_as_one_line_and_nothing_else(small_job, write_job, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    path, _ = _finished(small_job, out, write_job)
    before = sorted(p.name for p in out.iterdir())
    assert commands.run(path, []) == 0
    text = capsys.readouterr().out
    assert text.splitlines() == [
        f"job already complete: {out} trained all 4 steps (checkpoint {out / 'checkpoints' / 'step_4'}, export {out / 'hf'}); "
        "nothing to run (raise trainer.total_steps to train on, or use a new trainer.output_dir to start over)"]
    assert sorted(p.name for p in out.iterdir()) == before  # no lock, resolved config, conversion or logs


def test_a_finished_job_is_run_again_when_anything_differs(small_job, write_job, tmp_path):
    from trinity.trainer.finished import complete_line

    out = tmp_path / "run"
    out.mkdir()
    _, cfg = _finished(small_job, out, write_job)
    assert complete_line(out, cfg) is not None
    longer = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"total_steps": 8})})
    assert complete_line(out, longer) is None
    fresh = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"resume": "disable"})})
    assert complete_line(out, fresh) is None
    (out / "hf" / "config.json").unlink()
    assert complete_line(out, cfg) is None  # the export is gone: the run re-exports it


def test_run_help_and_docs_name_no_cache():
    from typer.testing import CliRunner

    from trinity.cli.main import app

    result = CliRunner().invoke(app, ["run", "--help"])
    assert "--no-cache" in result.output
    for doc in ("README.md", "docs/conversion.md", "docs/quickstart.md"):
        text = (REPO / doc).read_text()
        assert "--no-cache" in text and "~/.cache/trinity/mcore/" in text, doc
    assert "TRINITY_MCORE_CACHE_GB" in (REPO / "docs" / "conversion.md").read_text()
