"""Plain typed functions behind the CLI commands; tests call them directly.

Heavy modules (torch, megatron, transformers) are imported inside the functions that need them.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from trinity.config.loader import LoadedConfig, load_config
from trinity.config.plan import JobPlan, build_plan, render_plan
from trinity.config.schema import JobConfig
from trinity.errors import ConfigError, UserError

if TYPE_CHECKING:
    from trinity.convert.cache import CachedConversion
    from trinity.launch.lock import OutputDirLock


def validate(config: Path, overrides: list[str], *, json_out: bool = False) -> int:
    try:
        loaded = load_config(config, overrides)
        plan = build_plan(loaded.config, loaded.facts, loaded.warnings)
    except UserError as exc:
        if not json_out:
            raise
        # --json is for programs: the answer is JSON whatever happened, the exit code says which.
        problems = exc.problems if isinstance(exc, ConfigError) else [str(exc)]
        print(json.dumps({"ok": False, "problems": problems}, indent=2))
        return exc.exit_code
    print(json.dumps(plan.to_dict(), indent=2) if json_out else render_plan(plan))
    if not json_out:
        _warn_gpu_memory(loaded.config, plan)
    return 0


def _warn_gpu_memory(cfg: JobConfig, plan: JobPlan) -> None:
    """A CUDA job whose estimated peak does not fit this machine's GPUs (trinity.launch.gpu_memory)."""
    if cfg.cluster.device != "cuda":
        return
    from trinity.launch.gpu_memory import memory_warning, visible_gpu_memory

    warning = memory_warning(plan.peak_per_gpu, visible_gpu_memory())
    if warning is not None:
        print(f"warning: {warning}")


def schema() -> str:
    return json.dumps(JobConfig.model_json_schema(), indent=2)


def run(config: Path, overrides: list[str], *, dry_run: bool = False, debug: bool = False, force: bool = False,
        no_cache: bool = False) -> int:
    """`force`: write into an output folder that holds files no trinity run wrote (trinity.launch.ownership).
    `no_cache`: convert the HF model into <output_dir>/mcore_cache, not the shared cache (trinity.convert.cache)."""
    from trinity.launch.stop import interruptible

    # Ctrl-C, SIGTERM and SIGHUP stop every stage the same way: the conversion and the launch's
    # preparations here, the job itself through supervise(), which forwards them.
    with interruptible():
        return _run(config, overrides, dry_run=dry_run, debug=debug, force=force, no_cache=no_cache)


def _run(config: Path, overrides: list[str], *, dry_run: bool, debug: bool, force: bool, no_cache: bool) -> int:
    import time

    from trinity.compat import quiet
    from trinity.launch.failures import job_failure_line
    from trinity.launch.lock import acquire, lock_name, prepare_output_dir
    from trinity.launch.ownership import check_ownership
    from trinity.launch.stop import signal_of
    from trinity.launch.torchrun import launch_command, preflight
    from trinity.trainer.finished import complete_line

    quiet.install(debug)  # before anything imports megatron-core (weight conversion below)
    loaded = load_config(config, overrides)
    cfg = loaded.config
    out = Path(cfg.trainer.output_dir)
    done = None if dry_run else complete_line(out, cfg)
    if done is not None:
        print(done, flush=True)
        return 0
    plan = build_plan(cfg, loaded.facts, loaded.warnings)
    print(render_plan(plan))
    _warn_gpu_memory(cfg, plan)
    check_ownership(out, force=force)
    resolved = out / "resolved_config.yaml"
    cmd = launch_command(cfg, resolved)
    if dry_run:
        print("command: " + shlex.join(cmd))
        return 0
    preflight(cfg)
    # The job is accepted for its output folder only once it holds the folder's lock: nothing
    # (resolved_config.yaml, mcore_cache with --no-cache, logs) may be written there before, or a job
    # refused for a folder another job is using would still overwrite that job's files.
    prepare_output_dir(out)
    name = lock_name(cfg.cluster)
    lock = acquire(out, name) if name else None
    started = time.time()
    stopped: dict[str, int | None] = {"sig": None}
    try:
        remove_job_temps(out)  # what a job killed with -9 left
        code = _launch(loaded, out, resolved, cmd, debug, no_cache, stopped, lock)
    except KeyboardInterrupt as exc:  # trinity.launch.stop.Interrupted: before or after the job ran
        stopped["sig"] = signal_of(exc)
        code = 128 + stopped["sig"]
    finally:
        # Every process of the job has ended (supervise() waits for its process group): what they
        # were writing when they were stopped is stale. Only with the folder's lock held.
        remove_job_temps(out)
        if lock is not None:
            lock.release()
    if stopped["sig"] is not None:
        try:
            print(interrupted_message(out), flush=True)
        except OSError:  # SIGHUP: the terminal is gone, and with it the reader of this line
            pass
    elif code != 0:
        print(job_failure_line(out, code, since=started), flush=True)
    return code


def _launch(loaded: LoadedConfig, out: Path, resolved: Path, cmd: list[str], debug: bool, no_cache: bool,
            stopped: dict[str, int | None], lock: "OutputDirLock | None") -> int:
    """Convert the weights if needed, write the resolved config and run the job; its exit code. The
    workers keep the output folder's lock and the conversion they read held after this process ends
    (kill -9 of the CLI): no other job takes the folder, no cleanup removes the entry."""
    from trinity.launch.failures import disk_errors
    from trinity.launch.ownership import mark_run
    from trinity.launch.torchrun import supervise, worker_env
    from trinity.trainer.finished import DONE_FILE, clear_done

    held = None
    try:
        with disk_errors(out):
            mark_run(out)
            held = prepare_weights(loaded, out, no_cache=no_cache, debug=debug)
            before = _run_record(out)
            write_resolved(loaded.config, resolved)
            clear_done(out)  # a finished job's record describes the folder until another job starts
        print("command: " + shlex.join(cmd), flush=True)
        fds = tuple(h.fd for h in (lock, held) if h is not None)
        code = supervise(cmd, env=worker_env(os.environ, sys.stdout, debug=debug), debug=debug,
                         pass_fds=fds, stopped=stopped)
        if code == UserError.exit_code and before["config"] is not None and _run_record(out)["trained"] == before["trained"]:
            # The workers refused the job (e.g. its checkpoint to resume from) before it trained a
            # step: the folder's record stays the previous job's, not the config of a job that never ran.
            resolved.write_bytes(before["config"])
            if before["done"] is not None:
                (out / DONE_FILE).write_bytes(before["done"])
        return code
    finally:
        if held is not None:
            held.release()


def remove_job_temps(out: Path) -> list[Path]:
    """Remove the temporary folders that stopped or killed processes of this host left in the output
    folder: checkpoints (`checkpoints/`), the HF export, the weight conversion (`mcore_cache/`)."""
    from trinity.convert.outdir import remove_temps, stale_temps

    folders = [out, *(p for p in out.iterdir() if p.is_dir() and not p.name.startswith("."))] if out.is_dir() else []
    return remove_temps([t for folder in folders for t in stale_temps(folder)])


def _run_record(out: Path) -> dict:
    """What a previous job left in `out`: its resolved config and finished-job record (bytes) and what
    it trained (the metrics' size and the complete checkpoints)."""
    from trinity.trainer.finished import DONE_FILE
    from trinity.launch.run_folder import complete_checkpoints

    resolved, metrics, done = out / "resolved_config.yaml", out / "metrics.jsonl", out / DONE_FILE
    return {
        "config": resolved.read_bytes() if resolved.is_file() else None,
        "done": done.read_bytes() if done.is_file() else None,
        "trained": (metrics.stat().st_size if metrics.is_file() else -1, complete_checkpoints(out / "checkpoints")),
    }


def interrupted_message(out: Path) -> str:
    """What to tell a user who stopped the job: where it can go on from."""
    from trinity.launch.run_folder import complete_checkpoints

    found = complete_checkpoints(out / "checkpoints")
    if not found:
        return f"interrupted; no complete checkpoint in {out / 'checkpoints'} yet: a new run starts from step 0"
    step, path = found[-1]
    return (f"interrupted; the last complete checkpoint is {path} (step {step}): run again with "
            f"trainer.resume=auto (the default) to continue from it")


def write_resolved(cfg: JobConfig, path: Path) -> None:
    # Every node runs `trinity run`; on a shared output_dir each writes its own temporary file.
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}-{os.getpid()}.tmp")
    tmp.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    tmp.replace(path)


def prepare_weights(loaded: LoadedConfig, out: Path, *, no_cache: bool = False, debug: bool = False) -> "CachedConversion | None":
    """The seeds' convert-then-launch flow: roles whose weight source is the HF folder
    (`trinity.config.weights.weight_source`) get a dist checkpoint converted from it, and are pointed
    at it. Where the conversion lives is `conversion_home`'s choice. Returns the shared cache's entry
    when one is used: the job holds it (pass its fd to the workers, release it at the end)."""
    from trinity.config.weights import WeightKind, job_roles, weight_source

    cfg = loaded.config
    roles = [r.megatron(cfg) for r in job_roles(cfg) if weight_source(cfg, r).kind is WeightKind.hf]
    if not roles:
        return None
    src, dtype = Path(cfg.model.path), conversion_dtype(cfg)
    held = None
    if conversion_home(cfg, no_cache) == "run":
        path = _convert_in_run_folder(src, dtype, out, debug)
    else:
        held = _convert_in_cache(src, dtype, out, debug)
        path = held.path if held is not None else _convert_in_run_folder(src, dtype, out, debug)
    for m in roles:
        m.use_dist_checkpointing = True
        m.dist_checkpointing_path = str(path)
    return held


def conversion_dtype(cfg: JobConfig) -> str:
    """The dtype the HF model is converted to: model.dtype, or for `auto` the one the job computes in."""
    return cfg.model.dtype if cfg.model.dtype != "auto" else ("fp32" if cfg.cluster.device == "cpu" else "bf16")


def conversion_home(cfg: JobConfig, no_cache: bool) -> str:
    """`cache`: the shared cache (trinity.convert.cache); `run`: <output_dir>/mcore_cache. Nodes of a
    multi-node job share the output folder but not always a home folder, and every node's workers must
    read the same checkpoint path: they convert into the output folder."""
    return "run" if no_cache or cfg.cluster.nnodes > 1 else "cache"


def _converting(src: Path, where: Path, note: str) -> None:
    print(f"converting {src} to a megatron-core checkpoint in {where} ({note})", flush=True)


def _convert_in_cache(src: Path, dtype: str, out: Path, debug: bool) -> "CachedConversion | None":
    """The shared cache's entry for (src, dtype), converted now unless a job made it already; None
    where the cache's file system has no file locks (then the caller converts into the run's folder)."""
    from trinity.convert import cache
    from trinity.launch.failures import disk_errors

    root = cache.mcore_cache_dir()
    key = cache.entry_key(src, dtype)

    def build(dest: Path) -> None:
        from trinity.convert.api import hf_to_mcore

        _converting(src, root / key, "cached for later runs of this model")
        # in a supervised child process: a signal stops it at once (trinity.convert.api.conversion_job)
        hf_to_mcore(str(src), str(dest), dtype=dtype, force=True, isolate=True, debug=debug)

    try:
        with disk_errors(root):
            held = cache.use_entry(root, key, build, say=lambda line: print(line, flush=True))
    except cache.NoLocks:
        print(f"the conversion cache {root} is on a file system without file locks; converting into "
              f"{out / 'mcore_cache'} instead (set TRINITY_CACHE to a local folder to share conversions)", flush=True)
        return None
    if held.converted:
        for path, size in cache.clean(root, cache.bound_bytes()):
            print(f"removed the least recently used conversion {path} ({size / 1e9:.2f} GB) to keep {root} "
                  f"within TRINITY_MCORE_CACHE_GB", flush=True)
    else:
        print(f"using the cached megatron-core checkpoint {held.path}", flush=True)
    return held


def _convert_in_run_folder(src: Path, dtype: str, out: Path, debug: bool) -> Path:
    """`<output_dir>/mcore_cache/<key>`, converted unless there already."""
    from trinity.convert.cache import entry_key, is_complete

    cache = out / "mcore_cache" / entry_key(src, dtype)
    if is_complete(cache):
        print(f"using the cached megatron-core checkpoint {cache}", flush=True)
        return cache
    from trinity.convert.api import hf_to_mcore
    from trinity.convert.outdir import remove_stale_siblings, temp_sibling

    _converting(src, cache, "cached for later runs in this folder")
    # Each node converts into its own folder and renames it into place: on a shared output_dir the
    # first node to finish wins and the others drop their copy (a rename never replaces a non-empty
    # folder), so no node reads a checkpoint another is still writing or replacing. What a converter
    # of this host killed outright left is removed first.
    remove_stale_siblings(cache)
    build = temp_sibling(cache, "build")
    hf_to_mcore(str(src), str(build), dtype=dtype, force=True, isolate=True, debug=debug)
    try:
        os.rename(build, cache)
    except OSError:
        if not is_complete(cache):
            raise
        shutil.rmtree(build, ignore_errors=True)
    return cache


def tiny_assets(output: Path, *, family: str = "qwen2", debug: bool = False) -> int:
    from trinity.config.loader import check_output_dir
    from trinity.compat import quiet

    quiet.install(debug)  # before transformers is imported: its "Writing model shards" bar stays off
    from trinity.testing.tiny_assets import TINY_FAMILY_CONFIGS, make_quickstart_assets

    if family not in TINY_FAMILY_CONFIGS:
        raise UserError(f"tiny-assets --family: {family!r} is not one of {', '.join(sorted(TINY_FAMILY_CONFIGS))}")
    problems = check_output_dir(output, "tiny-assets OUTPUT")
    if problems:
        raise UserError(problems[0])
    paths = make_quickstart_assets(output, family=family)
    for name, p in paths.items():
        print(f"{name}: {p}")
    return 0


def plot(run_dirs: list[Path], out: Path | None) -> int:
    from trinity.trainer.curves import default_out, load_runs, plot_runs

    runs = load_runs(run_dirs)  # a missing metrics.jsonl is named before matplotlib is looked for
    print(f"wrote {plot_runs(runs, out or default_out(run_dirs))}")
    return 0


def convert_hf_to_mcore(hf_path: Path, output: Path, *, debug: bool = False, **kwargs) -> int:
    from trinity.compat import quiet

    quiet.install(debug)  # before megatron-core is imported
    from trinity.convert.api import hf_to_mcore
    from trinity.launch.failures import disk_errors
    from trinity.launch.stop import interruptible

    _require_dir(hf_path, "--hf-path")
    # the conversion's child processes are stopped as a job's (conversion_job)
    with interruptible(), disk_errors(output):
        report = hf_to_mcore(str(hf_path), str(output), isolate=True, debug=debug, **kwargs)
    print(report)
    return 0


def convert_mcore_to_hf(mcore_path: Path, output: Path, *, debug: bool = False, **kwargs) -> int:
    from trinity.compat import quiet

    quiet.install(debug)  # before megatron-core is imported
    from trinity.convert.api import mcore_to_hf
    from trinity.launch.failures import disk_errors
    from trinity.launch.stop import interruptible

    _require_dir(mcore_path, "--mcore-path")
    with interruptible(), disk_errors(output):  # SIGTERM and SIGHUP too unwind: the temporary folder goes
        report = mcore_to_hf(str(mcore_path), str(output), **kwargs)
    print(report)
    return 0


def _require_dir(path: Path, flag: str) -> None:
    if not path.is_dir():
        raise UserError(f"{flag}: {path} does not exist or is not a folder")
