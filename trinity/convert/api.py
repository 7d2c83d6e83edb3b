"""`trinity convert` as plain functions: HF -> megatron-core dist checkpoint and back.

World size 1 runs in this process; `tp * pp * ep > 1` runs the same code as a torchrun job (gloo on
CPU, nccl on GPU) in which every rank loads only its slice and writes its own shards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trinity.convert.hf_io import HFCheckpoint
from trinity.convert.outdir import check_output
from trinity.errors import UserError
from trinity.models.facts import ModelFacts

DTYPES = ("bf16", "fp16", "fp32")
BACKENDS = ("builtin", "mbridge")


@dataclass
class ConvertReport:
    direction: str
    output: str
    bytes_written: int
    seconds: float
    tensors: int = 0
    max_abs_diff: float | None = None
    mean_abs_diff: float | None = None
    verified: str | None = None  # what was compared, when --verify

    @property
    def gb_per_s(self) -> float:
        return self.bytes_written / 1e9 / self.seconds if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        line = (
            f"{self.direction}: wrote {self.bytes_written / 1e9:.3f} GB to {self.output} in {self.seconds:.2f} s "
            f"({self.gb_per_s:.2f} GB/s)"
        )
        if self.verified:
            line += f"; verified {self.verified}: max |Δ| {self.max_abs_diff:.3e}, mean |Δ| {self.mean_abs_diff:.3e}"
        return line


def torch_dtype(name: str) -> Any:
    import torch

    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if name not in table:
        raise UserError(f"--dtype: {name!r} is not one of {', '.join(DTYPES)}")
    return table[name]


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def megatron_config(*, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1) -> Any:
    """The job-config megatron block for a conversion layout (other fields at their defaults).

    Parameters are not randomly initialised: every one is overwritten by the loader (which checks
    that), and megatron-core's CPU init materialises full master weights, which would set the peak.
    """
    from trinity.config.megatron import MegatronConfig

    return MegatronConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        override_transformer_config={"perform_initialization": False},
    )


def dir_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


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
) -> ConvertReport:
    """Convert an HF folder into a megatron-core dist checkpoint (loadable by any TP/PP/VPP/EP)."""
    if backend not in BACKENDS:
        raise UserError(f"--backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    torch_dtype(dtype)
    facts = ModelFacts.from_hf_dir(hf_path)
    from trinity.convert.registry import weight_map

    weight_map(facts.family, facts.source)
    HFCheckpoint(hf_path)  # validates index and shards before any process starts
    check_output(output, force)
    args = dict(hf_path=str(Path(hf_path).resolve()), output=str(Path(output).resolve()), tp=tp, pp=pp,
                vpp=vpp, ep=ep, backend=backend, dtype=dtype, force=force, device=_device(device))
    start = time.perf_counter()
    world = tp * pp * ep
    if world == 1:
        from trinity.convert.jobs import run_hf_to_mcore

        report = run_hf_to_mcore(**args)
    else:
        report = _torchrun(world, args)
    report.seconds = time.perf_counter() - start
    if verify:
        from trinity.convert.jobs import verify_mcore_against_hf

        diff = verify_mcore_against_hf(output, hf_path, device=args["device"])
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
    check_output(output, force)
    from trinity.convert.jobs import run_mcore_to_hf

    return run_mcore_to_hf(
        str(Path(mcore_path).resolve()), str(Path(output).resolve()), meta=meta, dtype=dtype, verify=verify,
        force=force, device=_device(device),
    )


def _torchrun(world: int, args: dict[str, Any]) -> ConvertReport:
    """Run the conversion as `world` ranks; rank 0 leaves its report (or the user error) in a file."""
    import trinity

    with tempfile.TemporaryDirectory(prefix="trinity-convert-") as tmp:
        args_path = Path(tmp) / "args.json"
        report_path = Path(tmp) / "report.json"
        args_path.write_text(json.dumps({"args": args, "report": str(report_path)}))
        env = dict(os.environ)
        root = str(Path(trinity.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               "-m", "trinity.convert.worker", str(args_path)]
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        result = json.loads(report_path.read_text()) if report_path.is_file() else {}
        if "error" in result:
            raise UserError(result["error"])
        if proc.returncode != 0 or "report" not in result:
            tail = "\n".join(proc.stdout.splitlines()[-30:])
            raise RuntimeError(f"conversion job failed (exit {proc.returncode}):\n{tail}")
        return ConvertReport(**result["report"])


def report_to_json(report: ConvertReport) -> dict[str, Any]:
    return asdict(report)
