"""Parallel-size arithmetic, pure Python (no torch), shared by the validator and the workers.

megatron-core orders ranks as TP-CP-EP-DP-PP; the data-parallel size is what remains of the world
after model parallelism. Expert layers re-fold the same ranks as ETP x EP x EDP x PP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class ParallelLayout:
    """The parallel sizes of one role, as megatron-core's parallel_state takes them."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # None: expert layers use the dense TP size

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp

    def dp(self, world_size: int) -> int:
        """Data-parallel size for `world_size` ranks; ValueError if it does not divide."""
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"world size {world_size} is not divisible by TP*PP*CP = {self.model_parallel_size}"
            )
        return world_size // self.model_parallel_size

    def expert_dp(self, world_size: int) -> int:
        """Data-parallel size of expert layers (ranks per PP stage / (EP*ETP))."""
        per_stage = world_size // self.pp
        folded = self.ep * self.expert_tp
        if per_stage % folded:
            raise ValueError(f"EP*ETP = {folded} does not divide world/PP = {per_stage}")
        return per_stage // folded

    def layers_per_stage(self, num_layers: int) -> int:
        """Layers held by one pipeline stage (one virtual chunk times VPP)."""
        return num_layers // self.pp

    def layers_per_chunk(self, num_layers: int) -> int:
        return num_layers // (self.pp * (self.vpp or 1))

    def num_microbatches(self, global_batch: int, micro_batch: int, world_size: int) -> int:
        """Micro batches each DP rank runs per optimizer step."""
        per_step = micro_batch * self.dp(world_size)
        if global_batch % per_step:
            raise ValueError(
                f"global batch {global_batch} is not divisible by micro batch x DP = {per_step}"
            )
        return global_batch // per_step

    def describe(self, world_size: int) -> str:
        vpp = f" VPP={self.vpp}" if self.vpp else ""
        ep = f" EP={self.ep} ETP={self.expert_tp}" if self.ep > 1 or self.etp else ""
        return (
            f"TP={self.tp} PP={self.pp}{vpp} CP={self.cp}{ep} DP={self.dp(world_size)}"
        )


# ---------------------------------------------------------------- the layout rules, once

# The megatron block's field for each ParallelLayout size (the names users write in a job config).
FIELDS = {
    "tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
    "vpp": "virtual_pipeline_model_parallel_size", "cp": "context_parallel_size",
    "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size",
}
# The sizes every role of an RL job shares (one parallel state; no resharding between roles).
LAYOUT_FIELDS = tuple(FIELDS.values())


def differing_sizes(layout: ParallelLayout, other: ParallelLayout) -> list[tuple[str, object, object]]:
    """(field, layout's value, other's value) for each size in which `layout` differs from `other`."""
    return [(FIELDS[a], getattr(layout, a), getattr(other, a)) for a in FIELDS if getattr(layout, a) != getattr(other, a)]


def layout_problems(
    lay: ParallelLayout,
    facts: object | None = None,
    *,
    name: Callable[[str], str] = lambda field: field,
    world_size: int | None = None,
    world_desc: str | None = None,
    sequence_parallel: bool | None = None,
) -> list[tuple[str, str]]:
    """Every rule a parallel layout must satisfy, as (field, message) pairs: `field` is the megatron
    block's field the problem is about, `message` spells other fields through `name` (a job config's
    field names, or a CLI's flags). Pure: validation (`trinity.config.rules`) and conversion
    (`trinity.convert.api.check_layout`) render the same rules; nothing re-checks them at run time.

    facts: the model (a trinity.models.facts.ModelFacts) when known; world_size: when the job's size is
    known; sequence_parallel: the role's flag when it has one. The built-in rollout adds no rule: it
    serves sequence parallel (switched off while decoding, trinity.distributed.sequence_parallel) and
    virtual pipeline stages (every chunk in ring order, trinity.rollout.parallel.Pipeline)."""
    n = name
    out: list[tuple[str, str]] = []
    for attr in ("tp", "pp", "ep"):
        if getattr(lay, attr) < 1:
            out.append((FIELDS[attr], f"must be at least 1 (got {getattr(lay, attr)})"))
    if lay.vpp is not None and lay.vpp < 1:
        out.append((FIELDS["vpp"], f"must be at least 1 (got {lay.vpp})"))
    if out:
        return out
    if lay.vpp is not None and lay.pp == 1:
        out.append((FIELDS["vpp"], f"needs {n(FIELDS['pp'])} > 1 (virtual stages split each pipeline rank's layers); "
                                   f"remove it or raise {n(FIELDS['pp'])}"))
    if world_size is not None:
        world = world_desc or f"world size {world_size}"
        if world_size % lay.model_parallel_size:
            out.append((FIELDS["tp"], f"{world} is not divisible by TP x PP x CP = {lay.tp} x {lay.pp} x {lay.cp} = "
                                      f"{lay.model_parallel_size}; pick sizes whose product divides {world_size}"))
        elif (world_size // lay.pp) % (lay.ep * lay.expert_tp):
            out.append((FIELDS["ep"], f"EP x ETP = {lay.ep} x {lay.expert_tp} must divide world/PP = {world_size // lay.pp}; "
                                      f"lower {n(FIELDS['ep'])} or {n(FIELDS['etp'])}"))
    if facts is not None:
        f: Any = facts
        if f.num_attention_heads % lay.tp:
            out.append((FIELDS["tp"], f"{f.num_attention_heads} attention heads are not divisible by TP={lay.tp}"))
        if f.num_query_groups % lay.tp:
            out.append((FIELDS["tp"], f"{f.num_query_groups} key/value heads are not divisible by TP={lay.tp}; "
                                      f"use a TP that divides {f.num_query_groups}"))
        stages = lay.pp * (lay.vpp or 1)
        if f.num_layers % stages:
            field, what = (FIELDS["vpp"], f"PP x VPP = {lay.pp} x {lay.vpp}") if lay.vpp else (FIELDS["pp"], f"PP={lay.pp}")
            out.append((field, f"{f.num_layers} layers are not divisible by {what}"))
        if lay.ep > 1 and not f.is_moe:
            out.append((FIELDS["ep"], f"EP={lay.ep} needs an MoE model, but {f.architecture} is dense; set {n(FIELDS['ep'])} to 1"))
        if f.is_moe and f.num_experts % lay.ep:
            out.append((FIELDS["ep"], f"{f.num_experts} experts are not divisible by EP={lay.ep}"))
        if f.is_moe and lay.ep > 1 and lay.tp > 1 and sequence_parallel is False:
            out.append(("sequence_parallel", "megatron-core needs sequence_parallel with both TP>1 and EP>1; set it to true"))
    return out
