"""Recipes: how a step of an algorithm runs. A recipe builds its data and the roles its job has, runs one
step and says what the console shows; `trinity.trainer.loop.run` runs any of them (resume, profiler,
checkpoints, metrics, export). Which recipe an algorithm runs is its AlgorithmSpec's (trinity.algorithms.
registry); several algorithms share one (the RL recipe runs grpo, rloo, reinforce_plus_plus and cispo).

Specs name recipes as `module:Class` strings so that looking one up imports only that recipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from trinity.algorithms.registry import ALGORITHMS
from trinity.config.roles import Role
from trinity.errors import UserError
from trinity.trainer.samples import Sample

if TYPE_CHECKING:
    from trinity.trainer.context import WorkerContext
    from trinity.trainer.engine import RoleEngine

# A metrics row: metric name -> value (ints and bools count as numbers); the loop adds `step`.
Metrics = dict[str, float]


@dataclass(frozen=True)
class StepOutput:
    """What one training step (or evaluation) gives back on every rank: its metrics row and, for an
    algorithm that generates, this rank's scored samples (trinity.trainer.samples; None: nothing to log)."""

    metrics: Metrics
    samples: list[Sample] | None = None


class TrainData(Protocol):
    """What the loop and the checkpoints need of a recipe's data: its position (saved and restored with
    a checkpoint), the steps of one epoch and a one-line summary. Each recipe's own data type adds how
    it hands out its batches."""

    @property
    def steps_per_epoch(self) -> int: ...

    def state_dict(self) -> dict[str, object]: ...

    def load_state_dict(self, state: dict[str, object]) -> None: ...

    def summary(self) -> str: ...

# algorithm.name -> its recipe, as the registry has it
RECIPES: dict[str, str] = {name: spec.recipe for name, spec in ALGORITHMS.items()}


class Recipe:
    """Base of every recipe. The loop calls, in order: `build()` (data, then the role engines in
    `roles()` order), then `step(step)` per step, and `all_resident()` before a save or the export (the
    run's closing summary reads its metrics, trinity.trainer.summary)."""

    # The single trained role's checkpoint is the step folder itself (see trinity.trainer.checkpoint).
    flat_checkpoint: ClassVar[bool] = False
    # `optimizer_offload` keeps the optimizer in host memory and steps it there (a recipe without phases,
    # where moving it between phases would free nothing), instead of moving it off between phases.
    optimizer_on_host: ClassVar[bool] = False

    data: TrainData

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.cfg = ctx.config
        self.engines: dict[str, RoleEngine] = {}
        self.total_steps = 0

    # ---------------------------------------------------------------- what a recipe defines

    def roles(self) -> list[Role]:
        """The roles this job has, in build order: the config decides them from the algorithm's spec
        (JobConfig.roles)."""
        return [Role.from_path(path) for path in self.cfg.roles()]

    def build_data(self) -> TrainData:
        """This rank's data."""
        raise NotImplementedError

    def step(self, step: int) -> StepOutput:
        """One training step: its metrics row (with `step`, on every rank) and samples."""
        raise NotImplementedError

    def line(self, metrics: Metrics) -> list[str]:
        """The console line's parts after `step i/N`."""
        raise NotImplementedError

    def setup(self) -> None:
        """What is built after the engines (phases, samplers...)."""

    def profiling(self, on: bool) -> None:
        """Called before each step: whether the loop's profiler profiles it (a recipe may then measure more)."""

    def profile_lines(self) -> list[str]:
        """Lines added to a profiled step's summary (trinity.trainer.profiling), after the step."""
        return []

    # ---------------------------------------------------------------- shared

    def build(self) -> None:
        self.data = self.build_data()
        t = self.cfg.trainer
        self.total_steps = t.total_steps if t.total_steps is not None else t.total_epochs * self.data.steps_per_epoch
        for role in self.roles():
            self.engines[role.value] = self.ctx.build_engine(role, self.total_steps, optimizer_on_host=self.optimizer_on_host)
        self.setup()

    def describe(self) -> str:
        return f"data: {self.data.summary()}; training {self.total_steps} steps"

    def all_resident(self) -> None:
        for engine in self.engines.values():
            engine.all_resident()

    @property
    def actor(self) -> RoleEngine:
        return self.engines[Role.actor.value]


def get_recipe(name: str) -> type[Recipe]:
    spec = ALGORITHMS.get(name)
    if spec is None:
        raise UserError(f"algorithm.name: no recipe is registered for {name!r}; known: {', '.join(RECIPES)}")
    return spec.load_recipe()
