"""What the RL and DPO recipes do differently with LoRA (actor.lora.rank >= 1).

- The reference policy is the actor's own engine with its adapters switched off (`AdaptersOff`): the base
  weights are frozen, so "adapters off" IS the initial policy, bit for bit, and no second model (no
  Role.ref engine, no second copy of the weights) is built.
- The rollout decoders read the base weights directly (trinity.rollout.decode), not through the adapters'
  forward hooks: around a rollout every adapted weight holds W + alpha/rank * B A (`rollout_weights`), and
  gets its original bits back afterwards (trinity.models.lora.adapters_merged).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator


def uses_lora(cfg: Any) -> bool:
    """Whether the job trains LoRA adapters on the actor (a JobConfig)."""
    return cfg.actor_rollout_ref.actor.lora.rank > 0


class AdaptersOff:
    """The reference policy of a LoRA job: `infer_batch` runs the actor's engine with every adapter off.

    It owns no memory: `need` does nothing (the actor's own phases decide where its parameters are; the
    reference phase asks for the actor's parameters)."""

    def __init__(self, actor: Any):
        self.actor = actor

    def infer_batch(self, *args: Any, **kwargs: Any) -> Any:
        from trinity.models.lora import adapters_disabled

        with adapters_disabled(self.actor.model):
            return self.actor.infer_batch(*args, **kwargs)

    def need(self, **_: Any) -> None:
        return None


@contextlib.contextmanager
def rollout_weights(actor: Any) -> Iterator[None]:
    """Around a rollout: the adapters merged into the actor's base weights (restored bit-exactly on
    exit); nothing for a model without adapters. `actor`: a RoleEngine or model chunks."""
    from trinity.models.lora import adapters_merged, has_lora

    chunks = actor.modules if hasattr(actor, "modules") and not callable(actor.modules) else actor
    if not has_lora(chunks):
        yield
        return
    with adapters_merged(chunks):
        yield
