"""Issue 19: bad inputs get one line naming the key or file (exit 2), a job never writes into an output
folder another job holds, and an interrupt is not reported as a rank failure."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from trinity.cli import commands
from trinity.cli.report import run_guarded
from trinity.config.loader import load_config
from trinity.errors import ConfigError, UserError
from trinity.launch import lock as outlock


def _guarded(fn, capsys) -> tuple[int, str]:
    code = run_guarded(fn, debug=False)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


# --- 9: YAML and overrides -----------------------------------------------------------------------

def test_duplicate_key_is_refused_naming_both_lines(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text("trainer:\n  total_steps: 5\n  log_interval: 1\n  total_steps: 50\n")
    code, out = _guarded(lambda: commands.validate(path, []), capsys)
    assert code == 2
    assert f"{path}:4: key 'total_steps' appears twice in one mapping (lines 2 and 4)" in out
    assert "internal error" not in out


def test_duplicate_key_inside_an_override_value(small_job, write_job):
    with pytest.raises(ConfigError) as exc:
        load_config(write_job(small_job), ["trainer={total_steps: 1, total_steps: 2}"])
    assert exc.value.problems == ["trainer: key 'total_steps' appears twice in one mapping (lines 1 and 1); keep one "
                                  "(<override 1>: trainer={total_steps: 1, total_steps: 2})"]


def test_a_bad_override_is_blamed_on_the_override_not_the_yaml_line(small_job, write_job):
    small_job["trainer"]["total_steps"] = 10  # on a YAML line, replaced by the override
    path = write_job(small_job)
    with pytest.raises(ConfigError) as exc:
        load_config(path, ["trainer.log_interval=1", "trainer.total_steps=0"])
    [problem] = exc.value.problems
    assert problem == "trainer.total_steps: Input should be greater than or equal to 1 (got 0) (<override 2>: trainer.total_steps=0)"
    # A bad value from the file is still blamed on its line.
    small_job["trainer"]["total_steps"] = 0
    with pytest.raises(ConfigError) as exc:
        load_config(write_job(small_job), [])
    assert exc.value.problems[0].startswith("trainer.total_steps: ") and f"({path}:" in exc.value.problems[0]


def test_validate_json_prints_json_on_errors(small_job, write_job, capsys):
    path = write_job(small_job)
    code, _ = _guarded(lambda: commands.validate(path, ["trainer.total_steps=abc"], json_out=True), capsys)
    assert code == 2
    code = run_guarded(lambda: commands.validate(path, ["trainer.total_steps=abc"], json_out=True), debug=False)
    out = capsys.readouterr().out
    answer = json.loads(out)  # the whole of stdout is one JSON document
    assert code == 2 and answer["ok"] is False
    assert answer["problems"] == ["trainer.total_steps: Input should be a valid integer, unable to parse string as "
                                  "an integer (got 'abc') (<override 1>: trainer.total_steps=abc)"]
    # A user error outside the config's keys (a missing file) is JSON too.
    code = run_guarded(lambda: commands.validate(path.with_name("nope.yaml"), [], json_out=True), debug=False)
    answer = json.loads(capsys.readouterr().out)
    assert code == 2 and answer == {"ok": False, "problems": [f"{path.with_name('nope.yaml')}: config file not found"]}


# --- 8: unreadable inputs and unusable output folders ---------------------------------------------

def test_non_utf8_config_file_is_named(tmp_path, capsys):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("trainer:\n  output_dir: caf\u00e9\n".encode("latin-1"))
    code, out = _guarded(lambda: commands.validate(path, []), capsys)
    assert code == 2
    assert f"error: {path}:2: the config file is not UTF-8 text (byte 0xe9); save it as UTF-8" in out


def test_output_dir_under_a_file_is_a_config_error(small_job, write_job, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    small_job["trainer"]["output_dir"] = str(blocker / "run")
    code, out = _guarded(lambda: commands.validate(write_job(small_job), []), capsys)
    assert code == 2
    assert f"trainer.output_dir: cannot create {blocker / 'run'}: {blocker} is a file, not a folder" in out
    small_job["trainer"]["output_dir"] = str(blocker)
    code, out = _guarded(lambda: commands.validate(write_job(small_job), []), capsys)
    assert code == 2 and f"trainer.output_dir: {blocker} is a file, not a folder; choose a folder path" in out


def test_read_only_output_dir_is_named(small_job, write_job, tmp_path):
    """A real read-only mount: a tmpfs mounted `ro` in a private mount namespace (needs root)."""
    import shutil

    ro = tmp_path / "ro"
    ro.mkdir()
    job = write_job(small_job)
    validate = f"{sys.executable} -m trinity.cli.main validate -c {job} trainer.output_dir={ro / 'run'}"
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    out = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o ro none {ro} && {validate}"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    if "mount" in out.stderr and out.returncode != 2:
        pytest.skip(f"cannot mount a read-only file system here: {out.stderr.strip()}")
    assert out.returncode == 2, out.stderr
    assert (f"trainer.output_dir: {ro} is on a read-only file system; choose a folder on a "
            f"writable disk") in out.stderr


def test_prepare_output_dir_names_the_key_and_reason(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(UserError, match=r"^trainer.output_dir: cannot create .*a_file/run: Not a directory; "):
        outlock.prepare_output_dir(blocker / "run")
    with pytest.raises(UserError, match=r"^trainer.output_dir: .*a_file is a file, not a folder"):
        outlock.prepare_output_dir(blocker)


def test_tiny_assets_into_a_file_is_refused(tmp_path):
    target = tmp_path / "a_file"
    target.write_text("x")
    out = subprocess.run([sys.executable, "-m", "trinity.cli.main", "tiny-assets", str(target)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == f"error: tiny-assets OUTPUT: {target} is a file, not a folder; choose a folder path"


# --- 5: one job per output folder ---------------------------------------------------------------

_HOLDER = """
import sys, time
from pathlib import Path
from trinity.launch.lock import acquire
lock = acquire(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(120)
"""


def _hold(out: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_second_job_is_refused_naming_holder_and_dead_holders_lock_is_reclaimed(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    holder = _hold(out)
    try:
        with pytest.raises(UserError) as exc:
            outlock.acquire(out)
        assert str(exc.value) == (
            f"trainer.output_dir: {out} is in use by another trinity run (pid {holder.pid} on "
            f"{socket.gethostname()}); wait for it to end or choose another trainer.output_dir")
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # Killed with -9: its lock file is still there, naming a dead pid, and the next job takes it.
    assert str(holder.pid) in (out / outlock.LOCK_FILE).read_text()
    with outlock.acquire(out) as lock:
        assert json.loads((out / outlock.LOCK_FILE).read_text())["pid"] == os.getpid()
        assert lock.flocked
    assert not (out / outlock.LOCK_FILE).exists()  # a job that ends removes it


def test_lock_name_per_node():
    from trinity.config.schema import ClusterConfig

    assert outlock.lock_name(ClusterConfig()) == ".trinity.lock"
    assert outlock.lock_name(ClusterConfig(nnodes=2, node_rank=0)) == ".trinity.lock"
    assert outlock.lock_name(ClusterConfig(nnodes=2, node_rank=1)) is None  # node 0 holds the job's lock
    assert outlock.lock_name(ClusterConfig(nnodes=2, rdzv_endpoint="h:1")) == f".trinity.lock.{socket.gethostname()}"


@pytest.fixture(scope="module")
def tiny_job_assets(tmp_path_factory) -> dict[str, Path]:
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer, write_sft_dataset

    root = tmp_path_factory.mktemp("trust_assets")
    tok = make_tiny_tokenizer(root / "tokenizer")
    model = make_tiny_qwen2(root / "model", tok, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2)
    return {"model": model, "data": write_sft_dataset(root / "sft.jsonl", 50, seed=0)}


def test_job_refused_for_a_held_output_dir_writes_nothing_there(tiny_job_assets, tmp_path, capsys):
    """3 + 5: job B, refused because job A holds the folder, leaves A's files as they were."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "resolved_config.yaml").write_text("# job A\n")
    before = sorted(p.name for p in out.iterdir())
    cfg = {
        "model": {"path": str(tiny_job_assets["model"])},
        "data": {"train_files": [str(tiny_job_assets["data"])], "seq_length": 64},
        "cluster": {"device": "cpu", "nproc_per_node": 1},
        "trainer": {"total_steps": 1, "global_batch_size": 2, "micro_batch_size": 1, "output_dir": str(out),
                    "save_interval": None, "export_hf": False, "tensorboard": False},
    }
    job = tmp_path / "b.yaml"
    job.write_text(yaml.safe_dump(cfg))
    holder = _hold(out)
    try:
        code, text = _guarded(lambda: commands.run(job, []), capsys)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert code == 2, text
    assert f"error: trainer.output_dir: {out} is in use by another trinity run (pid {holder.pid} on" in text
    assert (out / "resolved_config.yaml").read_text() == "# job A\n"
    assert sorted(p.name for p in out.iterdir()) == sorted([*before, outlock.LOCK_FILE])  # no mcore_cache, logs


# --- 6 and 4: the supervisor -------------------------------------------------------------------

_TORCHRUN_REPORT = """W1125 13:17:31.134000 17559 site-packages/torch/distributed/elastic/agent/server/api.py:753] Received 15 death signal, shutting down workers
W1125 13:17:31.134000 17559 site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 17836 closing signal SIGTERM
Traceback (most recent call last):
  File "torch/distributed/run.py", line 1, in <module>
torch.distributed.elastic.multiprocessing.api.SignalException: Process 12 got signal: 15
"""


def test_relay_says_nothing_about_a_failed_rank_when_the_job_was_interrupted():
    from trinity.launch.torchrun import _relay_stderr

    out = io.StringIO()
    _relay_stderr(io.StringIO(_TORCHRUN_REPORT), out, False, {}, {"sig": signal.SIGINT})
    assert out.getvalue() == ""
    out = io.StringIO()  # a real failure still gets its line
    _relay_stderr(io.StringIO(_TORCHRUN_REPORT), out, False, {}, {"sig": None})
    assert "failed first" in out.getvalue() and "death signal" in out.getvalue()


# As torchrun 2.13 prints it (`torchrun --nproc-per-node 2` without OMP_NUM_THREADS), between two job lines.
_OMP_BANNER = """[default0]:a line

*****************************************
Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system being overloaded, please further tune the variable for optimal performance in your application as needed. 
*****************************************
[default0]:step 1/2 | loss 5.0

[default0]:after an empty line
"""


def test_relay_drops_torchruns_omp_banner_unless_debug():
    """14: the workers choose their threads themselves; torchrun's banner says otherwise."""
    from trinity.launch.torchrun import _relay_stderr

    out = io.StringIO()
    _relay_stderr(io.StringIO(_OMP_BANNER), out, False)
    assert out.getvalue() == "[default0]:a line\n[default0]:step 1/2 | loss 5.0\n\n[default0]:after an empty line\n"
    out = io.StringIO()
    _relay_stderr(io.StringIO(_OMP_BANNER), out, True)
    assert out.getvalue() == _OMP_BANNER


def test_interrupted_message_names_the_last_complete_checkpoint(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for step in (2, 4):
        (ckpts / f"step_{step}").mkdir(parents=True)
        (ckpts / f"step_{step}" / "complete").write_text("{}")
    (ckpts / "step_6.tmp").mkdir()  # being written when the job was stopped
    assert commands.interrupted_message(tmp_path) == (
        f"interrupted; the last complete checkpoint is {ckpts / 'step_4'} (step 4): run again with "
        f"trainer.resume=auto (the default) to continue from it")
    assert "no complete checkpoint" in commands.interrupted_message(tmp_path / "other")


_SUPERVISED = """
import json, sys
from trinity.launch.torchrun import supervise
sys.exit(supervise(json.loads(sys.argv[1]), grace_s=5))
"""


def test_supervise_forwards_sighup_and_passes_its_pid():
    """Closing the terminal (SIGHUP) stops the job like SIGTERM; the workers learn the CLI's pid."""
    import psutil

    child = "import os, sys, time; print(os.environ['TRINITY_CLI_PID'], flush=True); time.sleep(120)"
    driver = subprocess.Popen([sys.executable, "-c", _SUPERVISED, json.dumps([sys.executable, "-c", child])],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kids: list[int] = []
    try:
        assert driver.stdout.readline().strip() == str(driver.pid)
        kids = [p.pid for p in psutil.Process(driver.pid).children(recursive=True)]
        driver.send_signal(signal.SIGHUP)
        driver.communicate(timeout=30)
        assert driver.returncode == 128 + signal.SIGHUP
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for pid in kids:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)
    assert kids and not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in kids)


def test_supervised_child_dies_with_a_killed_cli():
    """kill -9 of `trinity run` cannot be caught: the kernel's parent-death signal ends torchrun."""
    import psutil

    child = "import time; print('up', flush=True); time.sleep(120)"
    driver = subprocess.Popen([sys.executable, "-c", _SUPERVISED, json.dumps([sys.executable, "-c", child])],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kids: list[int] = []
    try:
        assert driver.stdout.readline().strip() == "up"
        kids = [p.pid for p in psutil.Process(driver.pid).children(recursive=True)]
        driver.kill()
        driver.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in kids):
            time.sleep(0.1)
        left = [p for p in kids if psutil.pid_exists(p)]
        assert not left, f"still running after the CLI was killed: {left}"
    finally:
        for pid in kids:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


def test_quiet_filters_known_warnings_and_debug_keeps_them(monkeypatch):
    import warnings

    from trinity.compat import quiet

    monkeypatch.setattr(quiet, "_debug", None)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")  # the user's choice stands
    monkeypatch.setenv("HF_DATASETS_DISABLE_PROGRESS_BARS", "")
    monkeypatch.delenv("HF_DATASETS_DISABLE_PROGRESS_BARS")  # (set first: monkeypatch then restores its absence)
    quiet.install(False)
    assert (os.environ["HF_HUB_DISABLE_PROGRESS_BARS"], os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"]) == ("0", "1")
    for debug, expected in ((False, 0), (True, 3)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            quiet.install(debug)
            warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
            warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated.", FutureWarning)
            warnings.warn("When using async grad allreduce it is recommended to set the environment variable "
                          "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup")
            warnings.warn("something else", UserWarning)
        assert len(seen) == expected + 1, [str(w.message) for w in seen]


def test_quiet_hidden_scopes_the_filters_to_a_library_call(monkeypatch):
    """`hidden()` (generate_answers, the first megatron-core import after `import trinity`) ignores the
    known warnings inside the block only, and not at all with TRINITY_DEBUG=1."""
    import warnings

    from trinity.compat import quiet

    monkeypatch.setattr(quiet, "_debug", None)  # install() not called: TRINITY_DEBUG decides
    known = "--moe-layer-recompute is deprecated. Use --recompute-granularity selective instead."
    for env, inside in (("0", 0), ("1", 1)):
        monkeypatch.setenv(quiet.DEBUG_ENV, env)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with quiet.hidden():
                warnings.warn(known)
            assert len(seen) == inside
            warnings.warn(known)  # the caller's filters again
            assert len(seen) == inside + 1


def test_worker_watchdog_stops_the_worker_when_the_cli_is_gone():
    """torchrun killed with -9 too (or hung): each worker watches `trinity run`'s pid itself."""
    import psutil

    cli = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    code = ("import sys, time; from trinity.launch.child import start_watchdog; "
            f"start_watchdog({{'TRINITY_CLI_PID': '{cli.pid}'}}); print('watching', flush=True); time.sleep(120)")
    worker = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "RANK": "3"})
    try:
        assert worker.stdout.readline().strip() == "watching"
        time.sleep(1)
        assert worker.poll() is None  # the CLI is alive: the worker goes on
        cli.kill()
        cli.wait(timeout=30)
        _, err = worker.communicate(timeout=10)
        assert worker.returncode == 143
        assert err.strip() == f"trinity run (pid {cli.pid}) is gone; rank 3 stops"
    finally:
        for p in (cli, worker):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert not psutil.pid_exists(worker.pid) or psutil.Process(worker.pid).status() == psutil.STATUS_ZOMBIE


def test_a_forked_child_of_a_worker_stops_when_the_cli_is_gone():
    """megatron-core's checkpoint writer forks the rank: the fork has no watchdog thread unless one is
    started in it, and it outlived a killed job under PID 1."""
    cli = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    code = ("import os, sys, time; from trinity.launch.child import start_watchdog; "
            f"start_watchdog({{'TRINITY_CLI_PID': '{cli.pid}'}})\n"
            "pid = os.fork()\n"
            "if pid == 0:\n    n = os.open(os.devnull, os.O_WRONLY); os.dup2(n, 1); os.dup2(n, 2); time.sleep(120); os._exit(0)\n"
            "print(pid, flush=True); os._exit(0)")  # the parent goes at once, as a rank stopped mid-save
    worker = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "RANK": "2"})
    child = int(worker.stdout.strip())
    try:
        time.sleep(1)
        assert _alive(child)  # the CLI is alive: the child goes on
        cli.kill()
        cli.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        if _alive(child):
            os.kill(child, 9)


def _alive(pid: int) -> bool:
    import psutil

    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
