"""Entry point of every rank: `python -m trinity.trainer.worker <resolved_config.yaml>`.

Parse, set up the parallel state, run the algorithm's recipe in the training loop (the recipe builds
its role engines), and always tear the process groups down. A UserError on any rank ends the job with
one clean line (printed by the rank that hit it; torchrun shows rank 0) and exit code 2; anything else
is a bug with a traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from trinity.errors import UserError


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def run_worker(config_path: str | Path) -> None:
    import torch
    import torch.distributed as dist

    from trinity.config.loader import load_config
    from trinity.distributed import parallel
    from trinity.trainer.context import WorkerContext
    from trinity.trainer.engine.setup import training_dtype
    from trinity.trainer.loop import run

    loaded = load_config(config_path, check_paths=True)
    cfg = loaded.config
    recipe = cfg.spec.load_recipe()
    megatron = cfg.actor_rollout_ref.actor.megatron
    device_kind = cfg.cluster.device
    try:
        parallel.init_parallel(device=device_kind, layout=megatron.layout(), seed=megatron.seed)
        if device_kind == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        dtype = training_dtype(cfg.model.dtype, device_kind)
        ctx = WorkerContext(loaded=loaded, device=device, dtype=dtype, rank=dist.get_rank(), world_size=dist.get_world_size())
        run(ctx, recipe)
    finally:
        parallel.destroy()


def main(argv: list[str] | None = None) -> int:
    from trinity.launch import child; child.setup()  # noqa: E702 - first: quiet known warnings, stop with `trinity run`
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m trinity.trainer.worker <resolved_config.yaml>", file=sys.stderr)
        return 2
    try:
        run_worker(args[0])
    except UserError as exc:
        if os.environ.get(child.DEBUG_ENV) == "1":  # `trinity run --debug`: where it was raised
            import traceback

            traceback.print_exc()
        # Every rank prints its own (its log keeps it); the console shows rank 0's.
        print(f"error (rank {_rank()}): {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        from trinity.launch.failures import disk_error, disk_error_message

        out = Path(args[0]).parent  # the resolved config lives in the output_dir
        err = disk_error(exc, out)
        if err is None:
            raise
        if os.environ.get(child.DEBUG_ENV) == "1":
            import traceback

            traceback.print_exc()
        # A full or read-only disk is the user's to fix: one line (trinity run finds it in this rank's
        # log), the resolved config's folder (the output_dir) when the file is not known.
        print(f"error (rank {_rank()}): {disk_error_message(err, out)}", file=sys.stderr, flush=True)
        return UserError.exit_code
    return 0


if __name__ == "__main__":
    from trinity.launch.child import exit_without_teardown

    # An exception other than a UserError propagates: the traceback and the normal exit (code 1).
    exit_without_teardown(main())
