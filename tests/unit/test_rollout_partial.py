"""Partial rollouts (trinity.rollout.partial) on the tiny CPU model: an answer carried over and continued
in a later call is token for token (and log-prob for log-prob) what one uninterrupted decode gives with
the same weights and seed; a call returns exactly `need` whole groups; carried state round-trips."""

from __future__ import annotations

import itertools

import pytest
import torch

from trinity.rollout.continuous import KVBudget
from trinity.rollout.partial import PartialGroup, fresh_group, generate_partial, groups_rollout
from trinity.rollout.types import SamplingParams

PROMPTS = [[5, 9, 17, 3, 44, 2, 8, 11], [7, 1], [100, 12, 8, 60], [33, 34, 35], [70, 71], [9, 8, 7, 6, 5]]
N, NEW = 2, 10


@pytest.fixture(scope="module")
def model(tiny_qwen2_cpu):
    chunk, facts, _ = tiny_qwen2_cpu
    return chunk, facts


def _stream():
    counter = itertools.count()

    def fresh() -> PartialGroup:
        uid = next(counter)
        return fresh_group(uid, uid % len(PROMPTS), PROMPTS[uid % len(PROMPTS)], N)

    return fresh


def _call(model, carried, fresh, *, need, inflight, version, lengths=None, slots=256):
    gpt, facts = model
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW)
    return generate_partial(gpt, carried, fresh, params, n=N, need=need, inflight=inflight, version=version,
                            longest_prompt=8, vocab_size=facts.vocab_size, pad_id=0,
                            budget=KVBudget(max_num_seqs=slots), generator=torch.Generator().manual_seed(version), seed=7,
                            response_length=lengths)


def _lengths(sample: int) -> int:
    """A fixed end per sample (the tiny model rarely samples EOS): 2 ... 10 tokens."""
    return 2 + (sample * 7) % 9


def test_carried_answers_equal_one_uninterrupted_decode(model):
    """Two calls of `need` 2 (the first carries unfinished answers into the second) against one call that
    decodes the same groups to their end: every group's answers are the same tokens and log-probs."""
    first = _call(model, [], _stream(), need=2, inflight=4, version=0, lengths=_lengths)
    carried_unfinished = [g for g in first.carry if not g.complete and any(a.tokens for a in g.answers)]
    assert carried_unfinished, "the first call should stop with answers half-decoded"
    assert len(first.trained) == 2 and all(g.complete for g in first.trained)
    fresh = _stream()
    for _ in range(max(g.uid for g in first.trained + first.carry) + 1):
        fresh()  # the second call's new prompts continue the stream
    second = _call(model, first.carry, fresh, need=len(first.carry), inflight=len(first.carry), version=1,
                   lengths=_lengths)
    pieced = {g.uid: g for g in first.trained + second.trained}
    # one call decodes every group to its end (need: all of them; slots: a few, so it runs in waves)
    whole = _call(model, [], _stream(), need=len(pieced), inflight=len(pieced), version=0, lengths=_lengths, slots=5)
    ref = {g.uid: g for g in whole.trained}
    assert set(ref) >= set(pieced)
    for uid, g in pieced.items():
        for a, b in zip(g.answers, ref[uid].answers):
            assert a.tokens == b.tokens
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    # the carried answers' tokens hold both versions
    assert any(set(a.versions) == {0, 1} for uid in (g.uid for g in carried_unfinished) for a in pieced[uid].answers)


def test_a_call_returns_need_whole_groups_and_carries_the_rest(model):
    out = _call(model, [], _stream(), need=3, inflight=5, version=0, lengths=_lengths)
    assert len(out.trained) == 3 and all(g.complete and len(g.answers) == N for g in out.trained)
    uids = [g.uid for g in out.trained + out.carry]
    assert len(uids) == len(set(uids)) and sorted(uids) == list(range(len(uids)))  # no group lost or split
    assert [g.uid for g in out.carry] == sorted(g.uid for g in out.carry)
    ro, versions = groups_rollout(out.trained, 0, torch.device("cpu"))
    assert ro.tokens.shape[0] == 3 * N
    lengths = ro.response_mask.sum(1).tolist()
    assert lengths == [len(a.tokens) for g in out.trained for a in g.answers]
    assert int((versions >= 0).sum()) == sum(lengths)
    for g in out.carry:
        assert PartialGroup.from_state(g.state()) == g


def _call_s(model, carried, fresh, *, need, version):
    gpt, facts = model
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW)
    return generate_partial(gpt, carried, fresh, params, n=N, need=need, inflight=4 * need, version=version,
                            max_staleness=1, longest_prompt=8, vocab_size=facts.vocab_size, pad_id=0,
                            budget=KVBudget(max_num_seqs=256), seed=7, response_length=_lengths)


def test_with_max_staleness_no_group_outlives_it(model):
    """With max_staleness 1 a call starts at most 2 x need groups (carried ones included) and waits for the
    carried ones (due): over several calls every trained token is at most one version old, no group is
    left to grow older, and the carried state never exceeds one step's batch."""
    fresh, carry, need, running = _stream(), [], 2, 0
    for version in range(4):
        out = _call_s(model, carry, fresh, need=need, version=version)
        assert len(out.trained) == need and all(g.complete for g in out.trained)
        assert all(version - v <= 1 for g in out.trained for a in g.answers for v in a.versions)
        assert len(out.carry) <= need  # started and untrained: at most (1 + 1) x need before the batch left
        assert all(g.oldest is None or g.oldest == version for g in out.carry)  # every older one was trained
        running += sum(1 for g in out.carry for a in g.answers if a.tokens and not a.ended)
        carry = out.carry
    assert running  # answers were carried half-done


def test_new_prompts_join_in_waves_not_one_prefill_per_group(model):
    """With room for many groups in flight, a group that completes must not start the next one alone: each
    admission is a prefill forward as long as a decode step over the batch. With answers of 2 to 60 tokens
    the 32 groups in flight complete at different steps; the new ones start a wave (an eighth of the
    groups in flight) at a time, so the call's prefill forwards are about one per wave."""
    from trinity.rollout.types import RolloutStats

    gpt, facts = model
    stats = RolloutStats()
    params = SamplingParams(temperature=1.0, max_new_tokens=64)
    out = generate_partial(gpt, [], _stream(), params, n=N, need=32, inflight=32, version=0, longest_prompt=8,
                           vocab_size=facts.vocab_size, pad_id=0, budget=KVBudget(max_num_seqs=512), seed=7,
                           response_length=lambda sample: 2 + (sample * 37) % 59, stats=stats)
    assert len(out.trained) == 32
    later = len(out.trained) + len(out.carry) - 32  # groups started after the first 32
    assert later > 16  # the call kept starting prompts while the first ones decoded
    # one forward per group that started later would be about `later`; waves of 4 groups: later / 4 + 1
    assert stats.prefill_calls <= later // 4 + 2, (stats.prefill_calls, later)
    assert stats.graph_captures == 0 and stats.attention  # the end's stats are booked (no graphs on CPU)
