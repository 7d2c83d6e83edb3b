"""Run a workflow over tasks, all episodes at once in one event loop, their turns in one running batch.

Each episode: a `Session` over the shared `RunningBatcher`, the workflow coroutine under `episode_timeout_s`,
then the outcome:
- the workflow returns an `Episode` with a finite reward (or per-turn rewards): kept;
- an `EpisodeLimit` it did not catch (`max_turns`, `context_limit`): the episode so far, scored 0;
- it raised, ran over a timeout, or returned anything else: the error policy (`Limits.on_error`);
- except errors of the setup, never an episode's: the engine failed (`EngineError`), tools given to a
  template without tools (`ToolsNotSupported`), a template mismatch under the `fail` policy
  (`TemplateMismatch`): these stop the run whatever the policy.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from typing import Mapping, Sequence

from trinity.config.schema.workflow import Limits
from trinity.rollout.types import SamplingParams
from trinity.workflows.batcher import EngineError, RunningBatcher
from trinity.workflows.registry import Workflow
from trinity.workflows.session import EpisodeLimit, Session, TurnTimeout
from trinity.workflows.stream import StreamBackend, streaming
from trinity.workflows.tool_calls import ToolsNotSupported
from trinity.workflows.transcript import TemplateMismatch
from trinity.workflows.types import (
    JSON,
    ChatBackend,
    ChatTokenizer,
    EndReason,
    Episode,
    Task,
)


class WorkflowError(RuntimeError):
    """An episode failed under the `fail` error policy, or the setup failed."""


_SETUP_ERRORS = (EngineError, ToolsNotSupported, TemplateMismatch)


def _problem(episode: object) -> str | None:
    if not isinstance(episode, Episode):
        return f"returned {type(episode).__name__}, not an Episode (return session.finish(reward=...))"
    scores = [episode.reward] if episode.reward is not None else list(episode.turn_rewards or [])
    if episode.reward is None and episode.turn_rewards is None:
        return "returned an Episode without reward or turn_rewards"
    if episode.turn_rewards is not None and len(episode.turn_rewards) != len(episode.turns):
        return f"returned {len(episode.turn_rewards)} turn_rewards for {len(episode.turns)} turns"
    bad = [s for s in scores if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s)]
    return f"returned a reward that is not a finite number: {bad[0]!r}" if bad else None


async def run_episode(workflow: Workflow, task: Task, batcher: RunningBatcher, tokenizer: ChatTokenizer, *,
                      episode: int = 0, limits: Limits = Limits(), sampling: SamplingParams = SamplingParams(),
                      args: Mapping[str, JSON] | None = None, label: str = "task",
                      template_args: Mapping[str, JSON] | None = None) -> Episode:
    """Episode number `episode` of the batcher's; `template_args`: the chat template's own variables (Qwen3's
    `enable_thinking`)."""
    session = Session(task, tokenizer, batcher, limits=limits, sampling=sampling, template_args=template_args,
                      episode=episode)
    name = getattr(workflow, "__qualname__", repr(workflow))
    kwargs = dict(args or {})
    try:  # wrong args are the setup's mistake, not an episode's: never scored away
        inspect.signature(workflow).bind(task, session, **kwargs)
    except TypeError as e:
        raise WorkflowError(f"workflow {name}: its args do not fit (task, session, **args): {e}") from None

    def failed(end: EndReason, message: str, setup: bool = False) -> Episode:
        if limits.on_error == "fail" or setup:
            raise WorkflowError(f"workflow {name}, {label}: {end}: {message}")
        return session.finish(reward=0.0, end=end, error=message)

    try:
        result = await asyncio.wait_for(workflow(task, session, **kwargs), limits.episode_timeout_s)
    except EpisodeLimit as e:
        return session.finish(reward=0.0, end=e.reason)
    except TurnTimeout as e:
        return failed("timeout", str(e))
    except TimeoutError:
        return failed("timeout", f"the episode ran over {limits.episode_timeout_s} s")
    except Exception as e:
        return failed("error", f"{type(e).__name__}: {e}", setup=isinstance(e, _SETUP_ERRORS))
    finally:
        batcher.leave(episode)
    problem = _problem(result)
    return failed("error", problem) if problem else result


async def run_episodes(workflow: Workflow, tasks: Sequence[Task], backend: ChatBackend | StreamBackend,
                       tokenizer: ChatTokenizer, *,
                       n: int = 1, limits: Limits = Limits(), sampling: SamplingParams = SamplingParams(),
                       args: Mapping[str, JSON] | None = None, window_s: float = 0.01,
                       template_args: Mapping[str, JSON] | None = None) -> list[Episode]:
    """n episodes per task (task-major order), all concurrent; `window_s`: how long the engine waits for an
    episode it has just answered (`RunningBatcher`)."""
    batcher = RunningBatcher(streaming(backend), episodes=len(tasks) * n, window_s=window_s)
    jobs = [run_episode(workflow, task, batcher, tokenizer, episode=i * n + k, limits=limits, sampling=sampling,
                        args=args, label=f"task {i} sample {k}", template_args=template_args)
            for i, task in enumerate(tasks) for k in range(n)]
    try:
        return list(await asyncio.gather(*jobs))
    finally:
        batcher.close()


def run_workflow(workflow: Workflow, tasks: Sequence[Task], backend: ChatBackend | StreamBackend,
                 tokenizer: ChatTokenizer, *, n: int = 1, limits: Limits = Limits(),
                 sampling: SamplingParams = SamplingParams(), args: Mapping[str, JSON] | None = None,
                 window_s: float = 0.01, template_args: Mapping[str, JSON] | None = None) -> list[Episode]:
    """`run_episodes` from synchronous code (its own event loop)."""
    return asyncio.run(run_episodes(workflow, tasks, backend, tokenizer, n=n, limits=limits, sampling=sampling,
                                    args=args, window_s=window_s, template_args=template_args))
