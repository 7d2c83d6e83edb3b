"""Parallel-size arithmetic, pure Python (no torch), shared by the validator and the workers.

megatron-core orders ranks as TP-CP-EP-DP-PP; the data-parallel size is what remains of the world
after model parallelism. Expert layers re-fold the same ranks as ETP x EP x EDP x PP.
"""

from __future__ import annotations

from dataclasses import dataclass


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
