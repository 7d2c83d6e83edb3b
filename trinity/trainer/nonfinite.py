"""Non-finite losses and gradient norms at run time (as megatron-core's `check_for_nan_in_loss_and_grad`).

Every optimizer update of every algorithm goes through `RoleEngine.train_batch`, which asks here: the loss
of the update (summed over this rank's micro batches, on the last pipeline stage) is reduced over all ranks
into one code (`loss_code`), the grad norm is already global (megatron-core reduces it), so every rank sees
the same `problem` and makes the same decision. A non-finite update is never applied: the weights stay
those of the last finite one. Then `NonFiniteGuard` stops the run with one line naming the step and the
phase, or, with `trainer.skip_nonfinite_steps: N`, skips up to N such steps first.

Nothing non-finite is saved or exported: the stop is an error raised inside the step, before the loop
reaches a checkpoint or the export, and a skipped update leaves the weights as they were.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from trinity.distributed import collectives
from trinity.errors import UserError

FINITE, INF, NAN = 0, 1, 2  # `loss_code`: the worst of all ranks wins (max)


def loss_code(losses: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """FINITE, INF or NAN of the losses of all ranks (this rank's: `losses`, empty off the last pipeline
    stage), as a tensor on `device` (NCCL reduces device tensors only); not read here, so the caller's
    host sync reads it with the grad norm's."""
    total = torch.stack([loss.detach().float().sum() for loss in losses]).sum() if losses else torch.zeros(())
    code = torch.where(total.isnan(), NAN, torch.where(total.isinf(), INF, FINITE)).to(device, torch.int32)
    return collectives.all_reduce(code, "max")


def problem(code: int, grad_norm: float) -> str | None:
    """What is not finite in an update (`code` from `loss_code`), None when nothing is."""
    if code == NAN:
        return "the loss is nan"
    if code == INF:
        return "the loss is inf"
    if not math.isfinite(grad_norm):
        return f"the gradient norm is {grad_norm}"
    return None


def _any_nonfinite(engine: Any) -> torch.Tensor:
    """Whether any of this rank's parameters of `engine` holds an inf or nan (a tensor, not read)."""
    return torch.stack([p.detach().isfinite().all() for m in engine.modules for p in m.parameters()]).all().logical_not()


def nonfinite_roles(engines: dict[str, Any], device: torch.device) -> list[str]:
    """The trained roles among `engines` whose weights hold an inf or nan on any rank (one all-reduce)."""
    trained = {name: e for name, e in engines.items() if e.trained}
    if not trained:
        return []
    bad = collectives.all_reduce(torch.stack([_any_nonfinite(e) for e in trained.values()]).to(device, torch.int32), "max")
    return [name for name, flag in zip(trained, bad.tolist()) if flag]


class NonFiniteGuard:
    """One run's decisions on non-finite updates: which step it is (the loop says), the last checkpoint (the
    loop says), how many steps had an update skipped. `update(...)` raises the stop line, or counts the step
    (once, however many of its updates were skipped) and logs it."""

    def __init__(self, budget: int = 0, log: Callable[[str], Any] = lambda _: None):
        self.budget, self.log = budget, log
        self.step = 0  # the step running now
        self.saved = 0  # the step of the last checkpoint written or resumed from (0: none)
        self.skipped = 0  # steps with a skipped update so far
        self._counted = -1  # the step last counted in `skipped`

    def start(self, step: int) -> None:
        self.step = step

    def saved_at(self, step: int) -> None:
        self.saved = step

    def update(self, phase: str, what: str, lr_key: str) -> None:
        """An update of `phase` was not finite (`what`) and not applied: stop past the budget, else count
        the step. `lr_key`: the learning rate of the role whose update it was (the first thing to lower)."""
        if self.step != self._counted:
            if self.skipped >= self.budget:
                more = "raise" if self.budget else "set"
                raise UserError(self.stop_line(phase, what, f"Lower {lr_key}, check this step's data, or {more} "
                                                            "trainer.skip_nonfinite_steps to skip such steps"))
            self.skipped, self._counted = self.skipped + 1, self.step
        self.log(f"step {self.step}, {phase}: {what}; the update was skipped ({self.skipped} of "
                 f"trainer.skip_nonfinite_steps = {self.budget} steps)")

    def check_weights(self, engines: dict[str, Any], write: str, device: torch.device) -> None:
        """Before a checkpoint or the export (`write`; all ranks call): stop when a trained role's weights are
        not finite, which a finite loss and grad norm cannot promise (an lr so large the update overflows)."""
        bad = nonfinite_roles(engines, device)
        if bad:
            keys = " or ".join(f"{engines[name].role.config_path}.optim.lr" for name in bad)
            raise UserError(self.stop_line(write, f"the {' and '.join(bad)} weights are not finite", f"Lower {keys}"))

    def stop_line(self, phase: str, what: str, fix: str) -> str:
        """`step <n>, <phase>: <what>; nothing was saved past step <m>. <fix>`: the one form of every stop."""
        saved = f"nothing was saved past step {self.saved}" if self.saved else "nothing was saved"
        skipped = f" after {self.skipped} skipped steps (trainer.skip_nonfinite_steps = {self.budget})" if self.budget else ""
        return f"step {self.step}, {phase}: {what}{skipped}; {saved}. {fix}"

    def metrics(self) -> dict[str, int]:
        """The step row's count of skipped steps (only when skipping is on)."""
        return {"skipped_nonfinite_steps": self.skipped} if self.budget else {}
