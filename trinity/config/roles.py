"""The roles of a job (actor, ref, critic) as one enum: what each is, where its config lives, whether
it is trained, whether it carries a value head. Code asks the enum, never a config path's spelling."""

from __future__ import annotations

import enum
from typing import Any


class Role(str, enum.Enum):
    actor = "actor"
    ref = "ref"
    critic = "critic"

    @property
    def config_path(self) -> str:
        """Where the role's block lives in the job config (its `megatron:` is under it)."""
        return _PATHS[self]

    @property
    def trained(self) -> bool:
        """Whether the role has an optimizer (the ref is frozen)."""
        return self is not Role.ref

    @property
    def value_head(self) -> bool:
        """Whether the role's output layer is a scalar value head instead of the vocabulary."""
        return self is Role.critic

    @classmethod
    def from_path(cls, path: str) -> "Role":
        """The role whose block is at `path` (a key of JobConfig.roles())."""
        for role, p in _PATHS.items():
            if p == path:
                return role
        raise KeyError(path)

    def megatron(self, cfg: Any) -> Any:
        """The role's MegatronConfig in `cfg` (a JobConfig)."""
        if self is Role.critic:
            return cfg.critic.megatron
        return getattr(cfg.actor_rollout_ref, self.value).megatron

    def optim(self, cfg: Any) -> Any:
        """The role's OptimConfig, None for the frozen ref."""
        if self is Role.critic:
            return cfg.critic.optim
        return cfg.actor_rollout_ref.actor.optim if self is Role.actor else None


_PATHS = {Role.actor: "actor_rollout_ref.actor", Role.ref: "actor_rollout_ref.ref", Role.critic: "critic"}
