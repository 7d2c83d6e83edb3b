"""Where a role's initial weights come from, decided once for the whole job (`weight_source`).

`trinity run` converts every HF source to a cached dist checkpoint before launch (`prepare_weights`
rewrites those roles to the cache), and the workers load whatever the source says
(`trinity.convert.load.load_weights`): nobody else re-reads the `use_mbridge` /
`use_dist_checkpointing` flags.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trinity.config.roles import Role
from trinity.errors import UserError


class WeightKind(str, enum.Enum):
    hf = "hf"  # an HF folder, read by the builtin streaming loader
    dist = "dist"  # a dist checkpoint written by trinity (trinity_meta.json beside it)
    foreign_dist = "foreign_dist"  # a megatron-core dist checkpoint written by another tool
    mbridge = "mbridge"  # an HF folder, read through mbridge


@dataclass(frozen=True)
class WeightSource:
    kind: WeightKind
    path: str

    @property
    def is_dist(self) -> bool:
        return self.kind in (WeightKind.dist, WeightKind.foreign_dist)

    def describe(self) -> str:
        return f"{self.kind.value} {self.path}"


def weight_source(cfg: Any, role: Role) -> WeightSource:
    """The weights `role` of job `cfg` (a JobConfig) starts from.

    The ref starts from the actor's initial weights: its own block names a source only when it sets
    use_dist_checkpointing or use_mbridge. A critic never loads through mbridge (validation refuses it):
    its backbone comes from the HF folder or a dist checkpoint, its head is initialised."""
    m = role.megatron(cfg)
    if role is Role.ref and not (m.use_dist_checkpointing or m.use_mbridge):
        m = Role.actor.megatron(cfg)
    if m.use_dist_checkpointing:
        path = m.dist_checkpointing_path
        if not path:
            raise UserError(f"{role.config_path}.megatron.dist_checkpointing_path: required with use_dist_checkpointing")
        trinity_written = (Path(path) / "trinity_meta.json").is_file()
        return WeightSource(WeightKind.dist if trinity_written else WeightKind.foreign_dist, str(path))
    if m.use_mbridge and not role.value_head:
        return WeightSource(WeightKind.mbridge, cfg.model.path)
    return WeightSource(WeightKind.hf, cfg.model.path)


def job_roles(cfg: Any) -> list[Role]:
    """The roles this job builds, in build order (actor, ref, critic)."""
    return [Role.from_path(p) for p in cfg.roles()]
