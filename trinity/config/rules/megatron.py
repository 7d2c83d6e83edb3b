"""Rules on one role's `megatron:` block: parallel layout (against the world size and the model), weight
source, recompute and megatron-core TransformerConfig overrides, mirrored from megatron-core's asserts.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import math
from pathlib import Path

from trinity.config.megatron import MegatronConfig, RecomputeGranularity, RecomputeMethod, RecomputeModule
from trinity.config.schema import JobConfig
from trinity.distributed.layout import layout_problems
from trinity.models.facts import ModelFacts, mbridge_refusal


def check_megatron(
    p: str,
    m: MegatronConfig,
    cfg: JobConfig,
    facts: ModelFacts | None,
    problems: list[str],
    warnings: list[str],
    check_paths: bool,
) -> None:
    world = cfg.cluster.world_size
    lay = m.layout()
    world_desc = f"world size {world} (cluster.nnodes {cfg.cluster.nnodes} x cluster.nproc_per_node {cfg.cluster.nproc_per_node})"
    # The layout's own rules (trinity.distributed.layout.layout_problems); the model's come in
    # _check_against_model, the rollout's in check_rl_roles.
    for field, text in layout_problems(lay, world_size=world, world_desc=world_desc):
        problems.append(f"{p}.{field}: {text}")
    if m.sequence_parallel and lay.tp == 1:
        m.sequence_parallel = False
        warnings.append(f"{p}.sequence_parallel: has no effect with TP=1; disabled (as megatron-core does)")
    if lay.cp > 1:
        _check_context_parallel(p, m, cfg, facts, problems)
    if m.use_mbridge and facts is not None and facts.mla is not None:
        problems.append(f"{p}.use_mbridge: {facts.architecture} (multi-latent attention) loads through trinity's "
                        "built-in weight map only (mbridge names MLA as TransformerEngine builds it); set it to false")
    if m.use_mbridge and m.use_dist_checkpointing:
        problems.append(f"{p}.use_mbridge: cannot be combined with use_dist_checkpointing; choose one weight source")
    if m.use_dist_checkpointing:
        ckpt = m.dist_checkpointing_path
        if not ckpt:
            problems.append(
                f"{p}.dist_checkpointing_path: required with use_dist_checkpointing; "
                "point it at the output of `trinity convert hf-to-mcore`"
            )
        elif check_paths and not Path(ckpt).is_dir():
            problems.append(f"{p}.dist_checkpointing_path: {ckpt} does not exist; run `trinity convert hf-to-mcore` first")
        elif check_paths and not (Path(ckpt) / ".metadata").is_file():
            # Any megatron-core torch_dist checkpoint loads (trinity's or e.g. verl's converter's); all
            # of them have torch's index file. Keys and shapes are checked against the model at load.
            problems.append(
                f"{p}.dist_checkpointing_path: {ckpt} is not a megatron-core dist checkpoint (no .metadata in it); "
                "point it at the output of `trinity convert hf-to-mcore` (or of another megatron-core converter)"
            )
    if facts is not None and m.use_mbridge and mbridge_refusal(facts):
        problems.append(f"{p}.use_mbridge: {mbridge_refusal(facts)} (set use_mbridge to false)")
    if facts is not None:
        _check_against_model(p, m, facts, problems, warnings)
    _check_recompute(p, m, facts, problems)
    _check_transformer_overrides(p, m, problems)


def _check_context_parallel(p: str, m: MegatronConfig, cfg: JobConfig, facts: ModelFacts | None,
                            problems: list[str]) -> None:
    """What context parallelism needs. Without TransformerEngine our layer spec attends through ring
    attention (trinity.models.ring_attention), which has no score cap, sliding window or attention
    dropout, and whose send/receive between CP ranks does not compile; training rows are cut into 2·CP
    equal chunks (times TP with sequence parallel). RL rows are padded to that multiple on the fly."""
    cp = m.context_parallel_size
    tp = m.tensor_model_parallel_size
    multiple = 2 * cp * (tp if m.sequence_parallel and tp > 1 else 1)
    how = f"2 x context_parallel_size{' x TP (sequence parallel)' if multiple != 2 * cp else ''} = {multiple}"
    if not cfg.is_rl and cfg.data.seq_length % multiple:
        fit = -(-cfg.data.seq_length // multiple) * multiple
        problems.append(f"data.seq_length: {cfg.data.seq_length} is not a multiple of {how} (each CP rank holds two "
                        f"equal chunks of a row); set it to {fit}")
    if m.torch_compile != "none":
        problems.append(f"{p}.torch_compile: must be none with context_parallel_size > 1 (ring attention sends and "
                        "receives between CP ranks inside each layer, which does not compile)")
    dropout = m.override_transformer_config.extra_fields().get("attention_dropout")
    if dropout:
        problems.append(f"{p}.override_transformer_config.attention_dropout: ring attention (context_parallel_size > 1) "
                        "has no attention dropout; remove it or set context_parallel_size: 1")
    te = cfg.cluster.device == "cuda" and importlib.util.find_spec("transformer_engine") is not None
    if te and (cfg.is_rl or (cfg.spec.name == "sft" and cfg.data.packing)) and not (facts and _local_spec(facts)):
        # TransformerEngine's CP attention (megatron-core's own path, trinity.models.spec.backend) attends
        # over whole causal rows: packed rows and RL's left-padded prompts need ring attention
        what = "RL rows (left-padded prompts, packed sequences)" if cfg.is_rl else "packed rows (data.packing: true)"
        problems.append(f"{p}.context_parallel_size: with TransformerEngine installed, megatron-core's CP attention runs, "
                        f"which cannot attend over {what}; set data.packing: false (SFT), or use an environment "
                        "without TransformerEngine (trinity's ring attention)")
    if facts is None:
        return
    if facts.attn_logit_softcapping is not None:
        problems.append(f"{p}.context_parallel_size: {facts.architecture} caps attention scores (attn_logit_softcapping "
                        f"{facts.attn_logit_softcapping}), which ring attention cannot; set it to 1")
    if facts.sliding_window is not None:
        problems.append(f"{p}.context_parallel_size: {facts.architecture} attends over a sliding window "
                        f"({facts.sliding_window} tokens), which ring attention does not support; set it to 1")


def _local_spec(facts: ModelFacts) -> bool:
    from trinity.models.spec import needs_local_spec  # megatron-core: imported only where TE is installed

    return needs_local_spec(facts)


def _check_against_model(p: str, m: MegatronConfig, f: ModelFacts, problems: list[str], warnings: list[str]) -> None:
    for field, text in layout_problems(m.layout(), f, sequence_parallel=m.sequence_parallel):
        problems.append(f"{p}.{field}: {text}")
    if f.moe_group_score_topk:  # trinity.models.moe_router, DeepSeek's group-limited routing
        extra = m.override_transformer_config.extra_fields()
        for name, default in (("moe_router_load_balancing_type", "none"), ("moe_expert_capacity_factor", None),
                              ("moe_router_fusion", False)):
            if name in extra and extra[name] != default:
                problems.append(f"{p}.override_transformer_config.{name}: with DeepSeek's group-limited routing is "
                                "not supported; leave it at its default")
    if m.use_mbridge and f.gemma:
        problems.append(f"{p}.use_mbridge: mbridge has no name map for {f.architecture} (sandwich norms); "
                        "set it to false (the built-in weight map loads it)")
    if f.is_moe and m.moe_grouped_gemm and not any(
        importlib.util.find_spec(mod) for mod in ("grouped_gemm", "transformer_engine")
    ):
        problems.append(
            f"{p}.moe_grouped_gemm: needs the grouped_gemm package or TransformerEngine, neither is installed; "
            "set it to false or use the Docker image (scripts/docker_for_megatron)"
        )
    if not f.is_moe:
        # Refused, not warned about: on a dense model these options would be accepted and ignored.
        # (moe_token_dispatcher_type has a default value, so the resolved config a worker re-validates
        # always carries it: it cannot be told apart from a user's setting and is not checked.)
        for key in (k for k in ("moe_grouped_gemm", "moe_layer_recompute") if getattr(m, k)):
            problems.append(f"{p}.{key}: has no effect on the dense {f.architecture} (it has no MoE layers); remove it")


def _check_recompute(p: str, m: MegatronConfig, f: ModelFacts | None, problems: list[str]) -> None:
    o = m.override_transformer_config
    q = f"{p}.override_transformer_config"
    full = o.recompute_granularity == RecomputeGranularity.full
    if m.moe_layer_recompute and full:
        # megatron-core turns moe_layer_recompute into selective recompute of the MoE layers and raises
        # on a full granularity (TransformerConfig.__post_init__).
        problems.append(
            f"{p}.moe_layer_recompute: megatron-core refuses it with override_transformer_config."
            "recompute_granularity: full, which already recomputes whole layers; remove one of the two"
        )
    if not full:
        for name in ("recompute_method", "recompute_num_layers"):
            if getattr(o, name) is not None:
                problems.append(f"{q}.{name}: only applies with recompute_granularity: full; remove it or set granularity full")
    else:
        if o.recompute_method is None:
            problems.append(f"{q}.recompute_method: required with recompute_granularity: full; use uniform or block")
        if o.recompute_num_layers is None:
            problems.append(f"{q}.recompute_num_layers: required with recompute_granularity: full (e.g. 1)")
        elif f is not None:
            lay = m.layout()
            limit = lay.layers_per_stage(f.num_layers) if o.recompute_method == RecomputeMethod.block else lay.layers_per_chunk(f.num_layers)
            if limit and o.recompute_num_layers > limit:
                problems.append(f"{q}.recompute_num_layers: {o.recompute_num_layers} is more than the {limit} layers per pipeline stage")
    if o.recompute_modules is not None:
        if o.recompute_granularity != RecomputeGranularity.selective:
            problems.append(f"{q}.recompute_modules: only applies with recompute_granularity: selective")
        mods = set(o.recompute_modules)
        if f is not None and f.mla is None and RecomputeModule.mla_up_proj in mods:
            problems.append(f"{q}.recompute_modules: mla_up_proj recomputes multi-latent attention's up-projections "
                            f"(DeepSeek-V2/V3), which {f.architecture} does not have; remove it")
        if f is not None and not f.is_moe and mods & {RecomputeModule.moe, RecomputeModule.moe_act, RecomputeModule.shared_experts}:
            problems.append(f"{q}.recompute_modules: moe/moe_act/shared_experts need an MoE model")
        if RecomputeModule.moe_act in mods and not m.moe_grouped_gemm:
            problems.append(f"{q}.recompute_modules: moe_act needs moe_grouped_gemm: true")


@functools.lru_cache(maxsize=1)
def transformer_config_fields() -> frozenset[str] | None:
    """Field names of megatron-core's TransformerConfig, read from its source without importing it."""
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    names: set[str] = set()
    for rel, cls in (("transformer/transformer_config.py", "TransformerConfig"), ("model_parallel_config.py", "ModelParallelConfig")):
        tree = ast.parse((root / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == cls:
                names.update(s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name))
    return frozenset(names) or None


def _check_transformer_overrides(p: str, m: MegatronConfig, problems: list[str]) -> None:
    import difflib

    extra = m.override_transformer_config.extra_fields()
    for name, value in extra.items():
        # untyped (passed to TransformerConfig as they are): the schema's finite-number check misses them
        if not _finite(value):
            problems.append(f"{p}.override_transformer_config.{name}: {value!r} is not a finite number; "
                            "write a finite number")
    known = transformer_config_fields() if extra else None
    for name in extra if known else ():
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else "see megatron-core's TransformerConfig for the field names"
            problems.append(f"{p}.override_transformer_config.{name}: not a TransformerConfig field; {hint}")


def _finite(value: object) -> bool:
    """Whether an override value holds no inf or nan (in a list or mapping too)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True
