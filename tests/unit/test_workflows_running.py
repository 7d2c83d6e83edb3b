"""The running batch (trinity.workflows.batcher.RunningBatcher) on the tiny megatron-core Qwen2 (fp32, CPU)
through the continuous engine: a turn that arrives while another's long answer decodes joins the batch and
returns first; keyed draws make sampled conversations independent of the episodes' timing; a timed-out
turn frees its row and slot; turns of another sampling setting run once the batch drains; an engine
error reaches every waiting turn; close() leaves no thread behind."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from tests.unit.test_workflows_engine import tiny  # noqa: F401  (the module's model fixture)
from trinity.config.schema.workflow import Limits
from trinity.rollout.types import SamplingParams
from trinity.workflows.backends import RolloutBackend
from trinity.workflows.batcher import EngineError, RunningBatcher
from trinity.workflows.runner import run_workflow
from trinity.workflows.session import Session
from trinity.workflows.types import TokenRequest


def _backend(model, tokenizer, seed=0) -> RolloutBackend:
    return RolloutBackend(model, vocab_size=len(tokenizer), pad_id=tokenizer.pad_token_id,
                          generator=torch.Generator().manual_seed(seed), context_tokens=1024)


def test_a_turn_that_arrives_during_a_long_answer_returns_first(tiny):  # noqa: F811
    """Episode 0 asks for 96 tokens; episode 1 asks for 2 tokens 20 ms later. Its turn joins the running
    batch and comes back while episode 0's answer still decodes (with waves it waited for that answer)."""
    model, tokenizer = tiny
    done: dict[str, float] = {}

    async def one_turn(task, session: Session):
        await asyncio.sleep(task["after_s"])
        await session.chat([{"role": "user", "content": "go"}], max_new_tokens=task["tokens"])
        done[task["name"]] = time.perf_counter()
        return session.finish(reward=float(len(session.turns[0].output_ids)))

    tasks = [{"name": "long", "after_s": 0.0, "tokens": 96}, {"name": "short", "after_s": 0.02, "tokens": 2}]
    long, short = run_workflow(one_turn, tasks, _backend(model, tokenizer), tokenizer,
                               sampling=SamplingParams(temperature=0.0), limits=Limits(context_tokens=1024))
    assert (long.reward, short.reward) == (96.0, 2.0)  # neither stopped early: the long one decoded 96 steps
    assert done["short"] < done["long"]


async def _delayed_turns(task, session: Session):
    """Three turns, each after the task's own pause (an environment that takes its time)."""
    messages = [{"role": "user", "content": task["q"]}]
    for k in range(3):
        await asyncio.sleep(task["pauses"][k])
        reply = await session.chat(messages, max_new_tokens=3 + k)
        messages += [reply.message, {"role": "user", "content": "more"}]
    return session.finish(reward=1.0)


def test_sampled_conversations_do_not_depend_on_timing(tiny):  # noqa: F811
    """Temperature 1, two samples per task: the same episodes with other pauses (turns joining at other
    steps, beside other rows; the engine not waiting for anyone) give the same tokens, since each turn's
    draws are keyed by (episode, turn, token)."""
    model, tokenizer = tiny
    qs = ["a", "bb", "ccc"]
    sampling = SamplingParams(temperature=1.0)
    calm = [{"q": q, "pauses": [0.0, 0.0, 0.0]} for q in qs]
    jittery = [{"q": q, "pauses": [0.01 * i, 0.02 * (2 - i), 0.015 * i]} for i, q in enumerate(qs)]
    a = run_workflow(_delayed_turns, calm, _backend(model, tokenizer), tokenizer, n=2, sampling=sampling, window_s=1.0)
    b = run_workflow(_delayed_turns, jittery, _backend(model, tokenizer), tokenizer, n=2, sampling=sampling,
                     window_s=0.0)
    for x, y in zip(a, b):
        assert [t.output_ids for t in x.turns] == [t.output_ids for t in y.turns]
        assert max(abs(p - q) for p, q in zip(x.sequences[0].logprobs, y.sequences[0].logprobs)) < 1e-5
    assert a[0].turns[0].output_ids != a[1].turns[0].output_ids  # a task's two samples draw differently
    # another seed, other draws
    c = run_workflow(_delayed_turns, calm, _backend(model, tokenizer, seed=1), tokenizer, n=2, sampling=sampling)
    assert [t.output_ids for t in c[0].turns] != [t.output_ids for t in a[0].turns]


def _run(coro):
    return asyncio.run(coro)


def test_a_timed_out_turn_frees_its_row_and_the_batch_goes_on(tiny):  # noqa: F811
    """One episode, so one output row: after its 500-token turn times out, its next turn can only start once
    the cancelled row has ended and freed its slot; it does, at once, and gets its 3 tokens."""
    model, tokenizer = tiny
    prompt = tuple(tokenizer.encode("hello"))

    async def main():
        batcher = RunningBatcher(_backend(model, tokenizer), episodes=1)
        try:
            with pytest.raises(TimeoutError):
                long = TokenRequest(prompt, SamplingParams(temperature=0.0, max_new_tokens=500, eos_token_ids=(-1,)), 0, 0)
                await asyncio.wait_for(batcher.generate(long), 0.05)
            t0 = time.perf_counter()
            short = TokenRequest(prompt, SamplingParams(temperature=0.0, max_new_tokens=3, eos_token_ids=(-1,)), 0, 1)
            result = await asyncio.wait_for(batcher.generate(short), 5.0)
            return result, time.perf_counter() - t0, batcher.stats
        finally:
            batcher.close()

    result, took, stats = _run(main())
    assert len(result.token_ids) == 3 and result.finish == "length"
    assert took < 1.0, took
    assert stats.turns == 2
    assert not [t for t in threading.enumerate() if t.name == "trinity-engine"]  # close() left no thread


class _Failing(RolloutBackend):
    """The real engine, whose third step raises."""

    def open(self, sampling, rows):
        inner = super().open(sampling, rows)

        class Wrapped:
            def __enter__(self_):
                stream = inner.__enter__()
                steps = [0]
                step = stream.step

                def failing_step():
                    steps[0] += 1
                    if steps[0] == 3:
                        raise RuntimeError("device lost")
                    return step()

                stream.step = failing_step
                return stream

            def __exit__(self_, *exc):
                return inner.__exit__(*exc)

        return Wrapped()


def test_an_engine_error_reaches_every_waiting_turn_and_close_leaves_no_thread(tiny):  # noqa: F811
    model, tokenizer = tiny
    prompt = tuple(tokenizer.encode("hi"))
    params = SamplingParams(temperature=0.0, max_new_tokens=20, eos_token_ids=(-1,))

    async def main():
        batcher = RunningBatcher(_Failing(model, vocab_size=len(tokenizer), pad_id=tokenizer.pad_token_id,
                                          context_tokens=256), episodes=3)
        try:
            got = await asyncio.gather(*(batcher.generate(TokenRequest(prompt, params, e, 0)) for e in range(3)),
                                       return_exceptions=True)
            with pytest.raises(EngineError):  # and every turn after it
                await batcher.generate(TokenRequest(prompt, params, 0, 1))
            return got, batcher
        finally:
            batcher.close()

    was_training = model.training
    got, batcher = _run(main())
    assert all(isinstance(e, EngineError) for e in got), got
    assert str(got[0]) == "the chat backend _Failing failed: RuntimeError: device lost"
    assert not batcher._thread.is_alive()
    assert not [t for t in threading.enumerate() if t.name == "trinity-engine"]
    assert model.training == was_training  # the engine left (eval mode only while it is open)


def test_turns_of_another_sampling_setting_run_after_the_batch_drains(tiny):  # noqa: F811
    """Two episodes at temperature 0 and one at 1: the engine opens once per setting, and a greedy turn's
    tokens are those it gets alone."""
    model, tokenizer = tiny

    async def one_turn(task, session: Session):
        await session.chat([{"role": "user", "content": task["q"]}], temperature=task["t"], max_new_tokens=6)
        return session.finish(reward=0.0)

    tasks = [{"q": "x", "t": 0.0}, {"q": "y", "t": 1.0}, {"q": "z", "t": 0.0}]
    backend = _backend(model, tokenizer)
    mixed = run_workflow(one_turn, tasks, backend, tokenizer)
    assert backend.calls == 2  # the greedy turns together, then the sampled one
    for task, ep in zip(tasks, mixed):
        if task["t"] == 0.0:
            (alone,) = run_workflow(one_turn, [task], _backend(model, tokenizer), tokenizer)
            assert ep.turns[0].output_ids == alone.turns[0].output_ids
        assert len(ep.turns[0].output_ids) >= 1
