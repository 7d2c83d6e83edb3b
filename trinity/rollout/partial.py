"""Partial rollouts: a rollout that stops once enough prompt groups are complete, and hands back the
unfinished answers to be continued in the next one (Kimi k1.5's partial rollouts, APRIL, slime's
`--partial-rollout`).

Why: a step's rollout otherwise waits for its longest answer; its last hundreds of decode steps run a few
live rows each and cost as much as a full batch step (reading the weights). Here one `generate_partial`
call:
- starts with the carried-over groups (answers in progress, or complete and waiting to be trained) and
  fills the free slots with new prompts from `fresh()` in data order, while fewer than `inflight` groups
  are unfinished and, with `max_staleness` s, fewer than (s + 1) x need groups are started and not
  trained (over-provisioning: a group started now is trained within s steps, the oldest first);
- stops once `need` groups have all their n answers complete (a group is trained whole, in the step it
  completes: GRPO, RLOO and DAPO need its n answers) and the due groups (carried ones that could not be
  carried once more within `max_staleness`) are complete too;
- returns `need` complete groups (`PartialOutcome.trained`: the oldest first, then in the order they
  completed) and every other
  group as carry-over state (`PartialOutcome.carry`): prompt, tokens so far, the behaviour log-prob and
  the policy version of each token.
A carried answer is prefilled again in the next call (its prompt + its tokens so far) under the weights
of then, and decodes on from there. Its draws are named by (sample, token index in the answer): sample
`uid * n + j` is the j-th answer of group `uid` (the caller numbers groups), so with unchanged weights
and the same seed an answer continued across calls is token for token the one an uninterrupted decode
gives (the fused sampler keys its draws so; on CPU the torch sampler draws each row from a generator
seeded by its key: `Sampler(keyed=True)`).

Every rank of a model-parallel group takes the same decisions: they follow from the scheduler's "which
rows ended" (derived from broadcast tokens) and the tokens themselves. The answers' ends are decided
from their tokens (an EOS, or the length limit), the rule the scheduler books them with.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch

from trinity.rollout.continuous import open_engine
from trinity.rollout.kernels import DecodeKernels
from trinity.rollout.kv_budget import KVBudget
from trinity.rollout.layout import assemble, left_pad
from trinity.rollout.slot_table import Group
from trinity.rollout.types import Rollout, RolloutStats, SamplingParams


@dataclass(frozen=True)
class Answer:
    """One answer so far: its tokens, each one's log-prob under the policy that sampled it (temperature
    1, `Rollout.logprobs`' definition) and that policy's version, and whether it has ended."""

    tokens: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    versions: tuple[int, ...] = ()
    ended: bool = False


@dataclass(frozen=True)
class PartialGroup:
    """A prompt's n answers. `uid`: the caller's number of the group (its answers are samples uid * n + j);
    `source`: the caller's name of the prompt (the data's prompt index)."""

    uid: int
    source: int
    prompt: tuple[int, ...]
    answers: tuple[Answer, ...]

    @property
    def complete(self) -> bool:
        return all(a.ended for a in self.answers)

    @property
    def oldest(self) -> int | None:
        """The version of the oldest policy that sampled one of its tokens (None: no tokens yet)."""
        versions = [min(a.versions) for a in self.answers if a.versions]
        return min(versions) if versions else None

    def restarted(self) -> "PartialGroup":
        """The group with its answers dropped (decoded again from the prompt)."""
        return replace(self, answers=tuple(Answer() for _ in self.answers))

    def state(self) -> dict[str, Any]:
        """Plain values (a checkpoint loads them with torch.load(weights_only=True))."""
        return {"uid": self.uid, "source": self.source, "prompt": list(self.prompt),
                "answers": [{"tokens": list(a.tokens), "logprobs": list(a.logprobs), "versions": list(a.versions),
                             "ended": a.ended} for a in self.answers]}

    @classmethod
    def from_state(cls, s: dict[str, Any]) -> "PartialGroup":
        return cls(int(s["uid"]), int(s["source"]), tuple(int(t) for t in s["prompt"]), tuple(
            Answer(tuple(int(t) for t in a["tokens"]), tuple(float(x) for x in a["logprobs"]),
                   tuple(int(v) for v in a["versions"]), bool(a["ended"])) for a in s["answers"]))


def fresh_group(uid: int, source: int, prompt: Sequence[int], n: int) -> PartialGroup:
    return PartialGroup(uid, source, tuple(prompt), tuple(Answer() for _ in range(n)))


@dataclass(frozen=True)
class PartialOutcome:
    """`trained`: `need` complete groups, the oldest first (by the version of their oldest token), then in
    the order they completed; `carry`: every other group, by uid (complete ones wait for the next call)."""

    trained: list[PartialGroup]
    carry: list[PartialGroup]


def answer_limit(params: SamplingParams, sample: int, response_length: Callable[[int], int] | None) -> int:
    """The most tokens sample `sample` may have: max_new_tokens, or fewer by the benchmarks' schedule."""
    n = params.max_new_tokens
    return n if response_length is None else max(1, min(n, int(response_length(sample))))


@torch.no_grad()
def generate_partial(
    model: Any,
    carried: Sequence[PartialGroup],
    fresh: Callable[[], PartialGroup],
    params: SamplingParams,
    *,
    n: int,
    need: int,
    inflight: int,
    version: int,
    max_staleness: int | None = None,
    longest_prompt: int,
    vocab_size: int,
    pad_id: int,
    budget: KVBudget = KVBudget(),
    generator: torch.Generator | None = None,
    seed: int | None = None,
    cuda_graphs: bool = True,
    kernels: DecodeKernels = DecodeKernels(),
    response_length: Callable[[int], int] | None = None,
    stats: RolloutStats | None = None,
) -> PartialOutcome:
    """One partial rollout (module doc). `n`: answers per group; `fresh()`: the next prompt's group (no answers yet) in data order;
    `need`: the complete groups to return; `inflight`: unfinished groups at most (new prompts are admitted
    while fewer are); `version`: the policy version of the tokens sampled now; `max_staleness`: a carried
    group whose oldest token is that many versions old is due: the call also waits for it to complete
    (carried once more it would be too old, and decoding it again from scratch would drop the long
    answers again and again); `longest_prompt`: bound of
    every fresh prompt's length; `seed`: names the draws with the samples' keys (the same seed at every
    call keeps carried answers' draws those of one uninterrupted decode; None: drawn from `generator`);
    `generator`: the torch sampler's where draws are not keyed (top-k / top-p on CUDA); `response_length(sample)` (benchmarks): that sample
    also ends after so many tokens."""
    stats = stats if stats is not None else RolloutStats()
    groups: list[PartialGroup] = list(carried)
    waiting: list[PartialGroup] = []  # taken from `fresh()` but found no output rows: carried over
    done_before = sorted((g for g in groups if g.complete), key=lambda g: version if g.oldest is None else g.oldest)

    def is_due(g: PartialGroup) -> bool:
        return max_staleness is not None and g.oldest is not None and version - g.oldest >= max_staleness

    if len(done_before) >= need and not any(is_due(g) for g in groups if not g.complete):
        return PartialOutcome(done_before[:need], sorted(done_before[need:] + [g for g in groups if not g.complete],
                                                         key=lambda g: g.uid))
    max_new = params.max_new_tokens
    open_groups = [g for g in groups if not g.complete]
    rows = (len(open_groups) + need + inflight) * n
    longest = max([longest_prompt] + [len(g.prompt) for g in open_groups])
    eos = set(params.eos_token_ids)
    # per output row: (index into `live`, answer index)
    row_of: list[tuple[int, int]] = []
    live: list[PartialGroup] = []  # the groups decoded in this call, in the order they were added
    remaining: list[int] = []  # per live group: its answers not yet reported ended

    with open_engine(model, params, rows=rows, longest_prompt=longest, vocab_size=vocab_size, pad_id=pad_id,
                     budget=budget, generator=generator, cuda_graphs=cuda_graphs, stats=stats, kernels=kernels,
                     shared_prompts=n > 1, keyed=True, seed=seed) as sched:
        table = sched.table

        def add(g: PartialGroup) -> bool:
            """Queue the group's unfinished answers (False: no output rows left for it)."""
            todo = [j for j, a in enumerate(g.answers) if not a.ended]
            if len(row_of) + len(todo) > rows:
                return False
            gi = len(live)
            live.append(g)
            remaining.append(len(todo))
            fresh_rows: list[int] = []
            adds: list[Group] = []
            starts: tuple[list[int], list[int], list[int]] = ([], [], [])
            for j in todo:
                a, r, sample = g.answers[j], len(row_of), g.uid * n + j
                row_of.append((gi, j))
                starts[0].append(r)
                starts[1].append(sample * max_new + len(a.tokens))
                starts[2].append(answer_limit(params, sample, response_length) - len(a.tokens))
                if a.tokens:  # prefilled again with its tokens so far, on its own
                    adds.append(Group(g.prompt + a.tokens, (r,)))
                else:
                    fresh_rows.append(r)
            if fresh_rows:  # a prompt's new answers share its prefill
                adds.insert(0, Group(g.prompt, tuple(fresh_rows)))
            sched.start_rows(*starts)
            sched.add(adds)
            return True

        def unfinished() -> int:
            return sum(1 for k in remaining if k > 0)

        def age_cap() -> int | None:
            """Groups that may still start under `max_staleness`: (max_staleness + 1) x need started and not
            trained at most, so that every started group is among the oldest `need` of a step within
            max_staleness steps (trained oldest first, none restarted); None without a cap."""
            if max_staleness is None:
                return None
            return (max_staleness + 1) * need - (len(done_before) + len(live) + len(waiting))

        def room() -> bool:
            """Another group may start: fewer than `inflight` unfinished, and room under the age cap."""
            cap = age_cap()
            return unfinished() < inflight and (cap is None or cap > 0)

        # new prompts join a wave at a time: a group admitted alone costs a prefill forward of its own
        # (as long as a decode step over the whole batch at 0.5B), and with room for one group at each
        # completion the rollout paid one such forward per group (the slot table's eighth, in groups)
        wave = max(1, min(inflight, table.slots // n) // 8)

        def openings() -> tuple[int, bool]:
            """Groups that could start now (within `inflight`, the free slots and the age cap), and whether
            the age cap bounds them (it does not grow within a call: no wave to wait for)."""
            by_room = min(inflight - unfinished(), (len(table.free) - table.n_waiting) // n)
            cap = age_cap()
            return (by_room, False) if cap is None else (min(by_room, cap), cap <= by_room)

        def top_up() -> None:
            """New prompts into the free slots while there is `room`, once a wave of them can start (or
            nothing is unfinished, or the staleness cap will allow no more)."""
            k, capped = openings()
            if unfinished() and k < wave and not capped:
                return
            while room() and (len(table.free) >= table.n_waiting + n or unfinished() == 0):
                g = waiting.pop(0) if waiting else fresh()
                if not add(g):
                    waiting.insert(0, g)
                    return

        for g in open_groups:
            add(g)
        top_up()
        completed: list[int] = []  # live groups in the order they completed
        due = [gi for gi, g in enumerate(live) if is_due(g)]
        while len(done_before) + len(completed) < need or any(remaining[gi] > 0 for gi in due):
            if sched.finished:  # nothing to decode and no output rows left for a new prompt
                break
            for r in sched.step():
                gi = row_of[r][0]
                remaining[gi] -= 1
                if remaining[gi] == 0:
                    completed.append(gi)
            top_up()
        sched.book_stats()
        used = len(row_of)
        out_len = sched.out_len[:used].cpu().tolist()
        stats.tokens = sum(out_len)
        stats.rows = used  # the rows decoded (`computed_tokens` counts each one's first token)
        width = max(out_len + [1])
        out_tokens = sched.out_tokens[:used, :width].cpu().tolist()
        out_logp = sched.pipe.from_last(sched.out_logp[:used, :width].contiguous()).cpu().tolist()

    # the live groups with this call's tokens appended
    answers = [list(g.answers) for g in live]
    for r, (gi, j) in enumerate(row_of):
        a, k = answers[gi][j], out_len[r]
        toks = a.tokens + tuple(out_tokens[r][:k])
        sample = live[gi].uid * n + j
        ended = len(toks) >= answer_limit(params, sample, response_length) or bool(toks and toks[-1] in eos)
        answers[gi][j] = Answer(toks, a.logprobs + tuple(out_logp[r][:k]), a.versions + (version,) * k, ended)
    now = [replace(g, answers=tuple(a)) for g, a in zip(live, answers)]
    # the oldest complete groups first (a complete group left waiting may outgrow max_staleness and be
    # decoded again), then in the order they completed
    trained = sorted(done_before + [now[gi] for gi in completed], key=lambda g: version if g.oldest is None else g.oldest)
    chosen = {id(g) for g in trained[:need]}
    rest = [g for g in done_before if id(g) not in chosen] + [g for g in now if id(g) not in chosen] + waiting
    return PartialOutcome(trained[:need], sorted(rest, key=lambda g: g.uid))


def groups_rollout(groups: Sequence[PartialGroup], pad_id: int, device: torch.device) -> tuple[Rollout, torch.Tensor]:
    """The `Rollout` of complete groups (a group's n answers consecutive, in group order; the log-probs are
    the behaviour policy's) and the policy version of every response token [B, R] (-1 on padding)."""
    answers = [a for g in groups for a in g.answers]
    prompts = [g.prompt for g in groups for _ in g.answers]
    width = max([len(a.tokens) for a in answers] + [1])
    tok = torch.full((len(answers), width), pad_id, dtype=torch.long)
    logp = torch.zeros((len(answers), width), dtype=torch.float32)
    ver = torch.full((len(answers), width), -1, dtype=torch.long)
    for i, a in enumerate(answers):
        k = len(a.tokens)
        if k:
            tok[i, :k] = torch.tensor(a.tokens, dtype=torch.long)
            logp[i, :k] = torch.tensor(a.logprobs, dtype=torch.float32)
            ver[i, :k] = torch.tensor(a.versions, dtype=torch.long)
    lengths = torch.tensor([len(a.tokens) for a in answers], dtype=torch.long)
    ptok, pmask = left_pad(prompts, pad_id, device)
    ro = assemble(ptok, pmask, tok.to(device), lengths.to(device), logp.to(device))
    return ro, ver.to(device)
