"""Issue 19 (4, 6, 14): a real tiny CPU `trinity run` is stopped the ways users stop jobs (Ctrl-C, the
terminal closing, kill -9 of the CLI), and no process of the job may
be left within seconds; an interrupt is reported as one, with the checkpoint to go on from; the known
third-party warnings are hidden, and `--debug` shows them.

The jobs share one output folder (one after the other, as a user re-running would): the HF -> dist
checkpoint conversion happens once, and each job also checks that the previous one, however it was
stopped, left no lock behind that blocks it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, trinity_run_argv

pytestmark = pytest.mark.slow

WARNING_LINE = re.compile(r"\b(UserWarning|FutureWarning|DeprecationWarning):")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer, write_sft_dataset

    root = tmp_path_factory.mktemp("process_trust")
    tok = make_tiny_tokenizer(root / "tokenizer")
    model = make_tiny_qwen2(root / "model", tok, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2)
    data = write_sft_dataset(root / "sft.jsonl", 200, seed=0)
    cfg = {
        "algorithm": {"name": "sft"},
        "model": {"path": str(model)},
        "data": {"train_files": [str(data)], "seq_length": 64, "packing": True},
        "cluster": {"device": "cpu", "nproc_per_node": 1},
        # Long enough never to end by itself: every test stops it.
        "trainer": {"total_steps": 100000, "global_batch_size": 2, "micro_batch_size": 1,
                    "output_dir": str(root / "run"), "save_interval": 1, "keep_last": 1, "log_interval": 1,
                    "tensorboard": False, "export_hf": False},
    }
    (root / "job.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return root


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(pids: list[int]) -> list[str]:
    import psutil

    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out.append(f"{pid} {p.status()} {' '.join(p.cmdline())[:200]} threads={p.num_threads()}")
        except psutil.Error as exc:
            out.append(f"{pid} {exc!r}")
    return out


class Job:
    """A `trinity run` child with its console in a file."""

    def __init__(self, workdir: Path, name: str, *, debug: bool = False):
        self.log = workdir / f"{name}.out"
        self._out = self.log.open("w")
        # One output folder per job: a job a failed test left behind cannot hold the next one's lock.
        args = [f"trainer.output_dir={workdir / ('run_' + name)}"]
        self.cli = subprocess.Popen(trinity_run_argv(workdir / "job.yaml", *args, debug=debug), cwd=REPO,
                                    stdin=subprocess.DEVNULL, stdout=self._out, stderr=subprocess.STDOUT)
        self.pids: list[int] = []

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while not re.search(pattern, self.text()):
            assert self.cli.poll() is None, f"trinity run ended ({self.cli.returncode}):\n{self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"no {pattern!r} after {timeout_s} s:\n{self.text()[-3000:]}"
            time.sleep(0.2)

    def processes(self) -> dict[str, int]:
        """pid of the launcher and of the worker (the CLI's child and grandchild). A job of one process
        (these) starts under `trinity.launch.single`, not torchrun (`launch_command`)."""
        import psutil

        found = {}
        for p in psutil.Process(self.cli.pid).children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())
            except (psutil.ZombieProcess, psutil.NoSuchProcess, psutil.AccessDenied):
                continue  # a short-lived helper (e.g. a resource tracker) that has just ended
            if "-m trinity.launch.single " in cmd:
                found["launcher"] = p.pid
            elif "-m trinity.trainer.worker " in cmd and "torch.distributed.run" not in cmd:
                found["worker"] = p.pid
        self.pids = list(found.values())
        return found

    def assert_nothing_left(self, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while any(_alive(p) for p in self.pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in self.pids if _alive(p)]
        assert not left, f"processes of the job still running {within_s} s after the CLI ended: {_describe(left)}"

    def cleanup(self) -> None:
        # Whatever happened, end what this test started (by pid).
        if self.cli.poll() is None:
            self.cli.kill()
            self.cli.wait(timeout=30)
        for pid in self.pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self._out.close()


def test_job_its_workers_refuse_leaves_the_previous_resolved_config(workdir):
    """3: a job refused by its workers before training a step (here: a folder to resume from that is
    no checkpoint) leaves the output folder's resolved_config.yaml as the previous job wrote it."""
    out = workdir / "run"
    out.mkdir(exist_ok=True)
    (out / "resolved_config.yaml").write_text("# job A\n")
    not_a_checkpoint = workdir / "empty"
    not_a_checkpoint.mkdir()
    cfg = yaml.safe_load((workdir / "job.yaml").read_text())
    cfg["trainer"]["resume"] = str(not_a_checkpoint)
    (workdir / "refused.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    proc = subprocess.run(trinity_run_argv(workdir / "refused.yaml"), cwd=REPO, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400)
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert f"trainer.resume: {not_a_checkpoint} is not a complete training checkpoint" in proc.stdout
    assert (out / "resolved_config.yaml").read_text() == "# job A\n"


def test_ctrl_c_stops_every_process_and_names_the_checkpoint(workdir):
    """SIGHUP and SIGTERM take the same path (tests/unit/test_cli_trust.py checks they are forwarded)."""
    sig = signal.SIGINT
    job = Job(workdir, "ctrl_c")
    try:
        job.wait_for(r"saved checkpoint .*step_\d+")
        assert set(job.processes()) == {"launcher", "worker"}, job.processes()
        job.cli.send_signal(sig)
        job.cli.wait(timeout=60)
        job.assert_nothing_left(within_s=30)  # ~1-2 s on an idle machine; CI runs two test workers on 2 cores
    finally:
        job.cleanup()
    out = job.text()
    assert job.cli.returncode == 128 + sig, out[-3000:]
    assert "failed first" not in out and "job failed" not in out and "death signal" not in out, out[-3000:]
    m = re.search(r"interrupted; the last complete checkpoint is (\S+) \(step (\d+)\): run again with "
                  r"trainer.resume=auto", out)
    assert m, out[-3000:]
    assert (Path(m.group(1)) / "complete").is_file() and m.group(1).endswith(f"step_{m.group(2)}")
    # 14: none of the ~30 known third-party warning lines; the job's own lines are all there.
    assert not [line for line in out.splitlines() if WARNING_LINE.search(line)], out[-3000:]
    assert re.search(r"\[default0\]:step \d+/", out)


def test_kill_9_of_the_cli_leaves_no_process(workdir):
    """kill -9 of `trinity run`: the kernel's parent-death signal (SIGKILL) ends the launcher and the
    worker's own watchdog on the CLI's pid ends the worker.
    This job runs with --debug: the warnings the other job hides are all shown."""
    targets, debug = ("cli",), True
    job = Job(workdir, "kill9", debug=debug)
    try:
        job.wait_for(r"step 2/")
        procs = job.processes()
        assert set(procs) == {"launcher", "worker"}, procs
        for name in targets:
            os.kill(job.cli.pid if name == "cli" else procs[name], signal.SIGKILL)
        job.cli.wait(timeout=30)
        job.assert_nothing_left(within_s=30)  # ~1-2 s on an idle machine; CI runs two test workers on 2 cores
    finally:
        job.cleanup()
    if debug:
        out = job.text()
        assert "UserWarning: Transformer Engine and Apex are not installed" in out, out[-3000:]
        assert "[default0]:" in out and WARNING_LINE.search(out.split("command: ", 1)[1]), "no worker warning with --debug"
