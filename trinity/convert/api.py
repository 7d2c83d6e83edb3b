"""`trinity convert` as plain functions: HF -> megatron-core dist checkpoint and back.

World size 1 runs in this process (in a child process for the CLI); `tp * pp * ep > 1` runs the same
code as a torchrun job (gloo on CPU, nccl on GPU) in which every rank loads only its slice and writes
its own shards.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trinity.convert.hf_io import HFCheckpoint
from trinity.convert.options import torch_dtype
from trinity.convert.outdir import check_output
from trinity.convert.report import ConvertReport
from trinity.errors import UserError
from trinity.models.facts import ModelFacts, mbridge_refusal

BACKENDS = ("builtin", "mbridge")


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


FLAGS = {"tensor_model_parallel_size": "--tp", "pipeline_model_parallel_size": "--pp",
         "virtual_pipeline_model_parallel_size": "--vpp", "expert_model_parallel_size": "--ep",
         "expert_tensor_parallel_size": "--ep"}


def check_layout(facts: ModelFacts, *, tp: int, pp: int, vpp: int | None, ep: int, backend: str, device: str) -> None:
    """Refuse flag combinations megatron-core cannot build, with a UserError naming the flag (before any
    process starts: inside the job they would end as internal errors). The rules are the job config's
    (`layout_problems`); only the GPU count is the conversion's own."""
    from trinity.distributed.layout import ParallelLayout, layout_problems

    if backend == "mbridge" and facts.gemma:
        raise UserError(f"--backend: mbridge has no name map for {facts.architecture} (sandwich norms); "
                        "use the builtin backend")
    lay = ParallelLayout(tp=tp, pp=pp, vpp=vpp, ep=ep)
    problems = layout_problems(lay, facts, name=lambda f: FLAGS.get(f, f))
    if problems:
        field, text = problems[0]
        raise UserError(f"{FLAGS.get(field, field)}: {text}")
    world = tp * pp * ep
    if device == "cuda" and world > 1:
        import torch

        gpus = torch.cuda.device_count()
        if world > gpus:
            raise UserError(
                f"--tp/--pp/--ep: TP x PP x EP = {tp} x {pp} x {ep} = {world} processes need {world} GPUs, "
                f"this machine has {gpus}; lower them (any layout loads the checkpoint) or convert on CPU"
            )


def hf_to_mcore(
    hf_path: str,
    output: str,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    ep: int = 1,
    backend: str = "builtin",
    dtype: str = "bf16",
    verify: bool = False,
    force: bool = False,
    device: str = "auto",
    isolate: bool = False,
    debug: bool = False,
) -> ConvertReport:
    """Convert an HF folder into a megatron-core dist checkpoint (loadable by any TP/PP/VPP/EP).

    World size 1 runs in this process, unless `isolate`: the CLI's conversions run in a child process
    (`conversion_job`), which a Ctrl-C, SIGTERM or SIGHUP stops at once (`Interrupted` raised here);
    `debug` keeps the third-party warnings there (trinity.compat.quiet)."""
    if backend not in BACKENDS:
        raise UserError(f"--backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    torch_dtype(dtype)
    facts = ModelFacts.from_hf_dir(hf_path)
    from trinity.convert.registry import weight_map

    weight_map(facts.family, facts.source)
    if backend == "mbridge" and mbridge_refusal(facts):
        raise UserError(f"--backend mbridge: {mbridge_refusal(facts)} (--backend builtin)")
    device = _device(device)
    check_layout(facts, tp=tp, pp=pp, vpp=vpp, ep=ep, backend=backend, device=device)
    HFCheckpoint(hf_path)  # validates index and shards before any process starts
    check_output(output, force, sources=(hf_path,))
    args = dict(hf_path=str(Path(hf_path).resolve()), output=str(Path(output).resolve()), tp=tp, pp=pp,
                vpp=vpp, ep=ep, backend=backend, dtype=dtype, force=force, device=device)
    start = time.perf_counter()
    world = tp * pp * ep
    if world == 1 and not isolate:
        from trinity.convert.jobs import run_hf_to_mcore

        report = run_hf_to_mcore(**args)
    else:
        report = conversion_job(world, args, debug=debug)
    report.seconds = time.perf_counter() - start
    if verify:
        from trinity.convert.jobs import verify_mcore_against_hf

        try:
            diff = verify_mcore_against_hf(args["output"], hf_path, device=device)
        except UserError as e:
            # A checkpoint that failed its check is not left behind for a job to load.
            shutil.rmtree(args["output"], ignore_errors=True)
            raise UserError(f"{e} ({args['output']} was removed)") from e
        report.max_abs_diff, report.mean_abs_diff, report.verified = diff.max_abs, diff.mean_abs, "logits vs transformers"
    return report


def mcore_to_hf(
    mcore_path: str,
    output: str,
    *,
    dtype: str | None = None,
    verify: bool = False,
    force: bool = False,
    device: str = "auto",
) -> ConvertReport:
    """Export a dist checkpoint (from convert or a training run) to an HF folder."""
    from trinity.convert.dist_ckpt import read_meta

    meta = read_meta(mcore_path)
    if dtype is not None:
        torch_dtype(dtype)
    check_output(output, force, sources=(mcore_path,))
    from trinity.convert.jobs import run_mcore_to_hf

    return run_mcore_to_hf(
        str(Path(mcore_path).resolve()), str(Path(output).resolve()), meta=meta, dtype=dtype, verify=verify,
        force=force, device=_device(device),
    )


def conversion_job(world: int, args: dict[str, Any], *, debug: bool = False) -> ConvertReport:
    """Run the conversion in child processes (`trinity.convert.worker`): one for world size 1, else
    `world` ranks under torchrun; rank 0 leaves its report (or the user error) in a file.

    The children are supervised as a training job is (trinity.launch.torchrun.supervise): Ctrl-C,
    SIGTERM and SIGHUP stop them (this process then raises `Interrupted`), and they die with this
    process, kill -9 included. In this process the interrupt would have to land in Python code, and
    while megatron-core forks its checkpoint writers it lands in an at-fork hook, where Python drops it:
    a Ctrl-C during `converting ...` let the job train to the end. Whatever the stopped children were
    writing (the output's temporary sibling) is removed once they are gone.

    Rank 0 (and the launcher) write straight to this process's stdout/stderr, so its progress shows in
    the user's terminal; the other ranks' output goes to log files whose ends the error message quotes.
    """
    import trinity
    from trinity.convert.outdir import remove_stale_siblings
    from trinity.launch.stop import Interrupted
    from trinity.launch.torchrun import supervise

    with tempfile.TemporaryDirectory(prefix="trinity-convert-") as tmp:
        args_path = Path(tmp) / "args.json"
        report_path = Path(tmp) / "report.json"
        log_dir = Path(tmp) / "logs"
        args_path.write_text(json.dumps({"args": args, "report": str(report_path), "world": world}))
        env = dict(os.environ)
        root = str(Path(trinity.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["TRINITY_DEBUG"] = "1" if debug else "0"
        cmd = [sys.executable, "-m", "trinity.convert.worker", str(args_path)]
        if world > 1:
            redirects = ",".join(f"{r}:3" for r in range(1, world))  # 3 = stdout and stderr; rank 0 not redirected
            cmd[1:2] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                        f"--log-dir={log_dir}", f"--redirects={redirects}", "-m"]
        sys.stdout.flush()
        sys.stderr.flush()
        stopped: dict[str, Any] = {}
        try:
            code = supervise(cmd, env=env, debug=True, stopped=stopped)  # debug: stderr passed on whole
        finally:
            remove_stale_siblings(args["output"])  # the stopped children's temporary folder
        if stopped.get("sig") is not None:
            raise Interrupted(stopped["sig"])
        result = json.loads(report_path.read_text()) if report_path.is_file() else {}
        if "error" in result:
            raise UserError(result["error"])
        if code != 0 or "report" not in result:
            raise RuntimeError(
                f"conversion job failed (exit {code}; rank 0's output is above)\n{rank_logs(log_dir)}"
            )
        return ConvertReport(**result["report"])


def rank_logs(log_dir: Path, lines: int = 30) -> str:
    """The last `lines` lines of each redirected rank's stdout/stderr under torchrun's `log_dir`
    (`<run id>/attempt_<n>/<local rank>/std{out,err}.log`)."""
    parts = []
    for f in sorted(log_dir.rglob("std*.log"), key=lambda p: (p.parent.name, p.name)):
        text = f.read_text(errors="replace").strip()
        if text:
            tail = "\n".join(text.splitlines()[-lines:])
            parts.append(f"--- rank {f.parent.name} {f.stem} ---\n{tail}")
    return "\n".join(parts) or "(the other ranks wrote nothing)"
