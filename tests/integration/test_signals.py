"""Ctrl-C (SIGINT) and SIGTERM stop a real `trinity run` at every stage: the weight conversion, the launch,
training and the HF export. Each stop exits with 128 + the signal, prints the `interrupted` line, and
leaves no process of the job (checked by pid and process group) and no temporary folder. A `trinity
convert` killed with -9 mid-save takes its conversion and writer processes along, and its temporary
folder is removed when the next conversion into that output starts.

One small model for all (4 layers, hidden 512: its export writes for ~0.1 s, long enough to be caught
in the act), converted once; the runs after the conversion stage start from that conversion, as a
user's second run in one output folder does.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, trinity_run_argv
from tests.integration.test_process_trust import _alive, _describe

pytestmark = pytest.mark.slow

TEMP = re.compile(r"^\..+\.(tmp|old|build)-")  # trinity's temporary folders (trinity.convert.outdir)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    from trinity.convert.api import hf_to_mcore
    from trinity.convert.cache import entry_key
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer, write_sft_dataset

    root = tmp_path_factory.mktemp("signals")
    tok = make_tiny_tokenizer(root / "tokenizer")
    model = make_tiny_qwen2(root / "model", tok, num_layers=4, hidden_size=512, num_heads=4, num_kv_heads=2)
    data = write_sft_dataset(root / "sft.jsonl", 64, seed=0)
    cfg = {
        "algorithm": {"name": "sft"},
        "model": {"path": str(model)},
        "data": {"train_files": [str(data)], "seq_length": 32, "packing": True},
        "cluster": {"device": "cpu", "nproc_per_node": 1},
        "trainer": {"total_steps": 100000, "global_batch_size": 1, "micro_batch_size": 1, "save_interval": 100000,
                    "save_last": False, "log_interval": 1, "tensorboard": False, "export_hf": True},
    }
    (root / "job.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    # what `trinity run` would convert (fp32 on CPU), in a conversion cache under the name it gives it
    hf_to_mcore(str(model), str(root / "cache" / entry_key(model, "fp32")), dtype="fp32")
    return root


def _temps(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.rglob(".*") if TEMP.match(p.name))


def _job_processes(cli: int) -> dict[int, int]:
    """pid -> process group of every process below the CLI now."""
    import psutil

    found = {}
    for p in psutil.Process(cli).children(recursive=True):
        try:
            found[p.pid] = os.getpgid(p.pid)
        except ProcessLookupError:
            pass
    return found


def _group_alive(pgid: int) -> bool:
    from trinity.launch.child import group_alive

    return group_alive(pgid)


def _wait(predicate, what: str, proc: subprocess.Popen, log: Path, timeout_s: float = 300, poll_s: float = 0.005):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"the CLI ended ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s:\n{log.read_text()[-3000:]}"
        time.sleep(poll_s)


def _running(cli: int, module: str) -> bool:
    """Whether a process below the CLI runs `python -m <module>`."""
    import psutil

    for p in psutil.Process(cli).children(recursive=True):
        try:
            if f"-m {module} " in " ".join(p.cmdline()):
                return True
        except psutil.Error:
            pass
    return False


# How a test knows the job is at a stage: the conversion's child process runs; the launcher runs (the
# worker is starting); a training step is logged; the export's temporary folder exists.
STAGES = {
    "conversion": lambda out, cli, log: _running(cli, "trinity.convert.worker"),
    "launch": lambda out, cli, log: _running(cli, "trinity.launch.single"),
    "training": lambda out, cli, log: "[default0]:step 1/" in log.read_text(),
    "export": lambda out, cli, log: any(p.name.startswith((".hf.tmp-", ".hf.old-")) for p in out.iterdir()),
}


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_every_stage(workdir, stage, sig):
    name = f"{stage}_{sig.name}"
    out = workdir / f"run_{name}"
    overrides = [f"trainer.output_dir={out}"]
    if stage == "export":
        overrides.append("trainer.total_steps=2")
    # The conversion stage converts into an empty cache of its own (a shared one may hold the model from
    # another test, and then there is no conversion to stop); the launch and later start from the
    # conversion the fixture cached, as a user's later runs of the model do.
    cache = workdir / (f"cache_{name}" if stage == "conversion" else "cache")
    log = workdir / f"{name}.out"
    with log.open("w") as console:
        cli = subprocess.Popen(trinity_run_argv(workdir / "job.yaml", *overrides), cwd=REPO, stdin=subprocess.DEVNULL,
                               stdout=console, stderr=subprocess.STDOUT,
                               env={**os.environ, "TRINITY_MCORE_CACHE": str(cache)})
    procs: dict[int, int] = {}
    try:
        _wait(lambda: out.is_dir() and STAGES[stage](out, cli.pid, log), f"the {stage} stage", cli, log)
        procs = _job_processes(cli.pid)
        cli.send_signal(sig)
        cli.wait(timeout=60)
    finally:
        if cli.poll() is None:  # the test failed: end what it started, by pid
            cli.kill()
            cli.wait()
        for pid in procs:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    assert cli.returncode == 128 + sig, text[-3000:]
    assert re.search(r"^interrupted; (no complete checkpoint|the last complete checkpoint)", text, re.M), text[-3000:]
    assert procs, "the job had no process to stop"
    left = [pid for pid in procs if _alive(pid)]
    assert not left, f"processes of the job outlived the CLI: {_describe(left)}"
    groups = sorted({g for g in procs.values() if _group_alive(g)})
    assert not groups, f"process groups of the job still have processes: {groups}"
    assert _temps(out) == [], text[-3000:]
    if stage == "conversion":  # the cache keeps neither a half-made entry nor its work folder
        assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [], text[-3000:]
    if stage == "export":
        assert "exported HF model" not in text and not (out / "hf").exists(), text[-3000:]


def _threads(pid: int) -> int:
    import psutil

    try:
        return psutil.Process(pid).num_threads()
    except psutil.Error:
        return 0


def _writers(cli: int) -> list[int]:
    """The conversion process below the CLI and the checkpoint writers it forked, once there are writers."""
    import psutil

    for p in psutil.Process(cli).children(recursive=True):
        try:
            if "-m trinity.convert.worker " in " ".join(p.cmdline()):
                writers = p.children()
                return [p.pid, *(w.pid for w in writers)] if writers else []
        except psutil.Error:
            pass
    return []


def _kill_convert_mid_write(argv: list[str], log: Path) -> tuple[list[int], list[int]] | None:
    """Start `argv` (a `trinity convert`), freeze its conversion process and writers once the writers run,
    kill -9 the CLI; (the frozen pids, those still alive 10 s later), or None when a writer ended before it
    could be frozen (a loaded machine: the save was over too soon to test)."""
    with log.open("w") as console:
        cli = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT)
    procs: list[int] = []
    try:
        _wait(lambda: bool(_writers(cli.pid)), "the checkpoint writer processes", cli, log, poll_s=0.002)
        procs = _writers(cli.pid)
        # A writer arms its parent-death signal in its at-fork hook before it starts its watchdog thread:
        # a second thread means it is armed (stopped before, it could never be killed by it).
        _wait(lambda: all(_threads(pid) != 1 for pid in procs[1:]), "the writers' at-fork hooks", cli, log)
        time.sleep(0.05)
        try:
            for pid in procs:
                os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            cli.kill()
            cli.wait(timeout=30)
            return None
        cli.kill()
        cli.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        return procs, [pid for pid in procs if _alive(pid)]
    finally:
        for pid in procs:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_killed_convert_takes_its_processes_along_and_its_folder_goes_at_the_next_start(workdir):
    """kill -9 of `trinity convert` while megatron-core's writer processes write: the conversion process
    and the writers die with it (parent-death signals; they are stopped with SIGSTOP first, so only a
    SIGKILL ends them), and the `.<output>.tmp-*` folder left is removed when the next `trinity convert`
    into that output starts."""
    for attempt in range(3):  # a writer that ends before it is frozen leaves nothing to test: again
        out = workdir / f"converted{attempt}"
        argv = [sys.executable, "-m", "trinity.cli.main", "convert", "hf-to-mcore", "--hf-path", str(workdir / "model"),
                "-o", str(out), "--dtype", "fp32"]
        log = workdir / f"convert_kill9_{attempt}.out"
        frozen = _kill_convert_mid_write(argv, log)
        if frozen is not None:
            break
    assert frozen is not None, "the writers ended before they could be frozen, 3 times"
    procs, left = frozen
    assert len(procs) >= 2 and not left, f"processes outlived the killed convert: {_describe(left)}"
    stale = [p for p in workdir.iterdir() if p.name.startswith(f".{out.name}.tmp-")]
    assert len(stale) == 1 and not out.exists(), (stale, log.read_text()[-3000:])

    again = subprocess.run(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:]
    assert (out / "trinity_meta.json").is_file()
    assert [p.name for p in workdir.iterdir() if p.name.startswith(f".{out.name}.")] == []
