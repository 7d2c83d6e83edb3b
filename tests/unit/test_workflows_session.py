"""Conversation bookkeeping with a scripted policy (exact assistant text a random model never writes): the
training sequence and loss mask of a tool-using conversation against hand-built ones, a template that
re-renders earlier turns (Qwen3's <think>), templates without tools, the guess-number game's end reasons
and the error policy."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from trinity.config.schema.workflow import Limits
from trinity.rollout.types import SamplingParams
from trinity.testing.chat_templates import QWEN2_5, QWEN3
from trinity.workflows.backends import ScriptedBackend
from trinity.workflows.calculator import (
    CALCULATOR_TOOL,
    calculator,
    calculator_workflow,
)
from trinity.workflows.guess_number import guess_number_workflow
from trinity.workflows.registry import resolve_workflow
from trinity.workflows.runner import WorkflowError, run_workflow
from trinity.workflows.session import Session
from trinity.workflows.tool_calls import ToolsNotSupported
from trinity.workflows.transcript import TemplateMismatch, Transcript, render

LOGP = -0.5


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from trinity.testing.tiny_assets import make_tiny_tokenizer

    return AutoTokenizer.from_pretrained(str(make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))), trust_remote_code=False)


def _with_template(tokenizer, template):
    tokenizer.chat_template = template
    return tokenizer


def _run(tokenizer, workflow, replies, tasks=({},), **kw):
    backend = ScriptedBackend(tokenizer, replies, logprob=LOGP)
    return run_workflow(workflow, list(tasks), backend, tokenizer, **kw), backend


def test_tool_conversation_mask_equals_a_hand_built_one(tokenizer):
    """Three assistant turns: a call of an unknown tool, a good call, the answer. Only the sampled ids (their
    stop id included) are trained; the tool answers and the template's markup are masked out."""
    from trinity.testing.tiny_assets import CHAT_TEMPLATE

    tok = _with_template(tokenizer, QWEN2_5)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+7"}}\n</tool_call>'
    replies = [call.replace('"calculator"', '"calc"'), call, "The answer is 19."]
    (ep,), backend = _run(tok, calculator_workflow, replies, tasks=[{"prompt": "12+7=", "answer": "19"}])
    assert (ep.end, ep.reward, len(ep.turns), len(ep.sequences)) == ("finished", 1.0, 3, 1)

    user = {"role": "user", "content": "Compute 12+7= Use the calculator tool if it helps, then answer with the number."}
    pieces = [  # (text, trained)
        (render(tok, [user], [CALCULATOR_TOOL]), 0),
        (replies[0] + "<|im_end|>", 1),
        ("\n<|im_start|>user\n<tool_response>\nerror: unknown tool 'calc'; tools: calculator\n</tool_response>"
         "<|im_end|>\n<|im_start|>assistant\n", 0),
        (replies[1] + "<|im_end|>", 1),
        ("\n<|im_start|>user\n<tool_response>\n19\n</tool_response><|im_end|>\n<|im_start|>assistant\n", 0),
        (replies[2] + "<|im_end|>", 1),
    ]
    tokens, mask = [], []
    for text, trained in pieces:
        ids = tok.encode(text, add_special_tokens=False)
        tokens += ids
        mask += [trained] * len(ids)
    seq = ep.sequences[0]
    assert list(seq.tokens) == tokens
    assert list(seq.loss_mask) == mask
    assert list(seq.logprobs) == [LOGP if m else 0.0 for m in mask]
    # the engine was given exactly the sequence's prefixes
    ends = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
    assert backend.prompts == [tuple(tokens[:i]) for i in ends]
    assert ep.turns[1].tool_calls[0].arguments == {"expression": "12+7"}
    assert [m["role"] for m in ep.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]

    # a template without tools (the tiny tokenizer's own, SmolLM2-style) refuses tools= with a clear error
    plain = _with_template(tokenizer, CHAT_TEMPLATE)
    with pytest.raises(ToolsNotSupported, match=r"^the chat template of tokenizer '.*tok\d+' does not use `tools`"):
        asyncio.run(Session({}, plain, engine=None).chat([user], tools=[CALCULATOR_TOOL]))
    with pytest.raises(WorkflowError, match="ToolsNotSupported: .* does not use `tools`"):  # a setup error: not scored
        _run(plain, calculator_workflow, replies, tasks=[{"prompt": "1+1=", "answer": "2"}],
             limits=Limits(on_error="zero"))


def test_qwen3_thinking_dropped_from_earlier_turns_starts_a_new_segment(tokenizer):
    tok = _with_template(tokenizer, QWEN3)
    replies = ["<think>\nhalf of 100\n</think>\n\n50", "<think>\nhalf again\n</think>\n\n25", "37"]
    (ep,), _ = _run(tok, guess_number_workflow, replies, tasks=[{"secret": 37}])
    assert ep.end == "finished" and len(ep.turns) == 3
    # each new user message makes the template drop the earlier turns' <think>: one sequence per turn
    assert len(ep.sequences) == 3
    for seq, turn in zip(ep.sequences, ep.turns):
        assert seq.tokens == turn.prompt_ids + turn.output_ids
        assert sum(seq.loss_mask) == len(turn.output_ids)
    text = tok.decode(list(ep.sequences[1].tokens))
    assert "<|im_start|>assistant\n50<|im_end|>" in text and "half of 100" not in text  # re-rendered, as context

    with pytest.raises(TemplateMismatch, match=r"re-renders the conversation so far differently"):
        transcript = Transcript(tok, "fail")
        first = [{"role": "user", "content": "guess"}]
        prompt = transcript.prompt(first)
        transcript.record(prompt, tok.encode(replies[0]) + [2], [LOGP] * (len(tok.encode(replies[0])) + 1), replies[0] + "<|im_end|>")
        transcript.prompt(first + [{"role": "assistant", "content": replies[0]}, {"role": "user", "content": "Lower."}])
    with pytest.raises(WorkflowError, match="TemplateMismatch"):
        _run(tok, guess_number_workflow, replies, tasks=[{"secret": 37}], limits=Limits(template_mismatch="fail"))


def test_qwen3_tool_loop_keeps_its_thinking_and_one_sequence(tokenizer):
    """Tool answers are not user queries to Qwen3's template: the turns since the last user message keep their
    <think> blocks, so a tool loop stays one training sequence."""
    tok = _with_template(tokenizer, QWEN3)
    call = '<think>\nuse the tool\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+7"}}\n</tool_call>'
    (ep,), _ = _run(tok, calculator_workflow, [call, "<think>\nit said 19\n</think>\n\n19"],
                    tasks=[{"prompt": "12+7=", "answer": "19"}])
    assert (ep.end, ep.reward, len(ep.turns), len(ep.sequences)) == ("finished", 1.0, 2, 1)
    assert sum(ep.sequences[0].loss_mask) == sum(len(t.output_ids) for t in ep.turns)


def test_guess_number_end_reasons(tokenizer):
    tok = _with_template(tokenizer, QWEN2_5)
    (ep,), _ = _run(tok, guess_number_workflow, ["50", "I say 25", "37"], tasks=[{"secret": 37}])
    assert (ep.end, ep.reward) == ("finished", 1.0 - 2 / 8)
    assert ep.turn_rewards == pytest.approx((1 - 49 / 100, 1 - 24 / 49, 1.0))  # open range 1..100 -> 1..49 -> 26..49
    assert [m["content"] for m in ep.messages if m["role"] == "user"][1:] == ["Lower.", "Higher."]
    (ep,), _ = _run(tok, guess_number_workflow, ["50", "no", "37"], tasks=[{"secret": 37}], limits=Limits(max_turns=2))
    assert (ep.end, ep.reward, len(ep.turns)) == ("max_turns", 0.0, 2)
    assert ep.turn_rewards == pytest.approx((0.51, 0.0))
    # the conversation is what the model saw and said: it ends with its last turn
    assert ep.messages[-2:] == ({"role": "user", "content": "Lower."}, {"role": "assistant", "content": "no"})


async def _raises(task, session):
    raise ValueError("boom")


async def _hangs(task, session):
    await asyncio.sleep(30)


async def _garbage(task, session):
    await session.chat([{"role": "user", "content": "hi"}])
    return {"reward": 1.0}


async def _nan(task, session):
    await session.chat([{"role": "user", "content": "hi"}])
    return session.finish(reward=float("nan"))


async def _two_turns_at_once(task, session):
    messages = [{"role": "user", "content": "hi"}]
    await asyncio.gather(session.chat(messages), session.chat(messages))


async def _short_turn_rewards(task, session):
    await session.chat([{"role": "user", "content": "hi"}])
    return session.finish(turn_rewards=[1.0, 0.0])


def _not_async(task, session):
    return None


class _SlowBackend(ScriptedBackend):
    def generate(self, requests):
        time.sleep(0.3)
        return super().generate(requests)


@pytest.mark.parametrize("workflow,end,message", [
    (_raises, "error", "ValueError: boom"),
    (_hangs, "timeout", "the episode ran over 0.2 s"),
    (_garbage, "error", "returned dict, not an Episode (return session.finish(reward=...))"),
    (_nan, "error", "returned a reward that is not a finite number: nan"),
    (_short_turn_rewards, "error", "returned 2 turn_rewards for 1 turns"),
    (_two_turns_at_once, "error", "RuntimeError: a session runs one chat turn at a time: await each session.chat "
                                  "before the next"),
])
def test_error_policy(tokenizer, workflow, end, message):
    tok = _with_template(tokenizer, QWEN2_5)
    limits = dict(episode_timeout_s=0.2)
    episodes, _ = _run(tok, workflow, ["a", "b"], tasks=[{"i": 0}, {"i": 1}], limits=Limits(on_error="zero", **limits))
    assert [(e.end, e.reward, e.error) for e in episodes] == [(end, 0.0, message)] * 2
    assert [e.task for e in episodes] == [{"i": 0}, {"i": 1}]
    with pytest.raises(WorkflowError, match=rf"^workflow {workflow.__name__}, task 0 sample 0: {end}: {re.escape(message)}$"):
        _run(tok, workflow, ["a", "b"], limits=Limits(on_error="fail", **limits))


class _Broken(ScriptedBackend):
    def generate(self, requests):
        raise RuntimeError("out of KV cache")


def test_engine_failure_stops_the_run_whatever_the_policy(tokenizer):
    tok = _with_template(tokenizer, QWEN2_5)
    with pytest.raises(WorkflowError, match=r"task 0 sample 0: error: EngineError: the chat backend _Broken failed: "
                                            r"RuntimeError: out of KV cache$"):
        run_workflow(guess_number_workflow, [{"secret": 3}], _Broken(tok, []), tok, limits=Limits(on_error="zero"))


def test_wrong_args_stop_the_run_whatever_the_policy(tokenizer):
    tok = _with_template(tokenizer, QWEN2_5)
    with pytest.raises(WorkflowError, match=r"^workflow guess_number_workflow: its args do not fit \(task, session, "
                                            r"\*\*args\): got an unexpected keyword argument 'max_new'$"):
        run_workflow(guess_number_workflow, [{"secret": 3}], ScriptedBackend(tok, ["3"]), tok,
                     args={"max_new": 4}, limits=Limits(on_error="zero"))


def test_turn_timeout_and_resolution(tokenizer):
    tok = _with_template(tokenizer, QWEN2_5)
    backend = _SlowBackend(tok, ["50"])
    (ep,) = run_workflow(guess_number_workflow, [{"secret": 3}], backend, tok,
                         limits=Limits(turn_timeout_s=0.05, on_error="zero"))
    assert (ep.end, ep.error, ep.turns) == ("timeout", "turn 1 waited over 0.05 s", ())
    assert resolve_workflow("guess_number") is guess_number_workflow
    assert resolve_workflow("trinity.workflows.calculator:calculator_workflow") is calculator_workflow
    with pytest.raises(ValueError, match="must be an `async def`"):
        resolve_workflow(f"{__name__}:_not_async")
    with pytest.raises(ValueError, match="expected a built-in"):
        resolve_workflow("no_such_workflow")


def test_session_sampling_and_stop_ids(tokenizer):
    """A turn samples with the session's settings overridden per call, stops at <|im_end|>, and never past the
    context limit."""
    tok = _with_template(tokenizer, QWEN2_5)
    seen = []

    class Recorder(ScriptedBackend):
        def generate(self, requests):
            seen.extend(r.sampling for r in requests)
            return super().generate(requests)

    async def two_turns(task, session: Session):
        await session.chat([{"role": "user", "content": "a"}], temperature=0.0, max_new_tokens=3)
        await session.chat([{"role": "user", "content": "a"}, session.messages[-1], {"role": "user", "content": "b"}])
        return session.finish(reward=1.0)

    (ep,) = run_workflow(two_turns, [{}], Recorder(tok, ["hello", "x"]), tok,
                         sampling=SamplingParams(temperature=0.7, top_k=5, max_new_tokens=9))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert seen[0] == SamplingParams(temperature=0.0, top_k=5, max_new_tokens=3, eos_token_ids=(im_end,))
    assert seen[1] == SamplingParams(temperature=0.7, top_k=5, max_new_tokens=9, eos_token_ids=(im_end,))
    assert ep.turns[0].finish == "length" and ep.turns[0].text == "hel"  # cut at 3 tokens, no stop id
    assert ep.turns[1].finish == "stop" and ep.turns[1].output_ids[-1] == im_end
    # the cut turn's <|im_end|> comes from the template: context, not trained
    seq = ep.sequences[0]
    cut_end = len(ep.turns[0].prompt_ids) + 3
    assert seq.tokens[cut_end] == im_end and seq.loss_mask[cut_end] == 0


def test_tool_results_and_tool_errors_go_back_to_the_model(tokenizer):
    tok = _with_template(tokenizer, QWEN2_5)

    def call(args: str) -> str:
        return f'<tool_call>{{"name": "calculator", "arguments": {args}}}</tool_call>'

    reply = call('{"expression": "2**10"}') + call('{"expression": "1/0"}') + call('{"expr": "1"}') + "<tool_call>{"

    answers = []

    async def one_round(task, session: Session):
        got = await session.chat([{"role": "user", "content": "go"}], tools=[CALCULATOR_TOOL])
        answers.extend(await session.call_tools(got, {"calculator": calculator}))
        return session.finish(reward=1.0)

    run_workflow(one_round, [{}], ScriptedBackend(tok, [reply]), tok, sampling=SamplingParams(max_new_tokens=512))
    assert [m["content"] for m in answers] == [
        "1024", "error: division by zero", "error: calculator() got an unexpected keyword argument 'expr'",
        "error: a <tool_call> block is not closed with </tool_call>"]
    assert all(m["role"] == "tool" for m in answers)


def test_a_tool_past_the_turn_timeout_ends_the_episode(tokenizer):
    tok = _with_template(tokenizer, QWEN2_5)

    def slow(**_: object) -> str:
        time.sleep(0.6)
        return "late"

    async def uses_slow_tool(task, session: Session):
        got = await session.chat([{"role": "user", "content": "go"}], tools=[CALCULATOR_TOOL])
        await session.call_tools(got, {"calculator": slow})
        return session.finish(reward=1.0)

    reply = '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>'
    (ep,) = run_workflow(uses_slow_tool, [{}], ScriptedBackend(tok, [reply]), tok,
                         limits=Limits(turn_timeout_s=0.3, on_error="zero"))
    assert (ep.end, ep.reward, ep.error, len(ep.turns)) == ("timeout", 0.0, "tool 'calculator' ran over 0.3 s", 1)


def test_an_episode_busy_with_its_environment_does_not_hold_the_batch_back(tokenizer):
    """Both first turns go in one engine step; then episode 1 spends 0.3 s in its environment, and episode 0's
    second turn goes alone after the batcher's window (10 ms) instead of waiting for it."""
    tok = _with_template(tokenizer, QWEN2_5)
    sizes, at = [], []

    class Recorder(ScriptedBackend):
        def generate(self, requests):
            sizes.append(len(requests))
            at.append(time.perf_counter())
            return super().generate(requests)

    async def two_turns(task, session: Session):
        messages = [{"role": "user", "content": "a"}]
        reply = await session.chat(messages)
        await asyncio.sleep(task["env_s"])
        await session.chat([*messages, reply.message, {"role": "user", "content": "b"}])
        return session.finish(reward=1.0)

    episodes = run_workflow(two_turns, [{"env_s": 0.0}, {"env_s": 0.3}], Recorder(tok, ["x"] * 4), tok)
    assert [e.end for e in episodes] == ["finished"] * 2
    assert sizes == [2, 1, 1]
    assert at[1] - at[0] < 0.25 <= at[2] - at[0]


def test_template_args_reach_the_template(tokenizer):
    """Qwen3 without thinking: its generation prompt closes an empty <think> block, which the prompt the
    engine gets ends with (and which is context, not trained)."""
    tok = _with_template(tokenizer, QWEN3)
    backend = ScriptedBackend(tok, ["5"])
    (ep,) = run_workflow(guess_number_workflow, [{"secret": 5}], backend, tok,
                         template_args={"enable_thinking": False})
    assert ep.end == "finished"
    assert tok.decode(list(backend.prompts[0])).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    (plain,) = run_workflow(guess_number_workflow, [{"secret": 5}], ScriptedBackend(tok, ["5"]), tok)
    assert tok.decode(list(plain.turns[0].prompt_ids)).endswith("<|im_start|>assistant\n")
