"""Silence the known, harmless third-party warnings and progress bars that bury a job's useful lines.

A tiny CPU job printed 30 warning lines per process before its first step: megatron-core's fallbacks
for a missing Transformer Engine / apex, deprecations inside megatron-core and torch.distributed that
the user cannot act on. They are filtered by message (and category) only, so any other warning still
shows; `--debug` (TRINITY_DEBUG=1 in the workers) keeps every one of them, and the progress bars.

`install()` must run before megatron-core is imported: most of these fire at import time. Library
calls that users make from their own Python (`trinity.cli.generate.generate_answers`, the first import
of megatron-core after `import trinity`: trinity.compat.megatron_import) run inside `hidden()` instead, which
leaves the caller's warning filters as they were.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from typing import Callable, Iterator, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

# Set to "1" in the workers of `trinity run --debug` (trinity.launch.torchrun.worker_env).
DEBUG_ENV = "TRINITY_DEBUG"

# (category, regex matched against the start of the warning's message, where it comes from)
KNOWN: list[tuple[type[Warning], str, str]] = [
    # megatron-core at import without Transformer Engine / apex (every CPU job, GPUs without TE)
    (UserWarning, r"Transformer Engine and Apex are not installed", "megatron.core (optimizer, fsdp, clip_grads)"),
    (UserWarning, r"Apex is not installed", "megatron.core (models/backends, gpt_layer_specs)"),
    # TransformerConfig's own default cuda_graph_scope="full" warns about itself (megatron-core 0.16)
    (UserWarning, r"full scope is deprecated", "megatron.core.transformer.transformer_config"),
    # megatron-core's dist_checkpointing on torch's deprecated APIs
    (FutureWarning, r"`load_state_dict` is deprecated", "megatron.core.dist_checkpointing.strategies.torch"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor", "torch.distributed.checkpoint"),
    # megatron-core's DDP / distributed optimizer on deprecated torch.distributed collectives
    (FutureWarning, r"`torch\.distributed\.\w+` is deprecated", "torch.distributed.c10d_logger"),
    # megatron-core's grad buffer offload (param_and_grad_buffer) on tensor.storage()
    (UserWarning, r"TypedStorage is deprecated", "megatron.core.distributed.param_and_grad_buffer"),
    # megatron-core's zero_grad reads `.grad` of every param in its groups
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor", "megatron.core.optimizer.optimizer"),
    # TransformerConfig on ROLL's moe_layer_recompute, which docs/migrating.md maps (megatron-core turns it
    # into selective recompute of the MoE layers itself)
    (UserWarning, r"--moe-layer-recompute is deprecated", "megatron.core.transformer.transformer_config"),
    # TransformerConfig on selective recompute of core_attn (its default module): advice for
    # TransformerEngine's fused attention
    (UserWarning, r"If you are using transformer_engine as the transformer implementation, the core_attn",
     "megatron.core.transformer.transformer_config"),
    # megatron-core's TP linears at the first backward, on CPU too: a CUDA stream setting whose value
    # depends on the overlap options, which trinity chooses per job
    (UserWarning, r"When using (async grad allreduce|sequence parallelism) it is recommended to set the environment "
                  r"variable CUDA_DEVICE_MAX_CONNECTIONS", "megatron.core.tensor_parallel.layers"),
]

# Read by huggingface_hub (and transformers through it: "Writing model shards", "Loading checkpoint
# shards") and by datasets when they are imported: their tqdm bars stay off. A value the user set wins.
PROGRESS_BARS_OFF = ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")

_debug: bool | None = None  # what install() was told; None: not called in this process


def debug() -> bool:
    """Whether this process shows every third-party warning: `--debug` (install(True)), or TRINITY_DEBUG=1."""
    return _debug if _debug is not None else os.environ.get(DEBUG_ENV) == "1"


def install(debug: bool) -> None:
    """Ignore the KNOWN warnings and turn the libraries' progress bars off in this process (and the
    processes it starts), unless `debug`."""
    global _debug
    _debug = debug
    if debug:
        return
    _ignore_known()
    for name in PROGRESS_BARS_OFF:
        os.environ.setdefault(name, "1")


@contextlib.contextmanager
def hidden() -> Iterator[None]:
    """The KNOWN warnings ignored inside the block only, unless debug()."""
    with warnings.catch_warnings():
        if not debug():
            _ignore_known()
        yield


def quietly(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` run inside hidden(): for library calls users make from their own Python."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        with hidden():
            return fn(*args, **kwargs)

    return call


def _ignore_known() -> None:
    for category, message, _ in KNOWN:
        warnings.filterwarnings("ignore", message=message, category=category)
