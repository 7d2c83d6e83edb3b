"""One place per algorithm: `ALGORITHMS` maps each `algorithm.name` to its `AlgorithmSpec` -- the roles it
builds, the data it reads, the defaults it changes, the config keys only it reads and the rules it adds,
its advantage estimator and policy loss, its evaluation and its recipe.

Everything else asks the spec (`JobConfig.spec`): config validation (trinity.config.rules), the schema's
defaults and roles (trinity.config.schema.job), the plan, the worker, the evaluator and the CLI. No other
module compares algorithm names.

This module imports nothing of the project: the config schema builds its `AlgorithmName` enum from it.
Code is named as `module:attribute` strings and imported when used (`load`), so that validating a config
never imports the trainer or torch.

Adding an algorithm: one module for what is new (CISPO: trinity/algorithms/cispo.py, its loss) and one
entry below; docs/architecture.md, "Adding an algorithm".
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

DataKind = Literal["sequences", "text", "pairs", "prompts"]
RefWhen = Literal["never", "kl", "always"]
Evaluation = Literal["loss", "reward"]

# Recipes shared by several algorithms (trinity/trainer/recipes).
_RL = "trinity.trainer.recipes.rl:RLRecipe"


@dataclass(frozen=True)
class Owned:
    """A config key only one algorithm reads: set (to a value other than its default) in a job of another
    algorithm it would be accepted and change nothing, so it is refused: `<key>: <why>, not <algorithm>;
    set algorithm.name: <owner> or remove the <unit>`."""

    key: str  # dotted path in the job config
    why: str  # "dynamic sampling is part of the dapo recipe"
    unit: Literal["key", "block"] = "key"  # what the user removes


@dataclass(frozen=True)
class Ignored:
    """A config key this algorithm does not read although others do: set (to a value other than its
    default) it is refused, `<key>: <value> has no effect with <algorithm> (<why>); remove the key`."""

    key: str  # dotted path in the job config
    why: str


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str  # algorithm.name
    title: str  # how messages and docs name it ("GRPO")
    recipe: str  # "module:Class" of its trinity.trainer.recipes.Recipe
    data: DataKind  # sequences (SFT rows), text (raw pre-training text), pairs (chosen/rejected), prompts (RL)
    ref: RefWhen = "never"  # the frozen reference policy: never, with a KL loss / KL in the reward, always
    critic: bool = False  # a value model trained beside the actor
    group: bool = False  # its baseline comes from the other responses to the same prompt: rollout.n >= 2
    advantages: str | None = None  # key of trinity.algorithms.advantages.ESTIMATORS (RL only)
    policy_loss: str | None = None  # "module:function" of its own policy loss; None: policy_loss.loss_mode's
    evaluation: Evaluation | None = None  # data.val_files: val/loss (forward only), val/reward (greedy rollout)
    rows_per_sample: int = 1  # rows of one training sample in a micro batch (a DPO pair: 2)
    defaults: tuple[tuple[str, bool], ...] = ()  # (dotted key, value) taken where the config leaves it unset
    owns: tuple[Owned, ...] = ()
    ignores: tuple[Ignored, ...] = ()
    rules: tuple[str, ...] = ()  # "module:function(cfg, problems)" run by `trinity validate` for this algorithm

    @property
    def rollout(self) -> bool:
        """Whether a step generates responses (the RL algorithms); the others train on fixed data."""
        return self.data == "prompts"

    def uses_ref(self, kl: bool) -> bool:
        """Whether the job has the reference role; `kl`: the job uses a KL loss or KL in the reward."""
        return self.ref == "always" or (self.ref == "kl" and kl)

    def load_recipe(self) -> type:
        recipe = load(self.recipe)
        assert isinstance(recipe, type), self.recipe
        return recipe

    def load_policy_loss(self) -> Callable[..., tuple[object, object]] | None:
        """Its own policy loss (a trinity.algorithms.losses.PolicyLossFn), None where loss_mode chooses."""
        return None if self.policy_loss is None else load(self.policy_loss)  # type: ignore[return-value]


def load(target: str) -> object:
    """The object a `module:attribute` string names, imported now."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


_DAPO_RULE = "trinity.config.rules.algorithms:check_dapo_overlong"
_DPO_RULE = "trinity.config.rules.algorithms:check_dpo_job"

ALGORITHMS: dict[str, AlgorithmSpec] = {s.name: s for s in (
    AlgorithmSpec("sft", "SFT", "trinity.trainer.recipes.sft:SFTRecipe", "sequences", evaluation="loss"),
    # continued pre-training (LLaMA-Factory's stage name; Megatron-LM's pretrain_gpt): documents are
    # concatenated, not packed one per row
    AlgorithmSpec("pt", "PT", "trinity.trainer.recipes.pt:PTRecipe", "text", defaults=(("data.packing", False),)),
    AlgorithmSpec("grpo", "GRPO", _RL, "prompts", ref="kl", group=True, advantages="grpo", evaluation="reward"),
    AlgorithmSpec("ppo", "PPO", "trinity.trainer.recipes.ppo:PPORecipe", "prompts", ref="kl", critic=True,
                  advantages="gae", evaluation="reward"),
    AlgorithmSpec("rloo", "RLOO", _RL, "prompts", ref="kl", group=True, advantages="rloo", evaluation="reward"),
    # the per-token KL penalty in the reward is part of REINFORCE++ (the paper, and verl's example)
    AlgorithmSpec("reinforce_plus_plus", "REINFORCE++", _RL, "prompts", ref="kl", advantages="reinforce_plus_plus",
                  evaluation="reward", defaults=(("algorithm.use_kl_in_reward", True),)),
    # verl's DAPO recipe: GRPO advantages + dynamic sampling + overlong shaping
    AlgorithmSpec("dapo", "DAPO", "trinity.trainer.recipes.dapo:DAPORecipe", "prompts", ref="kl", group=True,
                  advantages="grpo", evaluation="reward", rules=(_DAPO_RULE,),
                  owns=(Owned("algorithm.filter_groups.enable", "dynamic sampling is part of the dapo recipe"),
                        Owned("reward_model.overlong_buffer.enable", "overlong reward shaping is part of the dapo recipe"))),
    # offline preference pairs (TRL's DPOTrainer) against the frozen initial policy; each sequence of a
    # pair in its own row (its log-prob is a per-row sum), so no packing. No evaluation: the SFT loss
    # evaluator reads prompt/response records, not pairs (validate refuses data.val_files)
    AlgorithmSpec("dpo", "DPO", "trinity.trainer.recipes.dpo:DPORecipe", "pairs", ref="always",
                  rows_per_sample=2, defaults=(("data.packing", False),), rules=(_DPO_RULE,),
                  owns=(Owned("algorithm.dpo", "DPO settings apply to algorithm.name dpo", unit="block"),)),
    # MiniMax-M1's CISPO: GRPO's group advantages, clipped IS weight x A x log pi (trinity/algorithms/cispo.py)
    AlgorithmSpec("cispo", "CISPO", _RL, "prompts", ref="kl", group=True, advantages="grpo", evaluation="reward",
                  policy_loss="trinity.algorithms.cispo:cispo_policy_loss",
                  ignores=(Ignored("actor_rollout_ref.actor.clip_ratio_c", "the dual clip bounds PPO-clip's surrogate; "
                                   "CISPO clips the importance weight with clip_ratio_low / clip_ratio_high"),)),
)}
