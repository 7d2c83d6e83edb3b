"""Workflows on the tiny megatron-core Qwen2 (fp32, CPU) through today's rollout engines: each assistant
token's stored behaviour log-prob equals a teacher-forced forward of the whole conversation; the games end
with the right reasons; concurrent episodes give the conversations sequential ones give at greedy decoding."""

from __future__ import annotations

import pytest
import torch

from trinity.config.schema.workflow import Limits
from trinity.rollout.types import SamplingParams
from trinity.testing.chat_templates import QWEN2_5
from trinity.workflows.backends import RolloutBackend
from trinity.workflows.calculator import CALCULATOR_TOOL, calculator_workflow
from trinity.workflows.guess_number import guess_number_workflow
from trinity.workflows.runner import run_workflow
from trinity.workflows.session import Session
from trinity.workflows.types import TrainingSequence


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(megatron model chunk, tokenizer with Qwen2.5's tool template) of a random Qwen2 over the tiny
    byte-level tokenizer (259 tokens, vocabulary padded to 320)."""
    from transformers import AutoTokenizer

    from trinity.distributed.parallel import destroy
    from trinity.testing.tiny_assets import make_tiny_tokenizer
    from trinity.testing.tiny_models import tiny_chunk_cpu

    tokenizer = AutoTokenizer.from_pretrained(str(make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))), trust_remote_code=False)
    tokenizer.chat_template = QWEN2_5
    model, _, _ = tiny_chunk_cpu("qwen2", tmp_path_factory.mktemp("qwen2"), vocab_size=320, max_position_embeddings=4096)
    yield model, tokenizer
    destroy()


def _backend(model, tokenizer, engine="continuous", seed=0) -> RolloutBackend:
    return RolloutBackend(model, vocab_size=len(tokenizer), pad_id=tokenizer.pad_token_id, engine=engine,
                          generator=torch.Generator().manual_seed(seed))


async def _three_turns(task, session: Session) -> object:
    """Tool-using turn, a tool answer, a second turn, a user message, a third turn (whatever the model says)."""
    messages = [{"role": "user", "content": "Compute 12+7="}]
    reply = await session.chat(messages, tools=[CALCULATOR_TOOL])
    messages += [reply.message, {"role": "tool", "content": "19"}]
    reply = await session.chat(messages, tools=[CALCULATOR_TOOL])
    messages += [reply.message, {"role": "user", "content": "And 3-8="}]
    await session.chat(messages, tools=[CALCULATOR_TOOL])
    return session.finish(reward=0.5)


def _teacher_forced(model, seq: TrainingSequence, vocab_size: int) -> torch.Tensor:
    """log p(tokens[i] | tokens[:i]) for i >= 1 from one forward over the whole sequence, fp32 [S - 1]."""
    from trinity.models.logprobs import decoder_hidden, token_logprobs

    ids = torch.tensor([seq.tokens])
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        hidden = decoder_hidden(model, ids[:, :-1], pos[:, :-1], None)
        return token_logprobs(model, hidden, ids[:, 1:], vocab_size=vocab_size)[0]


@pytest.mark.parametrize("engine", ["continuous", "reference"])
def test_multi_turn_logprobs_equal_a_teacher_forced_forward(tiny, engine):
    model, tokenizer = tiny
    episodes = run_workflow(_three_turns, [{}, {}], _backend(model, tokenizer, engine), tokenizer,
                            sampling=SamplingParams(temperature=1.0, max_new_tokens=6))
    for ep in episodes:
        assert ep.end == "finished" and len(ep.turns) == 3 and len(ep.sequences) == 1
        (seq,) = ep.sequences
        _, mask, behaviour = seq.tensors()
        assert int(mask.sum()) == sum(len(t.output_ids) for t in ep.turns) >= 3
        # the last turn's prompt is the whole conversation before its response
        assert ep.turns[-1].prompt_ids == seq.tokens[: len(ep.turns[-1].prompt_ids)]
        forced = _teacher_forced(model, seq, len(tokenizer))
        on = mask[1:].bool()
        assert (behaviour[1:][on] - forced[on]).abs().max().item() < 1e-4
        assert torch.all(behaviour[~mask.bool()] == 0)
    assert episodes[0].turns[0].output_ids != episodes[1].turns[0].output_ids  # two samples, two draws


def test_a_turn_prefills_only_past_its_conversation_so_far(tiny):
    """Each later turn takes its conversation's parked KV slot and prefills only the tokens past the
    previous turn's prompt and answer: the same conversations and log-probs (1e-5) as prefilling every
    turn's prompt whole, with as many prompt tokens computed fewer as it reused."""
    model, tokenizer = tiny
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    runs = {}
    for reuse in (True, False):
        backend = _backend(model, tokenizer, seed=5)
        backend.reuse = reuse
        runs[reuse] = (run_workflow(_three_turns, [{}, {}, {}], backend, tokenizer, sampling=sampling), backend.stats)
    (on, on_stats), (off, off_stats) = runs[True], runs[False]
    for a, b in zip(on, off):
        assert len(a.turns) == 3 and a.sequences[0].tokens == b.sequences[0].tokens
        assert max(abs(x - y) for x, y in zip(a.sequences[0].logprobs, b.sequences[0].logprobs)) < 1e-5
    # every later turn reused at least its previous prompt (the answer's last token is fed by the prefill)
    assert on_stats.reused_tokens >= sum(len(t.prompt_ids) for ep in on for t in ep.turns[:-1])
    assert off_stats.reused_tokens == 0
    # the same prompt tokens in all, up to how many prefills the 3 identical first prompts took in each run
    # (one per admission: the running batch's timing)
    first = len(on[0].turns[0].prompt_ids)
    extra = off_stats.prefilled_tokens - on_stats.prefilled_tokens - on_stats.reused_tokens
    assert extra % first == 0 and abs(extra) <= 2 * first, (extra, first)
    assert len({ep.sequences[0].tokens for ep in on}) == 3  # three conversations, three slots


def test_guess_number_runs_out_of_turns_with_a_random_model(tiny):
    model, tokenizer = tiny
    (ep,) = run_workflow(guess_number_workflow, [{"secret": 37}], _backend(model, tokenizer), tokenizer,
                         limits=Limits(max_turns=3), sampling=SamplingParams(temperature=0.0, max_new_tokens=4))
    assert (ep.end, ep.reward, len(ep.turns)) == ("max_turns", 0.0, 3)
    assert len(ep.turn_rewards) == 3 and all(0.0 <= r < 1.0 for r in ep.turn_rewards)
    # user, then (assistant, feedback) per turn but the last, then the last assistant turn
    assert [m["role"] for m in ep.messages] == ["user"] + ["assistant", "user"] * 2 + ["assistant"]
    assert all(m["content"] in ("Higher.", "Lower.", "Answer with one integer.") for m in ep.messages[2:-1:2])


def test_calculator_workflow_ends_within_the_context_limit(tiny):
    """A random model never calls the tool well: the first turn is its answer (reward 0), or a malformed
    call's error goes back to it; a context limit just above the first prompt ends the episode there."""
    model, tokenizer = tiny
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8)
    task = {"prompt": "12+7=", "answer": "19"}
    (ep,) = run_workflow(calculator_workflow, [task], _backend(model, tokenizer), tokenizer, sampling=sampling)
    assert ep.end == "finished" and ep.reward == 0.0 and len(ep.turns) == 1
    first = len(ep.turns[0].prompt_ids)
    (short,) = run_workflow(calculator_workflow, [task], _backend(model, tokenizer), tokenizer, sampling=sampling,
                            limits=Limits(context_tokens=first + 3))
    assert short.end == "finished" and len(short.turns[0].output_ids) == 3  # the turn got the 3 tokens left
    assert len(short.sequences[0].tokens) == first + 3
    (none,) = run_workflow(calculator_workflow, [task], _backend(model, tokenizer), tokenizer, sampling=sampling,
                           limits=Limits(context_tokens=first))
    assert (none.end, none.reward, none.turns) == ("context_limit", 0.0, ())


def test_concurrent_episodes_equal_sequential_ones_at_greedy(tiny):
    model, tokenizer = tiny
    tasks = [{"secret": s} for s in (3, 50, 97)]
    kw = dict(limits=Limits(max_turns=3), sampling=SamplingParams(temperature=0.0, max_new_tokens=5))
    backend = _backend(model, tokenizer)
    together = run_workflow(guess_number_workflow, tasks, backend, tokenizer, **kw)
    assert backend.calls == 1  # one open engine: every turn of every episode joined its running batch
    alone = [run_workflow(guess_number_workflow, [t], _backend(model, tokenizer), tokenizer, **kw)[0] for t in tasks]
    for a, b in zip(together, alone):
        assert a.messages == b.messages and a.sequences[0].tokens == b.sequences[0].tokens
        assert max(abs(x - y) for x, y in zip(a.sequences[0].logprobs, b.sequences[0].logprobs)) < 1e-5


def test_demo_lines(tiny):
    """What `python -m trinity.workflows.demo` prints (docs/workflows.md), on this module's model."""
    from trinity.workflows.demo import calculator_lines, guess_number_lines

    model, tokenizer = tiny
    assert guess_number_lines(tokenizer) == [
        "guess_number: finished, reward 0.75, turn rewards [0.51, 0.51, 1.0]",
        "  conversation after the task: ['50', 'Lower.', '25', 'Higher.', '37']",
        "  one sequence of 271 tokens, 9 of them trained"]
    lines = calculator_lines(model, tokenizer)
    assert lines[0] == "calculator: 4 episodes, their turns in 1 running batch"  # one open engine
    assert all(" finished, reward 0.0, 1 turns, sequences of [" in line for line in lines[1:]), lines
