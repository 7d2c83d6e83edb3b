"""Shared test set-up: paths to the fixture HF configs and a helper to write job YAML files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# CI machines have 2 cores and several tests start 2 processes: more than one intra-op thread per
# process makes tiny megatron steps 30-100x slower through contention. Subprocesses inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Strict collectives (trinity.distributed.collectives): a torch.distributed collective called from trinity
# code outside the helpers raises, in this process and in every rank the tests start.
os.environ["TRINITY_STRICT_COLLECTIVES"] = "1"
# The suite starts some 700 Python processes, each importing trinity's modules: where the environment
# forbids bytecode files (PYTHONDONTWRITEBYTECODE, set on some CI images), each would compile them again
# (~0.5 s per training process). Let them be cached, as a user's installation does.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

import pytest
import yaml

from trinity import compat

# As the workers and the CLI do: the tests (and the ranks they spawn, which import this module) import
# megatron-core in-process, through trinity.compat's light import.
compat.install_all()

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
HF_CONFIGS = FIXTURES / "hf_configs"


def pytest_collection_modifyitems(config, items):
    """Longest files first. Under `-n 2 --dist loadfile --no-loadscope-reorder` (pyproject.toml) a worker
    takes whole files in this order: the few long files (a real-model GRPO run is minutes) start at
    once on both workers and the many short ones fill in at the end, instead of one long file running
    alone after everything else. A file's weight is the largest pytest-timeout of its tests (the long
    ones declare theirs), then its number of `slow` tests; the order within a file stays."""
    default = float(config.getini("timeout") or 0)
    weight: dict[str, tuple[float, int]] = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        mark = item.get_closest_marker("timeout")
        timeout = float(mark.args[0]) if mark and mark.args else default
        longest, slow = weight.get(path, (0.0, 0))
        weight[path] = (max(longest, timeout), slow + (item.get_closest_marker("slow") is not None))
    items.sort(key=lambda item: tuple(-w for w in weight[item.nodeid.split("::")[0]]))


@pytest.fixture(autouse=True, scope="session")
def _strict_collectives():
    from trinity.distributed import collectives

    collectives.install_strict_guard()


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_qwen2_tp1(tmp_path_factory):
    """(ModelFacts, HF folder) of a tiny random Qwen2, with one CPU process group (TP=PP=DP=1) set up
    for the module's tests."""
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.facts import ModelFacts
    from trinity.testing.tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen2"))
    init_parallel(device="cpu", layout=ParallelLayout(), seed=3)
    yield ModelFacts.from_hf_dir(path), path
    destroy()


@pytest.fixture
def write_job(tmp_path):
    """Write a job dict as YAML and return its path."""

    def _write(job: dict, name: str = "job.yaml") -> Path:
        p = tmp_path / name
        p.write_text(yaml.safe_dump(job, sort_keys=False))
        return p

    return _write


@pytest.fixture
def small_job():
    """A valid SFT job on the Qwen2.5-0.5B config fixture (no weights needed for validation)."""
    return {
        "model": {"path": str(HF_CONFIGS / "qwen2_5_0_5b")},
        "data": {"train_files": [str(FIXTURES / "data" / "sft.jsonl")], "seq_length": 512},
        "cluster": {"device": "cuda", "nproc_per_node": 8},
        "trainer": {"global_batch_size": 16, "micro_batch_size": 1},
    }


def _rank_then_exit(worker, *args) -> None:
    """A run_ranks child: the worker, then the exit a finished training rank takes (without the
    interpreter's ~1.3 s teardown of torch and megatron-core). An exception exits as usual (code 1)."""
    worker(*args)
    from trinity.launch.child import exit_without_teardown

    exit_without_teardown(0)


def run_ranks(n: int, worker, *args, timeout: float = 240) -> None:
    """Run `worker(rank, port, *args)` in `n` spawned processes (a gloo/NCCL group on localhost) and fail
    unless all exit 0; a rank still running after `timeout` seconds is killed."""
    import torch.multiprocessing as mp

    from trinity.distributed.parallel import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_then_exit, args=(worker, rank, port, *args)) for rank in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def run_two_ranks(worker, *args, timeout: float = 240) -> None:
    """`run_ranks` with a pair of ranks."""
    run_ranks(2, worker, *args, timeout=timeout)


def trinity_run_argv(config: Path, *overrides: str, debug: bool = False) -> list[str]:
    """`trinity run --config <config> [key=value ...]` (`--debug`) as a child process command: its signal
    handlers, cwd and torchrun children stay out of pytest's process. It ends as the CLI does
    (trinity.cli.main.main): without the interpreter's teardown once torch is loaded."""
    return [sys.executable, "-c",
            f"import sys; from trinity.cli.commands import run; "
            f"code = run({str(config)!r}, {list(overrides)!r}, debug={debug!r}); "
            f"from trinity.launch.child import end_process; end_process(code)"]


@pytest.fixture(autouse=True, scope="session")
def _conversion_cache(tmp_path_factory):
    """Every `trinity run` of the session converts into one conversion cache of the session's (all
    xdist workers), never the user's ~/.cache/trinity/mcore: a job reuses the conversion an earlier job
    made of the same model folder and dtype, as a user's later runs do. TRINITY_CACHE itself stays: the
    real-model tests keep their model there across sessions (trinity.testing.real_model)."""
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's basetemp is <session folder>/popen-gwN: share the session folder.
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    os.environ["TRINITY_MCORE_CACHE"] = str(root / "mcore_conversions")


def trinity_run(cfg: dict, path: Path, *, timeout: float, env: dict[str, str] | None = None,
                reuse_conversion: bool = False) -> subprocess.CompletedProcess:
    """Write `cfg` as YAML to `path` and run it; the output is printed (its end) and kept in
    `<path stem>.out` beside the config.

    reuse_conversion: the job uses the session's conversion cache (see `_conversion_cache`): it starts
    from the conversion an earlier job of the session made of the same HF folder ("using the cached
    megatron-core checkpoint"), ~4 s less per job (the conversion imports megatron-core and mbridge).
    Off (tests of the conversion itself), the job gets a cache of its own beside `path`
    (`private_conversion_cache`), so its first run converts."""
    # No curves.png unless the test asks (trainer.curves): drawing it costs ~1 s per run, and the tests
    # that check it set the key.
    cfg = {**cfg, "trainer": {"curves": False, **cfg.get("trainer", {})}}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    private = {} if reuse_conversion else private_conversion_cache(path.parent)
    proc = subprocess.run(
        trinity_run_argv(path), cwd=REPO, env={**os.environ, **private, **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
    )
    (path.parent / f"{path.stem}.out").write_text(proc.stdout)
    print(proc.stdout[-3000:])
    return proc


def private_conversion_cache(folder: Path) -> dict[str, str]:
    """The environment of a `trinity run` whose conversions go to `<folder>/mcore_conversions`."""
    return {"TRINITY_MCORE_CACHE": str(folder / "mcore_conversions")}


@pytest.fixture(scope="module")
def tiny_qwen2_cpu(tmp_path_factory):
    """(model chunk, ModelFacts, HF folder) of the tiny random Qwen2, fp32 on CPU at TP=PP=1, with
    megatron's parallel state up for the module (the rollout tests decode with it)."""
    from trinity.distributed.parallel import destroy
    from trinity.testing.tiny_models import tiny_chunk_cpu

    yield tiny_chunk_cpu("qwen2", tmp_path_factory.mktemp("qwen2"))
    destroy()
