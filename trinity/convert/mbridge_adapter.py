"""The one place that talks to mbridge 0.15.1 (the `--backend mbridge` / `use_mbridge` path).

What mbridge needs from us, and why:
- Model construction stays ours (`trinity.models.build`): mbridge's `get_model` hard-codes the
  TransformerEngine layer spec and calls `.cuda()`, neither of which exists on CPU or without TE. We
  only use mbridge's name maps, TP splitting and PP/EP gathering on the chunks we built.
- Our local spec names the layer norms `input_layernorm` / `pre_mlp_layernorm` (TE fuses them into
  `linear_qkv` / `linear_fc1`), so each bridge instance gets those two map entries added.
- mbridge reads `hf_config.rope_theta`; transformers 5 moved it into `rope_parameters`, so it is put
  back on the config from ModelFacts before the bridge is built.
- MoE (Qwen3-MoE, Mixtral): mbridge names experts as TE's grouped MLP does (`experts.linear_fc1.weightN`,
  N the expert id; its EP code turns local ids into global ones by that name); our local spec builds
  SequentialMLP (`experts.local_experts.N.linear_fc1.weight`). The bridge's local -> global name map
  is wrapped to give our expert parameters mbridge's grouped names with the global expert id, so its
  name maps, TP splits and EP gathers apply unchanged (its TP split of an expert's fc2 is done on the
  partition dim it finds from the shapes, as for dense layers).
"""


from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import torch

from trinity.errors import UserError
from trinity.models.facts import ModelFacts


def make_bridge(hf_dir: str | Path, facts: ModelFacts, dtype: torch.dtype) -> Any:
    """An mbridge Bridge for `hf_dir` that understands our parameter names. Parallel state must be up."""
    if facts.mla is not None:  # mbridge's DeepSeek-V3 map has TE's MLA names; V2 it does not know
        raise UserError(f"{facts.source}: {facts.architecture} converts with the builtin backend only "
                        "(mbridge names MLA as TransformerEngine builds it); use --backend builtin")
    from mbridge import AutoBridge
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(hf_dir), trust_remote_code=False)
    if getattr(hf_config, "rope_theta", None) is None:
        hf_config.rope_theta = facts.rope_theta
    bridge = AutoBridge.from_config(hf_config, dtype=dtype)
    # Our chunks pad the vocabulary to a multiple of 128*TP (as Megatron-LM does); mbridge only pads
    # (and trims on export) when it is told the multiple, and otherwise scatters an HF-sized embedding
    # into the padded parameter and fails.
    from megatron.core import parallel_state as ps

    from trinity.models.build import _VOCAB_MULTIPLE, padded_vocab_size

    tp = ps.get_tensor_model_parallel_world_size()
    bridge.make_vocab_size_divisible_by = _VOCAB_MULTIPLE * tp
    bridge.vocab_size = facts.vocab_size
    bridge.padded_vocab_size = padded_vocab_size(facts, tp)
    layer = "model.layers.{layer_number}"
    # Instance attributes: the class-level dicts are shared by every bridge of that family.
    bridge._OTHER_MAPPING = {**bridge._OTHER_MAPPING, "input_layernorm.weight": [f"{layer}.input_layernorm.weight"]}
    bridge._MLP_MAPPING = {
        "pre_mlp_layernorm.weight": [f"{layer}.post_attention_layernorm.weight"],
        **bridge._MLP_MAPPING,
    }
    if facts.is_moe:
        _name_sequential_experts_as_grouped(bridge)
    return bridge


_SEQUENTIAL_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.local_experts\.(?P<id>\d+)\.(?P<fc>linear_fc[12])\.weight$")


def _name_sequential_experts_as_grouped(bridge: Any) -> None:
    """Wrap the bridge's local -> global weight-name map (used by its load, export and by
    `mapped_hf_names`) so that SequentialMLP expert parameters get the grouped names mbridge maps:
    `decoder.layers.L.mlp.experts.local_experts.E.linear_fc1.weight` ->
    `decoder.layers.L.mlp.experts.linear_fc1.weight<G>`, G the global expert id (with consider_ep;
    export passes consider_ep=False and gathers the EP ranks' experts itself, from the local id)."""
    from megatron.core import parallel_state as ps

    original = bridge._weight_name_mapping_mcore_local_to_global
    num_local = bridge.config.num_moe_experts // ps.get_expert_model_parallel_world_size()
    first = ps.get_expert_model_parallel_rank() * num_local

    def local_to_global(model: torch.nn.Module, consider_ep: bool = True) -> dict[str, str]:
        names = original(model, consider_ep=consider_ep)
        for local, global_name in names.items():
            m = _SEQUENTIAL_EXPERT.match(global_name)
            if m:
                expert = int(m["id"]) + (first if consider_ep else 0)
                names[local] = f"{m['prefix']}.{m['fc']}.weight{expert}"
        return names

    bridge._weight_name_mapping_mcore_local_to_global = local_to_global


def load_weights(models: list[torch.nn.Module], hf_dir: str | Path, facts: ModelFacts, *, strict: bool = True) -> None:
    """Fill our built chunks from `hf_dir` through mbridge (all ranks call).

    Strict like the builtin loader: mbridge itself fails on a model parameter it cannot map or an HF
    tensor it cannot find; afterwards every HF tensor must have been mapped to some rank's parameter
    (checked across ranks), otherwise UserError naming the tensor and its shard.
    """
    dtype = next(p for m in models for p in m.parameters()).dtype
    bridge = make_bridge(hf_dir, facts, dtype)
    try:
        bridge.load_weights(models, str(hf_dir))
        consumed = mapped_hf_names(bridge, models)
    except (KeyError, NotImplementedError, ValueError) as exc:
        raise UserError(f"{hf_dir}: mbridge could not map the checkpoint onto the model ({exc})") from None
    if strict:
        from trinity.convert.builtin import _check_all_consumed
        from trinity.convert.hf_io import HFCheckpoint
        from trinity.convert.registry import weight_map

        _check_all_consumed(HFCheckpoint(hf_dir), consumed, facts, weight_map(facts.family, facts.source))


def mapped_hf_names(bridge: Any, models: list[torch.nn.Module]) -> set[str]:
    """The HF tensors mbridge maps onto this rank's chunks (what its `load_weights` reads or receives)."""
    names: set[str] = set()
    for model in models:
        for local, global_name in bridge._weight_name_mapping_mcore_local_to_global(model).items():
            if "_extra_state" not in local:
                names.update(bridge._weight_name_mapping_mcore_to_hf(global_name))
    return names


def export_weights(models: list[torch.nn.Module], hf_dir: str | Path, facts: ModelFacts) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF (name, tensor) pairs through mbridge; `hf_dir` supplies the HF config (all ranks call)."""
    dtype = next(p for m in models for p in m.parameters()).dtype
    bridge = make_bridge(hf_dir, facts, dtype)
    for name, tensor in bridge.export_weights(models):
        if facts.tie_word_embeddings and name == "lm_head.weight":
            continue  # a tied HF checkpoint has no lm_head tensor
        yield name, tensor[: facts.vocab_size] if name in ("model.embed_tokens.weight", "lm_head.weight") else tensor
