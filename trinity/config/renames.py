"""Keys that verl, Trinity-RFT and ROLL name differently: the one table behind both the validator's
"use X instead" (trinity.config.loader, for an unknown key) and the table of docs/migrating.md, which
is generated from it (`python -m trinity.config.renames docs/migrating.md` rewrites it in place;
tests/unit/test_renames.py fails when the doc is stale).

A row's keys may start with a placeholder that stands for several blocks (PLACEHOLDERS): `{megatron}`
for every role's megatron block, `{optim}` for every trained role's optimizer, `{roll}` for ROLL's
role sections. A row without a `new` key has no equivalent here: the hint says to remove it.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from trinity.config.roles import Role


@dataclass(frozen=True)
class Rename:
    source: str  # the tool whose key this is
    old: str  # its dotted key (placeholders allowed)
    new: str  # the key(s) here, comma-separated; "" when there is none
    note: str = ""  # what else to know: values that change, the arithmetic of a split key


# placeholder -> (how the doc writes it, the blocks it stands for)
PLACEHOLDERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "{megatron}": ("<role>.megatron", tuple(f"{r.config_path}.megatron" for r in Role)),
    "{optim}": ("<role>.optim", tuple(f"{r.config_path}.optim" for r in Role if r.trained)),
    "{roll}": ("<ROLL role>", ("actor_train", "reference")),
}

_RECOMPUTE = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")

RENAMES: tuple[Rename, ...] = (
    # --- the megatron block (verl's ppo_megatron_trainer.yaml, Trinity-RFT, ROLL's strategy_config)
    Rename("verl", "{megatron}.override_ddp_config.overlap_grad_reduce", "{megatron}.overlap_grad_reduce", "one level up"),
    Rename("verl", "{megatron}.param_dtype", "model.dtype", "one dtype for the job"),
    Rename("verl", "{megatron}.vanilla_mbridge", ""),
    Rename("verl", "{megatron}.override_mcore_model_config", ""),
    Rename("verl", "{megatron}.dist_checkpointing_prefix", ""),
    *(Rename("ROLL", f"{{megatron}}.{key}", f"{{megatron}}.override_transformer_config.{key}", "one level down")
      for key in _RECOMPUTE),
    # --- the rest of a verl (Trinity-RFT) config
    Rename("verl", "algorithm.adv_estimator", "algorithm.name", "grpo is grpo, gae is ppo"),
    Rename("verl", "algorithm.kl_ctrl.kl_coef", "algorithm.kl_coef"),
    Rename("verl", "actor_rollout_ref.model.path", "model.path"),
    Rename("verl", "actor_rollout_ref.model.lora_rank", "actor_rollout_ref.actor.lora.rank"),
    Rename("verl", "actor_rollout_ref.model.lora_alpha", "actor_rollout_ref.actor.lora.alpha"),
    Rename("verl", "actor_rollout_ref.model.target_modules", "actor_rollout_ref.actor.lora.target_modules",
           "all-linear, Hugging Face names or megatron-core's (docs/lora.md)"),
    Rename("verl", "actor_rollout_ref.model.lora_adapter_path", "actor_rollout_ref.actor.lora.adapter_path",
           "a PEFT folder whose r, lora_alpha and target_modules are the job's"),
    Rename("verl", "data.max_response_length", "actor_rollout_ref.rollout.response_length"),
    Rename("verl", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "trainer.micro_batch_size"),
    Rename("verl", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", "actor_rollout_ref.actor.use_dynamic_bsz",
           "the old log-prob pass packs as the actor's update does"),
    Rename("verl", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
           "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "the old log-prob pass uses the actor's budget"),
    Rename("verl", "critic.forward_max_token_len_per_gpu", "critic.ppo_max_token_len_per_gpu",
           "the values pass uses the critic's budget"),
    Rename("verl", "{optim}.lr_decay_style", "{optim}.lr_scheduler", "cosine or constant"),
    Rename("verl", "trainer.total_training_steps", "trainer.total_steps"),
    Rename("verl", "trainer.save_freq", "trainer.save_interval", "verl's -1 (no checkpoints) is trainer.save_last: false"),
    Rename("verl", "trainer.default_local_dir", "trainer.output_dir"),
    Rename("verl", "trainer.resume_mode", "trainer.resume", "auto, disable, or the folder (verl's resume_path)"),
    Rename("verl", "trainer.resume_from_path", "trainer.resume", "the folder itself"),
    Rename("verl", "trainer.nnodes", "cluster.nnodes"),
    Rename("verl", "trainer.n_gpus_per_node", "cluster.nproc_per_node"),
    *(Rename("verl", f"custom_reward_function.{key}", "reward.function",
             'path and name in one value: "path/to/file.py:name" or "module.path:name"') for key in ("path", "name")),
    # --- ROLL's role sections (actor_train:, reference:)
    Rename("ROLL", "actor_train.strategy_args.strategy_config", "actor_rollout_ref.actor.megatron",
           "the mapping moves unchanged"),
    Rename("ROLL", "reference.strategy_args.strategy_config", "actor_rollout_ref.ref.megatron",
           "the mapping moves unchanged; roles share one layout here, so the actor's block must match"),
    Rename("ROLL", "{roll}.strategy_args.strategy_name", "", "megatron is the only strategy"),
    Rename("ROLL", "{roll}.device_mapping", "cluster.nnodes, cluster.nproc_per_node",
           "their product is the number of GPUs: 32 for list(range(0,32))"),
    Rename("ROLL", "{roll}.model_args.dtype", "model.dtype"),
    Rename("ROLL", "{roll}.model_args.disable_gradient_checkpointing",
           "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity",
           "false (checkpointing on) is full or selective"),
    Rename("ROLL", "{roll}.model_args.model_type", ""),
    Rename("ROLL", "{roll}.infer_batch_size", ""),
    Rename("ROLL", "actor_train.training_args.learning_rate", "actor_rollout_ref.actor.optim.lr"),
    Rename("ROLL", "actor_train.training_args.weight_decay", "actor_rollout_ref.actor.optim.weight_decay"),
    Rename("ROLL", "actor_train.training_args.warmup_steps", "actor_rollout_ref.actor.optim.lr_warmup_steps"),
    Rename("ROLL", "actor_train.training_args.per_device_train_batch_size", "trainer.micro_batch_size"),
    Rename("ROLL", "actor_train.training_args.gradient_accumulation_steps", "trainer.global_batch_size",
           "micro batch x accumulation x DP: 1 x 32 x 8 = 256 for ROLL's example"),
    Rename("ROLL", "actor_train.training_args.num_train_epochs", "trainer.total_epochs"),
)


@dataclass(frozen=True)
class Hint:
    """One row for one concrete key."""

    row: Rename
    old: str
    new: str

    def problem(self, where: str) -> str:
        """`old: ... ; how to fix it` for the validator; `where` is " (file:line)" or ""."""
        note = f" ({self.row.note})" if self.row.note else ""
        if not self.new:
            return f"{self.old}: {self.row.source}'s key, no equivalent here{where}; remove it{note}"
        return f"{self.old}: {self.row.source}'s key, named differently here{where}; use {self.new} instead{note}"


def _expand(key: str) -> list[tuple[int, str]]:
    """(placeholder index, concrete key) for each block the key's placeholder stands for."""
    for name, (_, blocks) in PLACEHOLDERS.items():
        if key.startswith(name):
            return [(i, block + key[len(name):]) for i, block in enumerate(blocks)]
    return [(0, key)]


def _hints() -> dict[str, Hint]:
    out: dict[str, Hint] = {}
    for row in RENAMES:
        news = dict(_expand(row.new)) if row.new.startswith("{") else None
        for i, old in _expand(row.old):
            out[old] = Hint(row, old, news[i] if news else row.new)
    return out


HINTS = _hints()


def hints_at(path: str, value: Any) -> tuple[list[Hint], list[str]]:
    """For an unknown key at `path` holding `value`: the hints of the renamed keys at or under it that the
    value holds, and (when there are any) the other keys under it, which have no row."""
    if path in HINTS:
        return [HINTS[path]], []
    found = [h for old, h in HINTS.items() if old.startswith(path + ".") and _holds(value, old[len(path) + 1:])]
    if not found:
        return [], []
    covered = {h.old for h in found}
    rest = [key for key in _leaves(value, path) if not any(key == c or key.startswith(c + ".") for c in covered)]
    return found, [key for key in rest if not any(c.startswith(key + ".") for c in covered)]


def _holds(value: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return False
        value = value[part]
    return True


def _leaves(value: Any, prefix: str) -> Iterator[str]:
    if not isinstance(value, dict) or not value:
        yield prefix
        return
    for key, sub in value.items():
        yield from _leaves(sub, f"{prefix}.{key}")


# --- docs/migrating.md ---------------------------------------------------------------------------------

BEGIN = "<!-- generated by python -m trinity.config.renames: edit trinity/config/renames.py, not this table -->"
END = "<!-- end of the generated table -->"


def _doc_key(key: str) -> str:
    for name, (shown, _) in PLACEHOLDERS.items():
        key = key.replace(name, shown)
    return ", ".join(f"`{k.strip()}`" for k in key.split(","))


def markdown() -> str:
    """The table of docs/migrating.md, between its markers."""
    legend = "; ".join(f"`{shown}` is {', '.join(f'`{b}`' for b in blocks)}" for shown, blocks in PLACEHOLDERS.values())
    lines = [BEGIN, "", f"({legend}.)", "", "| from | their key | here | note |", "|---|---|---|---|"]
    for row in RENAMES:
        new = _doc_key(row.new) if row.new else "— (remove it)"
        lines.append(f"| {row.source} | {_doc_key(row.old)} | {new} | {row.note} |")
    return "\n".join([*lines, "", END])


def rewrite(text: str) -> str:
    """`text` (docs/migrating.md) with its generated table replaced by markdown()."""
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError("docs/migrating.md has no generated table (its markers are missing)")
    return pattern.sub(lambda _: markdown(), text)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        doc = Path(sys.argv[1])
        doc.write_text(rewrite(doc.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        print(markdown())
