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

import yaml

from trinity.config.loader import LoadedConfig, load_config
from trinity.config.plan import build_plan, render_plan
from trinity.config.schema import JobConfig
from trinity.errors import ConfigError, UserError


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
    return 0


def schema() -> str:
    return json.dumps(JobConfig.model_json_schema(), indent=2)


def run(config: Path, overrides: list[str], *, dry_run: bool = False, debug: bool = False, force: bool = False) -> int:
    """`force`: write into an output folder that holds files no trinity run wrote (trinity.launch.ownership)."""
    from trinity.launch.stop import interruptible

    # Ctrl-C, SIGTERM and SIGHUP stop every stage the same way: the conversion and the launch's
    # preparations here, the job itself through supervise(), which forwards them.
    with interruptible():
        return _run(config, overrides, dry_run=dry_run, debug=debug, force=force)


def _run(config: Path, overrides: list[str], *, dry_run: bool, debug: bool, force: bool) -> int:
    import time

    from trinity.launch import quiet
    from trinity.launch.failures import job_failure_line
    from trinity.launch.lock import acquire, lock_name, prepare_output_dir
    from trinity.launch.ownership import check_ownership
    from trinity.launch.stop import signal_of
    from trinity.launch.torchrun import launch_command, preflight

    quiet.install(debug)  # before anything imports megatron-core (weight conversion below)
    loaded = load_config(config, overrides)
    cfg = loaded.config
    print(render_plan(build_plan(cfg, loaded.facts, loaded.warnings)))
    out = Path(cfg.trainer.output_dir)
    check_ownership(out, force=force)
    resolved = out / "resolved_config.yaml"
    cmd = launch_command(cfg, resolved)
    if dry_run:
        print("command: " + shlex.join(cmd))
        return 0
    preflight(cfg)
    # The job is accepted for its output folder only once it holds the folder's lock: nothing
    # (resolved_config.yaml, mcore_cache, logs) may be written there before, or a job refused for a
    # folder another job is using would still overwrite that job's files.
    prepare_output_dir(out)
    name = lock_name(cfg.cluster)
    lock = acquire(out, name) if name else None
    started = time.time()
    stopped: dict[str, int | None] = {"sig": None}
    try:
        remove_job_temps(out)  # what a job killed with -9 left
        code = _launch(loaded, out, resolved, cmd, debug, stopped, (lock.fd,) if lock else ())
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


def _launch(loaded: LoadedConfig, out: Path, resolved: Path, cmd: list[str], debug: bool,
            stopped: dict[str, int | None], pass_fds: tuple[int, ...]) -> int:
    """Convert the weights if needed, write the resolved config and run the job (`pass_fds`: the output
    folder's lock, held by the job's processes too); its exit code."""
    from trinity.launch.failures import disk_errors
    from trinity.launch.ownership import mark_run
    from trinity.launch.torchrun import supervise, worker_env

    with disk_errors(out):
        mark_run(out)
        prepare_weights(loaded, out, debug=debug)
        before = _run_record(out)
        write_resolved(loaded.config, resolved)
    print("command: " + shlex.join(cmd), flush=True)
    code = supervise(cmd, env=worker_env(os.environ, sys.stdout, debug=debug), debug=debug,
                     pass_fds=pass_fds, stopped=stopped)
    if code == UserError.exit_code and before["config"] is not None and _run_record(out)["trained"] == before["trained"]:
        # The workers refused the job (e.g. its checkpoint to resume from) before it trained a
        # step: the folder's record stays the previous job's, not the config of a job that never ran.
        resolved.write_bytes(before["config"])
    return code


def remove_job_temps(out: Path) -> list[Path]:
    """Remove the temporary folders that stopped or killed processes of this host left in the output
    folder: checkpoints (`checkpoints/`), the HF export, the weight conversion (`mcore_cache/`)."""
    from trinity.convert.outdir import remove_temps, stale_temps

    folders = [out, *(p for p in out.iterdir() if p.is_dir() and not p.name.startswith("."))] if out.is_dir() else []
    return remove_temps([t for folder in folders for t in stale_temps(folder)])


def _run_record(out: Path) -> dict:
    """What a previous job left in `out`: its resolved config (bytes) and what it trained (the
    metrics' size and the complete checkpoints)."""
    from trinity.trainer.resume import complete_checkpoints

    resolved, metrics = out / "resolved_config.yaml", out / "metrics.jsonl"
    return {
        "config": resolved.read_bytes() if resolved.is_file() else None,
        "trained": (metrics.stat().st_size if metrics.is_file() else -1, complete_checkpoints(out / "checkpoints")),
    }


def interrupted_message(out: Path) -> str:
    """What to tell a user who stopped the job: where it can go on from."""
    from trinity.trainer.resume import complete_checkpoints

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


def prepare_weights(loaded: LoadedConfig, out: Path, *, debug: bool = False) -> None:
    """The seeds' convert-then-launch flow: roles whose weight source is the HF folder
    (`trinity.config.weights.weight_source`) get a dist checkpoint converted from it, cached under <output_dir>/mcore_cache/<fingerprint>
    and reused while the source is unchanged."""
    from trinity.config.weights import WeightKind, job_roles, weight_source

    cfg = loaded.config
    roles = [r.megatron(cfg) for r in job_roles(cfg) if weight_source(cfg, r).kind is WeightKind.hf]
    if not roles:
        return
    from trinity.convert.fingerprint import source_fingerprint

    src = Path(cfg.model.path)
    cache = out / "mcore_cache" / source_fingerprint(src)
    if not (cache / "trinity_meta.json").is_file():
        from trinity.convert.api import hf_to_mcore
        from trinity.convert.outdir import temp_sibling

        dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("fp32" if cfg.cluster.device == "cpu" else "bf16")
        print(f"converting {src} to a megatron-core checkpoint in {cache} (cached for later runs)", flush=True)
        # Each node converts into its own folder and renames it into place: on a shared output_dir the
        # first node to finish wins and the others drop their copy (a rename never replaces a non-empty
        # folder), so no node reads a checkpoint another is still writing or replacing.
        # One killed with -9 leaves its build folder to the next run's `remove_job_temps`.
        build = temp_sibling(cache, "build")
        try:
            hf_to_mcore(str(src), str(build), dtype=dtype, force=True, isolate=True, debug=debug)
            os.rename(build, cache)
        except OSError:
            if not (cache / "trinity_meta.json").is_file():
                raise
        finally:
            shutil.rmtree(build, ignore_errors=True)
    else:
        print(f"using the cached megatron-core checkpoint {cache}", flush=True)
    for m in roles:
        m.use_dist_checkpointing = True
        m.dist_checkpointing_path = str(cache)


def tiny_assets(output: Path, *, debug: bool = False) -> int:
    from trinity.config.loader import check_output_dir
    from trinity.launch import quiet

    quiet.install(debug)  # before transformers is imported: its "Writing model shards" bar stays off
    from trinity.testing.tiny_assets import make_quickstart_assets

    problems = check_output_dir(output, "tiny-assets OUTPUT")
    if problems:
        raise UserError(problems[0])
    paths = make_quickstart_assets(output)
    for name, p in paths.items():
        print(f"{name}: {p}")
    return 0


def plot(run_dirs: list[Path], out: Path | None) -> int:
    from trinity.trainer.curves import default_out, load_runs, plot_runs

    runs = load_runs(run_dirs)  # a missing metrics.jsonl is named before matplotlib is looked for
    print(f"wrote {plot_runs(runs, out or default_out(run_dirs))}")
    return 0


def convert_hf_to_mcore(hf_path: Path, output: Path, *, debug: bool = False, **kwargs) -> int:
    from trinity.launch import quiet

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
    from trinity.launch import quiet

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
