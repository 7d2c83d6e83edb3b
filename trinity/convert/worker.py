"""A conversion's child process, `python -m trinity.convert.worker ARGS.json`: each rank of a multi-rank
conversion under torchrun, or the one process of the CLI's conversions (`trinity.convert.api.conversion_job`).

Rank 0's output reaches the user's terminal (progress bar included); the other ranks' goes to
torchrun's log files. Rank 0 writes `{"report": ...}` or
`{"error": "<user error>"}` to the report path named in ARGS.json; the parent
(`trinity.convert.api`) turns it back into a ConvertReport or a UserError.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from trinity.launch import child

    # the known third-party warnings hidden (unless --debug); ranks under torchrun end when the CLI that
    # started them is gone (kill -9)
    child.setup()
    spec = json.loads(Path(argv[0]).read_text())
    report_path = Path(spec["report"])
    rank = int(os.environ.get("RANK", "0"))
    from trinity.convert.report import report_to_json
    from trinity.convert.jobs import run_hf_to_mcore
    from trinity.errors import UserError

    if rank == 0 and spec.get("world", 1) > 1:
        a = spec["args"]
        print(
            f"rank 0 of {spec.get('world', '?')}: converting {a.get('hf_path')} with TP={a.get('tp')} PP={a.get('pp')} "
            f"VPP={a.get('vpp')} EP={a.get('ep')} on {a.get('device')}",
            flush=True,
        )
    from trinity.launch.failures import disk_errors

    try:
        # a full or read-only disk is the user's to fix: one line naming the file, as in the CLI
        with disk_errors(Path(spec["args"]["output"])):
            report = run_hf_to_mcore(**spec["args"])
    except UserError as exc:
        if rank == 0 or not report_path.exists():
            report_path.write_text(json.dumps({"error": str(exc)}))
        print(f"rank {rank}: {exc}", file=sys.stderr)
        return 2
    if rank == 0:
        report_path.write_text(json.dumps({"report": report_to_json(report)}))
    return 0


if __name__ == "__main__":  # the dist-checkpoint writer re-imports __main__: keep the guard
    from trinity.launch.child import exit_without_teardown

    exit_without_teardown(main(sys.argv[1:]))
