"""LoRA adapters as a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`) that
`peft.PeftModel.from_pretrained(hf_model, folder)` loads on the Hugging Face model, and back.

Our adapters sit on megatron-core's linears (trinity.models.lora); PEFT's on the HF projections. The
map is the weight converter's (trinity.convert.families), applied to the adapter's output side:

- `linear_qkv` (q, k, v fused in megatron's per-query-group interleaved rows): one A [r, h] shared by
  the three, B [rows, r] in the fused layout. PEFT gets q_proj / k_proj / v_proj adapters with that same
  A and their rows of B, de-interleaved exactly as the base weight is (`weightmap.to_hf`, Kind.QKV):
  (B_q A) x = the q rows of (B A) x, so PEFT's three adapters compute what ours computes.
- `linear_fc1` ([gate; up] fused): gate_proj / up_proj with the same A and the halves of B.
- `linear_proj` -> o_proj, `linear_fc2` -> down_proj: A and B as they are.

TP: B of a column-parallel linear is sharded by output rows as its base weight (swiglu fc1: [gate_r; up_r]
on rank r), A of a row-parallel linear by input columns; both are gathered with the converter's
`tp_merge` and cut back with `tp_split`. PEFT's scaling is lora_alpha / r (use_rslora false): the
folder's `r` and `lora_alpha` are the job's rank and alpha, so it equals ours.

The way back (`load_peft_adapters`) takes our own folders and any PEFT folder whose q/k/v (gate/up)
adapters share one A, which is what a fused module can hold. A foreign folder trained with a separate A
per projection is refused, naming the file: holding it exactly would need rank 3r on linear_qkv (A
stacked, B block-diagonal), a different adapter shape from the job's `lora.rank`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from trinity.distributed import collectives
from trinity.errors import UserError
from trinity.models.lora_targets import PEFT_CONFIG_FILE as CONFIG_FILE
from trinity.models.lora_targets import PEFT_WEIGHTS_FILE as WEIGHTS_FILE

# PEFT's saved keys: the PeftModel's module path without the adapter name ("default").
_PREFIX = "base_model.model."
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclass
class FullAdapter:
    """One megatron linear's adapter, gathered over TP: A [r, in], B [out, r] (full, fp32 on the host)."""

    A: torch.Tensor
    B: torch.Tensor


def _geometry(facts: Any) -> Any:
    from trinity.convert.weightmap import Geometry

    # The vocabulary is never part of an adapter: its sizes do not matter here.
    return Geometry(num_heads=facts.num_attention_heads, num_groups=facts.num_query_groups,
                    head_dim=facts.head_dim, vocab_size=facts.vocab_size, padded_vocab_size=facts.vocab_size)


def _rule(wmap: Any, linear: str, facts: Any) -> tuple[Any, dict[str, int]]:
    """The converter's rule of `<linear>.weight` (global names) and its indices."""
    found = wmap.for_mcore(f"{linear}.weight", facts.tie_word_embeddings)
    if found is None:
        raise UserError(f"LoRA adapter on {linear!r}: the {wmap.family!r} weight map has no HF name for its weight")
    rule, idx = found
    if rule.expert:
        raise UserError(
            f"LoRA adapter on {linear!r}: a PEFT folder holds adapters of attention and dense MLP projections only "
            "(Hugging Face MoE experts are not nn.Linear modules PEFT can wrap)"
        )
    return rule, idx


def _hf_modules(rule: Any, idx: dict[str, int]) -> list[str]:
    """The HF module paths of a rule's tensors (`model.layers.3.self_attn.q_proj`), in its order."""
    return [name.removesuffix(".weight") for name in rule.hf_names(idx.get("L"))]


def peft_tensors(adapters: dict[str, FullAdapter], facts: Any) -> dict[str, torch.Tensor]:
    """Full adapters keyed by global megatron linear name -> PEFT's tensors keyed as PEFT saves them
    (`base_model.model.<hf module>.lora_A.weight` / `.lora_B.weight`). Pure: no process group."""
    from trinity.convert.registry import weight_map
    from trinity.convert.weightmap import to_hf

    wmap, geo = weight_map(facts.family, facts.source), _geometry(facts)
    out: dict[str, torch.Tensor] = {}
    for linear in sorted(adapters, key=_natural):
        a = adapters[linear]
        rule, idx = _rule(wmap, linear, facts)
        # B's rows split as the base weight's rows do (q/k/v de-interleaved, [gate; up] halved); A is shared.
        for module, b in zip(_hf_modules(rule, idx), to_hf(rule, a.B, geo), strict=True):
            out[f"{_PREFIX}{module}.lora_A.weight"] = a.A.contiguous()
            out[f"{_PREFIX}{module}.lora_B.weight"] = b.contiguous()
    return out


def target_modules(adapters: dict[str, FullAdapter], facts: Any) -> list[str]:
    """PEFT's target_modules: the HF projection names the adapters cover (q_proj, o_proj, ...)."""
    from trinity.convert.registry import weight_map

    wmap = weight_map(facts.family, facts.source)
    names = {m.rsplit(".", 1)[-1] for linear in adapters for m in _hf_modules(*_rule(wmap, linear, facts))}
    return sorted(names)


def adapter_config(*, rank: int, alpha: float, dropout: float, targets: list[str], base_model: str) -> dict[str, Any]:
    """adapter_config.json: PEFT's LoraConfig fields whose defaults are not what our adapters are."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": targets,
        # scaling = lora_alpha / r, as ours; no bias, no DoRA, weights [out, in] (not Conv1D's transposed)
        "use_rslora": False, "use_dora": False, "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
    }


# ---------------------------------------------------------------- gathering our adapters (collective)


def _global_linear(chunk: Any, name: str) -> str:
    """A linear's name relative to a pipeline chunk -> its name in the whole model (global layer)."""
    from trinity.models.build import unwrap

    m = _LAYER.match(name)
    if m is None:
        return name
    layer = unwrap(chunk).decoder.layers[int(m.group(1))].layer_number - 1
    return f"decoder.layers.{layer}.{name[m.end():]}"


def _local_adapters(chunks: list[Any]) -> Iterator[tuple[str, Any, Any]]:
    """(global linear name, megatron linear, LoraAdapter) of every local chunk."""
    from trinity.models.build import unwrap
    from trinity.models.lora import lora_modules

    for chunk in chunks:
        for name, linear, adapter in lora_modules([unwrap(chunk)]):
            yield _global_linear(chunk, name), linear, adapter


def gather_adapters(chunks: list[Any], facts: Any) -> dict[str, FullAdapter]:
    """Every adapter of the model, whole (TP shards merged), fp32 on the host, on global rank 0
    (an empty dict elsewhere). Every rank must call it (TP all-gathers, then one gather to rank 0)."""
    from megatron.core import parallel_state as ps

    from trinity.convert.registry import weight_map
    from trinity.convert.weightmap import tp_merge

    wmap = weight_map(facts.family, facts.source)
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    tp = ps.get_tensor_model_parallel_world_size() if dist and ps.model_parallel_is_initialized() else 1
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    mine: dict[str, FullAdapter] = {}
    for linear, _, adapter in _local_adapters(chunks):
        rule, _ = _rule(wmap, linear, facts)
        a, b = adapter.lora_A.detach(), adapter.lora_B.detach()
        if tp > 1 and rule.tp_dim is not None:
            # column-parallel: B holds the base weight's rows; row-parallel: A holds its columns
            shard = b if rule.tp_dim == 0 else a
            full = tp_merge(rule, collectives.all_gather(shard, group=group))
            a, b = (a, full) if rule.tp_dim == 0 else (full, b)
        mine[linear] = FullAdapter(a.float().cpu(), b.float().cpu())
    if not dist or torch.distributed.get_world_size() == 1:
        return mine
    # One copy per pipeline stage goes to rank 0: data-parallel (and context-parallel) replicas and the
    # other TP ranks hold the same tensors now.
    first = ps.get_data_parallel_rank(with_context_parallel=True) == 0 and ps.get_tensor_model_parallel_rank() == 0
    boxes = collectives.gather_object(mine if first else {}, dst=0)
    if boxes is None:
        return {}
    merged: dict[str, FullAdapter] = {}
    for box in boxes:
        merged.update(box)
    return merged


def save_peft_folder(
    chunks: list[Any], facts: Any, out_dir: str | Path, *, rank: int, alpha: float, dropout: float, base_model: str,
    dtype: torch.dtype | None = None,
) -> Path | None:
    """Write the model's adapters as a PEFT folder at `out_dir` (atomically, replacing an earlier one).
    Every rank calls; rank 0 writes and returns the folder, the others return None. `dtype`: the
    tensors' dtype in the file (default fp32, what the optimizer's master copies hold)."""
    from safetensors.torch import save_file

    from trinity.convert.outdir import atomic_dir

    adapters = gather_adapters(chunks, facts)
    is_rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if not is_rank0:
        return None
    if not adapters:
        raise UserError("the model has no LoRA adapters to save (actor_rollout_ref.actor.lora.rank is 0)")
    # copies: q/k/v (gate/up) share one A, and safetensors refuses tensors that share memory
    tensors = {k: v.to(dtype or torch.float32, copy=True) for k, v in peft_tensors(adapters, facts).items()}
    config = adapter_config(rank=rank, alpha=alpha, dropout=dropout, targets=target_modules(adapters, facts),
                            base_model=base_model)
    out = Path(out_dir)
    with atomic_dir(out, force=True) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


# ---------------------------------------------------------------- loading a PEFT folder into our adapters


def read_peft_folder(folder: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json as a dict, the tensors with PEFT's key prefix and adapter name removed:
    `model.layers.0.self_attn.q_proj.lora_A.weight`). UserError naming the file for what is not a LoRA folder."""
    from safetensors.torch import load_file

    from trinity.models.lora_targets import read_adapter_config

    config = read_adapter_config(folder)  # both files there, plain LoRA
    weights = Path(folder) / WEIGHTS_FILE
    tensors: dict[str, torch.Tensor] = {}
    for key, value in load_file(str(weights)).items():
        name = key.removeprefix(_PREFIX).replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
        tensors[name] = value
    return config, tensors


def mcore_adapter(folder: str | Path, tensors: dict[str, torch.Tensor], linear: str, facts: Any) -> FullAdapter:
    """The full adapter of megatron linear `linear` (global name) from a PEFT folder's tensors
    (inverse of `peft_tensors`); UserError naming the file when the folder cannot give it exactly."""
    from trinity.convert.registry import weight_map
    from trinity.convert.weightmap import to_mcore

    wmap = weight_map(facts.family, facts.source)
    rule, idx = _rule(wmap, linear, facts)
    modules = _hf_modules(rule, idx)
    where = Path(folder) / WEIGHTS_FILE
    a_s, b_s = [], []
    for m in modules:
        a, b = tensors.get(f"{m}.lora_A.weight"), tensors.get(f"{m}.lora_B.weight")
        if a is None or b is None:
            raise UserError(f"{where}: no LoRA adapter for {m} (needed for {linear}); the folder's "
                            f"target_modules must cover {', '.join(x.rsplit('.', 1)[-1] for x in modules)}")
        a_s.append(a)
        b_s.append(b)
    for m, a in zip(modules[1:], a_s[1:]):
        if not torch.equal(a, a_s[0]):
            raise UserError(
                f"{where}: {m} and {modules[0]} have different lora_A; megatron fuses them into one linear "
                f"({linear}) whose adapter has one A, so only adapters trained by trinity (or with a shared A) load"
            )
    return FullAdapter(a_s[0], to_mcore(rule, b_s, _geometry(facts)))


def load_peft_adapters(chunks: list[Any], folder: str | Path, facts: Any, *, rank: int, alpha: float) -> int:
    """Fill this rank's adapters (their TP shards) from a PEFT folder; returns how many linears were
    filled. Every targeted linear must be in the folder, and its r and lora_alpha must be the job's."""
    from megatron.core import parallel_state as ps

    from trinity.convert.registry import weight_map
    from trinity.convert.weightmap import tp_split

    config, tensors = read_peft_folder(folder)
    cfg_path = Path(folder) / CONFIG_FILE
    if int(config.get("r", -1)) != rank or float(config.get("lora_alpha", -1)) != float(alpha):
        raise UserError(f"{cfg_path}: r {config.get('r')}, lora_alpha {config.get('lora_alpha')} but the model's adapters "
                        f"have rank {rank}, alpha {alpha}; load it with lora.rank and lora.alpha set to the folder's")
    wmap = weight_map(facts.family, facts.source)
    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    tp_rank = ps.get_tensor_model_parallel_rank() if tp > 1 else 0
    used: set[str] = set()
    count = 0
    for linear, _, adapter in _local_adapters(chunks):
        rule, idx = _rule(wmap, linear, facts)
        full = mcore_adapter(folder, tensors, linear, facts)
        used.update(f"{m}.lora_{x}.weight" for m in _hf_modules(rule, idx) for x in "AB")
        a = tp_split(rule, full.A, tp_rank, tp) if rule.tp_dim == 1 else full.A
        b = tp_split(rule, full.B, tp_rank, tp) if rule.tp_dim == 0 else full.B
        for what, param, value in (("lora_A", adapter.lora_A, a), ("lora_B", adapter.lora_B, b)):
            if tuple(param.shape) != tuple(value.shape):
                raise UserError(f"{Path(folder) / WEIGHTS_FILE}: {linear} {what} would be {list(value.shape)} on this "
                                f"rank but the model's is {list(param.shape)} (another model's adapters?)")
            with torch.no_grad():
                param.copy_(value)
        count += 1
    return count


def _natural(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]
