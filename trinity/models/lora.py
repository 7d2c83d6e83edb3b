"""LoRA adapters on megatron-core's tensor-parallel linears (actor.lora).

Each targeted linear (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2` of every decoder layer)
keeps its own name and parameters (base state-dict keys do not change: converters, the checkpoint
loader and the rollout decoders keep reading `...linear_qkv.weight`) and gets a submodule `lora`
(`LoraAdapter`, parameters `lora_A` [r, in_local] and `lora_B` [out_local, r]) plus a forward hook that
adds `scaling * dropout(x) @ A^T @ B^T` to the module's output, `scaling = alpha / rank`.

Tensor parallelism: the adapter is split like its base weight, so its matmuls need only a [s, b, r]
collective beside the base layer's (r is small):
- column-parallel base (linear_qkv, linear_fc1): A full [r, in] (replicated), B [out/TP, r] sharded by
  output rows like the base weight. `h = x A^T` goes through `copy_to_tensor_model_parallel_region`
  (backward all-reduces dh, which each rank's B shard only partly produces). Under sequence parallel
  x is this rank's sequence shard (the base gathers it inside): h is computed on the shard and
  all-gathered ([s/TP, b, r] -> [s, b, r]); A's gradient is then TP-partial and tagged
  `sequence_parallel`, which finalize_model_grads sums over TP.
- row-parallel base (linear_proj, linear_fc2): A [r, in/TP] sharded by input columns like the base
  weight, B full [out, r]. `h = x A^T` is TP-partial: all-reduced (reduce-scattered along the sequence
  under sequence parallel, where B's gradient is then TP-partial and tagged `sequence_parallel`).
A is initialised Kaiming-uniform (as PEFT) from a generator seeded by the layer's global name, then
sliced: the same adapter at every TP / PP / VPP layout. B is zero: a fresh adapter changes nothing.

The base parameters are frozen in place (requires_grad False, their dtype as built: bf16 on GPU);
megatron DDP then gives buffers, and the optimizer master weights and states, to the adapters only.

TransformerEngine: its fused `TELayerNormColumnParallelLinear` (linear_qkv and linear_fc1 of the TE
spec) receives the PRE-norm hidden states, so a hook there would see the wrong input: refused
(`apply_lora` raises UserError). TE is not installed on our CPUs or GPUs, so no TE path is tested.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from typing import Any, Iterator

import torch

from trinity.errors import UserError

from trinity.models.lora_targets import (  # noqa: F401  (the names are part of this module's API)
    ALL_LINEAR,
    COLUMN_PARALLEL,
    HF_TO_MCORE,
    MCORE_TARGETS,
    ROW_PARALLEL,
    adapter_parameter_count,
    resolve_targets,
)

_INIT_SEED = 1234  # A's init: a fixed seed per global layer name (see `_init_a`)


def _is_te_fused_norm(module: torch.nn.Module) -> bool:
    return "LayerNorm" in type(module).__name__ and "Linear" in type(module).__name__


class LoraAdapter(torch.nn.Module):
    """The low-rank update of one megatron linear (see the module docstring for the TP split)."""

    def __init__(
        self, *, kind: str, in_local: int, out_local: int, rank: int, alpha: float, dropout: float,
        tp_group: Any, sequence_parallel: bool, dtype: torch.dtype, device: torch.device,
    ):
        super().__init__()
        if kind not in ("column", "row"):
            raise ValueError(kind)
        self.kind, self.rank, self.scaling = kind, rank, alpha / rank
        self.tp_group = tp_group
        self.tp = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
        self.sequence_parallel = sequence_parallel and self.tp > 1
        self.lora_A = torch.nn.Parameter(torch.empty(rank, in_local, dtype=dtype, device=device))
        self.lora_B = torch.nn.Parameter(torch.zeros(out_local, rank, dtype=dtype, device=device))
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.enabled = True  # adapters_disabled / adapters_merged switch the hook off
        self.gated = False  # B holds [gate; up] rows per TP rank (linear_fc1 of a gated MLP): checkpoint layout
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        # The sharded one is TP-parallel (grad-norm counts it on every TP rank); the other replicated.
        sharded, full = (self.lora_B, self.lora_A) if kind == "column" else (self.lora_A, self.lora_B)
        set_tensor_model_parallel_attributes(sharded, True, 0 if kind == "column" else 1, 1)
        set_tensor_model_parallel_attributes(full, False, -1, 1)
        if self.sequence_parallel:
            # computed from a sequence shard only: finalize_model_grads sums it over TP
            full.sequence_parallel = True

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """scaling * dropout(x) A^T B^T, shaped like the base layer's output on this rank."""
        from megatron.core import tensor_parallel as tpm

        if isinstance(self.dropout, torch.nn.Dropout) and self.tp > 1 and (self.kind == "row" or self.sequence_parallel):
            # x is this rank's shard (of the features, or of the sequence): its mask comes from the
            # per-TP-rank stream, as megatron draws dropout on sharded activations; a replicated x keeps
            # the default stream, the same on every TP rank, so that h = A x stays identical across them
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                x = self.dropout(x)
        else:
            x = self.dropout(x)
        h = torch.nn.functional.linear(x, self.lora_A)
        if self.tp > 1:
            if self.kind == "column":
                h = (tpm.gather_from_sequence_parallel_region(h, True, group=self.tp_group) if self.sequence_parallel
                     else tpm.copy_to_tensor_model_parallel_region(h, group=self.tp_group))
            else:
                h = (tpm.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group) if self.sequence_parallel
                     else tpm.reduce_from_tensor_model_parallel_region(h, group=self.tp_group))
        return torch.nn.functional.linear(h, self.lora_B) * self.scaling

    def merged_delta(self) -> torch.Tensor:
        """scaling * B @ A in fp32, shaped like this rank's base weight shard."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scaling


def _hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    adapter: LoraAdapter = module.lora
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs.get("input_", kwargs.get("input"))
    if isinstance(output, tuple):
        return (output[0] + adapter.delta(x).to(output[0].dtype), *output[1:])
    return output + adapter.delta(x).to(output.dtype)


def active_adapter(module: torch.nn.Module) -> LoraAdapter | None:
    """The module's adapter while it acts on the output (present and not switched off by
    `adapters_disabled` / `adapters_merged`), else None."""
    adapter = getattr(module, "lora", None)
    return adapter if isinstance(adapter, LoraAdapter) and adapter.enabled else None


def linear(x: torch.Tensor, module: torch.nn.Module, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + bias of a megatron linear read directly (the rollout decoders' lean path), plus its
    active adapter's scaling * x A^T B^T: what the module's forward with its hook gives, without the hook.
    No dropout (decoding is evaluation) and no TP collective (at TP>1 the decoder all-reduces a row-parallel
    product itself, adapter included: `StageDecoder._row_parallel_add`). Inside a
    CUDA graph the adapter's A and B are read by address, as the base weight is, so a graph captured with
    adapters active decodes the adapted model whatever values they hold when it replays."""
    y = torch.nn.functional.linear(x, module.weight, bias)
    return _add_delta(y, x, active_adapter(module))


def addmm(residual: torch.Tensor, x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """residual + x W^T (the decoders fold the residual add into the output GEMM), plus the active
    adapter's scaling * x A^T B^T; x and residual 2-D [tokens, features]. In place: `residual` is
    overwritten with the result and returned. The decoders own the residual stream they pass (a fresh
    embedding, or their copy of a received hidden state: `StageDecoder._residual_stream`); an out-of-place addmm
    first copies the residual into its output, one extra kernel per GEMM (48 a decode step at 0.5B)."""
    y = residual.addmm_(x, module.weight.t())
    return _add_delta(y, x, active_adapter(module))


def _add_delta(y: torch.Tensor, x: torch.Tensor, adapter: LoraAdapter | None) -> torch.Tensor:
    """y (a product this module just computed, overwritten when 2-D) + the adapter's scaled x A^T B^T."""
    if adapter is None:
        return y
    h = torch.nn.functional.linear(x, adapter.lora_A)  # [tokens, r]
    if y.dim() == 2:
        return y.addmm_(h, adapter.lora_B.t(), alpha=adapter.scaling)  # one GEMM adds B h, scaled
    return y + torch.nn.functional.linear(h, adapter.lora_B) * adapter.scaling


def _sharded_state_dict(module: torch.nn.Module, original: Any) -> Any:
    """The linear's sharded_state_dict with its adapter split like the adapter (megatron's own treats
    every tensor but `weight`/`bias` as TP-replicated)."""

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = original(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)
        adapter: LoraAdapter = module.lora
        axis = {"lora_B": 0} if adapter.kind == "column" else {"lora_A": 1}
        tensors = {"lora_A": adapter.lora_A, "lora_B": adapter.lora_B}
        dp_cp = (metadata or {}).get("dp_cp_group")
        kwargs = {"tp_group": module.tp_group, "dp_cp_group": dp_cp} if dp_cp is not None else {}
        adapter_sd = make_sharded_tensors_for_checkpoint(tensors, f"{prefix}lora.", axis, sharded_offsets, **kwargs)
        if adapter.gated:
            # linear_fc1 of a gated MLP holds [gate shard; up shard] per TP rank, not a contiguous row range
            # of the whole [gate; up]: stored as two halves, as megatron's MLP stores the weight itself,
            # so a checkpoint reshards to another TP size
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            key = f"{prefix}lora.lora_B"
            singleton = (metadata or {}).get("singleton_local_shards", False)
            adapter_sd[key] = apply_swiglu_sharded_factory(adapter_sd[key], sharded_offsets, singleton)
        out.update(adapter_sd)
        return out

    return sharded_state_dict


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _layer_linears(chunk: torch.nn.Module) -> Iterator[tuple[str, str, torch.nn.Module]]:
    """(name relative to the chunk, global name, module) of every module of the decoder layers; the
    global name has the layer's global index (HF layer index), the same at every PP/VPP layout."""
    model = _unwrap(chunk)
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        return
    for local, layer in enumerate(decoder.layers):
        global_index = layer.layer_number - 1
        for sub, module in layer.named_modules():
            if sub:
                yield f"decoder.layers.{local}.{sub}", f"decoder.layers.{global_index}.{sub}", module


def _init_a(global_name: str, rank: int, in_full: int, start: int, stop: int) -> torch.Tensor:
    """PEFT's Kaiming-uniform A (bound 1/sqrt(in)) of the whole layer, columns [start, stop) of it."""
    g = torch.Generator().manual_seed(_INIT_SEED + zlib.crc32(global_name.encode()))
    bound = 1.0 / math.sqrt(in_full)
    full = torch.rand(rank, in_full, generator=g, dtype=torch.float32) * (2 * bound) - bound
    return full[:, start:stop]


def _targets_of(cfg: Any) -> list[str]:
    try:
        return resolve_targets(cfg.target_modules)
    except ValueError as exc:
        raise UserError(f"actor_rollout_ref.actor.lora.target_modules: {exc}") from None


def apply_lora(chunks: list[torch.nn.Module], cfg: Any) -> int:
    """Add adapters in place to every model chunk (bare GPTModels, before DDP wrapping), freeze every
    base parameter, and return the number of trainable adapter parameters on this rank.

    `cfg`: anything with `rank`, `alpha`, `dropout`, `target_modules` (LoraConfig)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if cfg.rank < 1:
        raise ValueError("apply_lora needs lora.rank >= 1")
    targets = set(_targets_of(cfg))
    for chunk in chunks:
        chunk.requires_grad_(False)
    trainable = 0
    for chunk in chunks:
        for local, global_name, module in list(_layer_linears(chunk)):
            leaf = local.rsplit(".", 1)[-1]
            if leaf not in targets:
                continue
            if _is_te_fused_norm(module):
                raise UserError(
                    "actor_rollout_ref.actor.lora: TransformerEngine's fused layernorm-linear "
                    f"({type(module).__name__}) is not supported by LoRA; uninstall transformer_engine "
                    "(trinity then uses its own layer spec)"
                )
            if getattr(module, "is_expert", False):
                raise UserError(
                    f"actor_rollout_ref.actor.lora.target_modules: {leaf} of an MoE expert is not supported; "
                    "target linear_qkv and linear_proj only on MoE models"
                )
            if hasattr(module, "lora"):
                continue  # applied already
            expect = ColumnParallelLinear if leaf in COLUMN_PARALLEL else RowParallelLinear
            weight = module.weight
            tp_group = getattr(module, "tp_group", None)
            tp = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
            tp_rank = torch.distributed.get_rank(tp_group) if tp_group is not None else 0
            if not isinstance(module, expect) and not type(module).__name__.startswith("TE"):
                raise UserError(f"actor_rollout_ref.actor.lora: {local} is a {type(module).__name__}, not a "
                                f"{expect.__name__}; LoRA supports megatron-core's parallel linears only")
            if getattr(module, "gather_output", False):
                raise UserError(f"actor_rollout_ref.actor.lora: {local} gathers its output; not supported")
            out_local, in_local = weight.shape
            kind = "column" if leaf in COLUMN_PARALLEL else "row"
            adapter = LoraAdapter(
                kind=kind, in_local=in_local, out_local=out_local, rank=cfg.rank, alpha=cfg.alpha,
                dropout=cfg.dropout, tp_group=tp_group if tp > 1 else None,
                sequence_parallel=bool(getattr(module, "sequence_parallel", False)),
                dtype=weight.dtype, device=weight.device,
            )
            start = 0 if kind == "column" else tp_rank * in_local
            in_full = in_local if kind == "column" else in_local * tp
            with torch.no_grad():
                adapter.lora_A.copy_(_init_a(global_name, cfg.rank, in_full, start, start + in_local))
            adapter.gated = leaf == "linear_fc1" and bool(getattr(module.config, "gated_linear_unit", False))
            module.lora = adapter
            module.register_forward_hook(_hook, with_kwargs=True)
            if hasattr(module, "sharded_state_dict"):
                module.sharded_state_dict = _sharded_state_dict(module, module.sharded_state_dict)
            trainable += adapter.lora_A.numel() + adapter.lora_B.numel()
        model = _unwrap(chunk)
        embedding = getattr(model, "embedding", None) if getattr(model, "pre_process", False) else None
        if embedding is not None and getattr(model.config, "recompute_granularity", None) == "full":
            embedding.register_forward_hook(_input_requires_grad)
    return trainable


def _input_requires_grad(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Full recompute checkpoints each layer in an autograd.Function whose only tensor inputs are the
    hidden states: with a frozen embedding they need no grad, so the layers' outputs would not either
    and the adapters inside would get none. Marking the embedding output as requiring grad (what PEFT's
    enable_input_require_grads does) keeps the graph; later pipeline stages receive activations that
    require grad already."""
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
        output.requires_grad_(True)
    return output


def lora_modules(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Module, LoraAdapter]]:
    """(name relative to the chunk, the megatron linear, its adapter) of every adapted linear."""
    for chunk in chunks:
        for name, module in _unwrap(chunk).named_modules():
            adapter = getattr(module, "lora", None)
            if isinstance(adapter, LoraAdapter):
                yield name, module, adapter


def has_lora(chunks: list[torch.nn.Module]) -> bool:
    return next(lora_modules(chunks), None) is not None


def trainable_parameters(chunks: list[torch.nn.Module]) -> int:
    """Adapter parameters on this rank (local TP shards)."""
    return sum(a.lora_A.numel() + a.lora_B.numel() for _, _, a in lora_modules(chunks))


@contextlib.contextmanager
def adapters_disabled(chunks: list[torch.nn.Module]) -> Iterator[None]:
    """Inside, the model computes exactly the base model (the reference policy of RL / DPO)."""
    adapters = [a for _, _, a in lora_modules(chunks)]
    before = [a.enabled for a in adapters]
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a, was in zip(adapters, before):
            a.enabled = was


@contextlib.contextmanager
def adapters_merged(chunks: list[torch.nn.Module], keep: str = "host") -> Iterator[None]:
    """Inside, each adapted base weight holds W + scaling * B @ A (rounded to its dtype) and the hooks
    are off, for code that reads weights directly (the rollout decoders, exports). On exit every base
    weight gets its original bits back. `keep`: where the original bits wait meanwhile: "host" (one
    layer's weights at a time are copied out, never the adapters' optimizer state; slow for a whole
    7B model, see trinity.trainer.recipes.lora_ref) or "device" (a copy beside them: milliseconds)."""
    if keep not in ("host", "device"):
        raise ValueError(f"adapters_merged: keep must be 'host' or 'device', got {keep!r}")
    entries = [(m, a) for _, m, a in lora_modules(chunks)]
    saved: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
    try:
        with torch.no_grad():
            for module, adapter in entries:
                w = module.weight
                original = w.detach().to("cpu", copy=True) if keep == "host" else w.detach().clone()
                saved.append((w, original, adapter.enabled))
                w.copy_((w.float() + adapter.merged_delta()).to(w.dtype))
                adapter.enabled = False
        yield
    finally:
        with torch.no_grad():
            for (w, original, was), (_, adapter) in zip(saved, entries):
                w.copy_(original)
                adapter.enabled = was


def adapter_state_dict(chunks: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Adapter parameters only (this rank's TP shards), keyed `<linear path>.lora.lora_A|B` relative to
    the chunk, prefixed `chunk<i>.` when there are several chunks (VPP)."""
    out: dict[str, torch.Tensor] = {}
    several = len(chunks) > 1
    for i, chunk in enumerate(chunks):
        for name, _, adapter in lora_modules([chunk]):
            prefix = f"chunk{i}." if several else ""
            out[f"{prefix}{name}.lora.lora_A"] = adapter.lora_A.detach()
            out[f"{prefix}{name}.lora.lora_B"] = adapter.lora_B.detach()
    return out


__all__ = [
    "ALL_LINEAR", "COLUMN_PARALLEL", "HF_TO_MCORE", "MCORE_TARGETS", "ROW_PARALLEL", "LoraAdapter",
    "active_adapter", "adapter_state_dict", "adapters_disabled", "adapters_merged", "addmm", "apply_lora", "has_lora",
    "linear", "lora_modules",
    "resolve_targets", "trainable_parameters",
]
