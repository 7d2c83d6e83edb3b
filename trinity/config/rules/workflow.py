"""Rules of the `workflow:` block (multi-turn, tool-using RL; docs/workflows.md), checked with the rest of
the job before any process starts.

A user's workflow module is found and parsed with `ast`, never imported: no code from a user's file runs
at validation (as `reward.function`, trinity.rewards.loader); the trainer imports it when the job starts.
"""

from __future__ import annotations

import ast
from pathlib import Path

from trinity.config.schema import JobConfig
from trinity.config.schema.reward import RewardConfig
from trinity.config.schema.workflow import BUILTIN_WORKFLOWS

# The recipes whose sampling phase a workflow replaces (trinity.trainer.recipes.workflow); DAPO's own
# `sample` (dynamic sampling) regenerates and filters groups of single responses.
WORKFLOW_RECIPES = ("trinity.trainer.recipes.rl:RLRecipe", "trinity.trainer.recipes.ppo:PPORecipe")
# Engine calls that are collectives over several ranks: every rank would have to batch the same turns
# into the same calls, which the episodes' timing (tools, timeouts) does not guarantee.
MODEL_PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                  "expert_model_parallel_size")


def check_workflow(cfg: JobConfig, problems: list[str], check_paths: bool) -> None:
    wf = cfg.workflow
    if wf is None:
        return
    algo = cfg.spec.name
    if not cfg.is_rl:
        problems.append(f"workflow: {algo} does not generate, so a workflow cannot run; remove the block or use an "
                        "RL algorithm (grpo, rloo, ppo, reinforce_plus_plus, cispo)")
        return
    if cfg.spec.recipe not in WORKFLOW_RECIPES:
        problems.append(f"workflow: {algo} samples with its own recipe (dynamic sampling) and cannot run a workflow; "
                        "use grpo, rloo, ppo, reinforce_plus_plus or cispo, or remove the block")
    megatron = cfg.actor_rollout_ref.actor.megatron
    for key in MODEL_PARALLEL:
        if getattr(megatron, key) > 1:
            problems.append(
                f"actor_rollout_ref.actor.megatron.{key}: workflows generate on one rank per model replica (the "
                f"ranks of a model-parallel group would have to batch the same turns into the same engine calls); "
                f"set it to 1 or remove the workflow block")
    if cfg.reward != RewardConfig():
        problems.append("reward: a workflow scores its own episodes, so the reward block would not take effect; "
                        "remove it (the workflow returns session.finish(reward=...))")
    if cfg.data.val_files:
        problems.append("data.val_files: evaluation scores single responses with reward.function, which a workflow "
                        "job does not use; remove data.val_files")
    longest = cfg.data.max_prompt_length + cfg.actor_rollout_ref.rollout.response_length
    if wf.context_tokens is not None and wf.context_tokens > longest:
        problems.append(
            f"workflow.context_tokens: {wf.context_tokens} tokens is more than data.max_prompt_length + "
            f"actor_rollout_ref.rollout.response_length = {longest}, the sequence length the token budgets, the KV "
            f"cache and the model's positions are checked against; raise data.max_prompt_length or lower "
            f"workflow.context_tokens (unset, it is {longest})")
    if wf.function not in BUILTIN_WORKFLOWS and check_paths:
        problems += workflow_function_problems(wf.function)


def workflow_function_problems(spec: str, cwd: str | Path | None = None) -> list[str]:
    """`workflow.function: ...` problems of a user's `module.path:function`: the module is found from `cwd`
    (where `trinity run` starts the workers) and parsed; the function must be a top-level `async def`."""
    from trinity.rewards.loader import _find_module_file, _top_level_names

    module_name, _, fn_name = spec.partition(":")
    base = Path(cwd) if cwd is not None else Path.cwd()
    path, found = _find_module_file(module_name, base)
    if not found:
        return [f"workflow.function: module {module_name} not found in {base} or on the Python path; install it "
                "or run trinity from its folder"]
    if path is None:
        return []  # compiled or built-in: nothing to parse
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as exc:
        return [f"workflow.function: {path}:{exc.lineno}: syntax error in the workflow module: {exc.msg}"]
    except (OSError, ValueError) as exc:
        return [f"workflow.function: cannot read {path} ({exc})"]
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == fn_name:
            return [f"workflow.function: {path} defines {fn_name} with `def`; a workflow is a coroutine: "
                    f"write `async def {fn_name}(task, session, **args)`"]
        if isinstance(node, ast.AsyncFunctionDef) and node.name == fn_name:
            return []
    names, star = _top_level_names(tree)
    if fn_name in names or star:
        return []  # bound another way (an import, an assignment): checked when the job starts
    defs = sorted(n.name for n in tree.body if isinstance(n, ast.AsyncFunctionDef))
    have = f"its top-level async functions: {', '.join(defs[:10])}" if defs else "it defines no top-level async def"
    return [f"workflow.function: {path} does not define {fn_name!r} at top level ({have})"]
