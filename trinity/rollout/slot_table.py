"""The continuous engine's host-side bookkeeping: which slot holds which row, which prompt groups wait,
when to admit them, which slots to compact, and which slot's copy of a prompt's keys each slot reads.

Nothing here touches a model or a device: `trinity.rollout.scheduler.ContinuousScheduler` asks a
`SlotTable` what to do and carries it out on the decoders. Every model-parallel rank keeps its own table
and feeds it the same events (the same admissions, the same "which rows ended" snapshots), so that all
ranks make the same decisions.

Rows are the rollout's output rows; a group is the rows of one prompt (its n samples), prefilled once per
admission. Slots are the KV-cache pool's rows, `free` kept sorted so that new rows take the lowest slots.

Parked slots (multi-turn workflows, `trinity.workflows.stream.SchedulerStream`): a row added with a park
key keeps its slot when it ends, its keys and values intact, under that key (the conversation); the next
turn of that conversation names the key (`Group.reuse`) and, if the slot is still parked, takes it and is
prefilled only past the tokens the slot already holds (`Placement.cached`). Parked slots are given back to
the free ones, the longest parked first, when an admission needs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

PREFILL_TOKENS = 16384  # padded prompt tokens per prefill forward (bounds its activations)


@dataclass(frozen=True)
class Group:
    """A prompt's waiting rows: prefilled together when admitted together."""

    prompt: tuple[int, ...]
    rows: tuple[int, ...]
    # per row, the key its slot is parked under when the row ends (empty: every slot is freed)
    park: tuple[int, ...] = ()
    # a one-row group: (key, cached): its prompt's first `cached` tokens are the keys and values of the
    # slot parked under `key`, if it still is at admission
    reuse: tuple[int, int] | None = None


@dataclass(frozen=True)
class Placement:
    """An admitted group (or the part of it that fit): its prompt and the (row, slot) pairs it takes;
    `cached`: the prompt's first tokens already in the slot (a parked slot taken again), prefilled past them."""

    prompt: tuple[int, ...]
    pairs: tuple[tuple[int, int], ...]
    cached: int = 0

    @property
    def computed(self) -> int:
        """The tokens its prefill forward computes."""
        return len(self.prompt) - self.cached


@dataclass(frozen=True)
class Move:
    """A compaction: the rows of slots `src` go to the free slots `dst` (same length, in order)."""

    src: tuple[int, ...]
    dst: tuple[int, ...]


def group_prompts(prompts: Sequence[Sequence[int]]) -> list[Group]:
    """The rows of identical prompts as one group each, in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for r, p in enumerate(prompts):
        groups.setdefault(tuple(p), []).append(r)
    return [Group(p, tuple(rows)) for p, rows in groups.items()]


def prefill_chunks(placements: Sequence[Placement], tokens: int = PREFILL_TOKENS) -> list[list[Placement]]:
    """The admitted prompts in prefill forwards of at most `tokens` padded tokens computed (shortest first;
    a prompt longer than `tokens` is a chunk of its own); prompts with cached tokens and without apart
    (two kinds of forward)."""
    chunks: list[list[Placement]] = []
    for kind in (False, True):
        chunks += _chunks([p for p in placements if bool(p.cached) == kind], tokens)
    return chunks


def _chunks(placements: Sequence[Placement], tokens: int) -> list[list[Placement]]:
    chunks: list[list[Placement]] = []
    chunk: list[Placement] = []
    for item in sorted(placements, key=lambda t: t.computed):
        width = max(item.computed, *(c.computed for c in chunk)) if chunk else item.computed
        if chunk and width * (len(chunk) + 1) > tokens:
            chunks.append(chunk)
            chunk = []
        chunk.append(item)
    if chunk:
        chunks.append(chunk)
    return chunks


@dataclass
class SlotTable:
    """The host's view of `slots` KV-cache slots (module doc). `it` arguments are the scheduler's
    iteration counter: a slot admitted (or moved) at iteration i ignores "ended" flags snapshotted at i or
    before, which describe the row that held the slot before it."""

    slots: int
    cache_len: int
    waiting: list[Group] = field(default_factory=list)
    n_waiting: int = 0
    free: list[int] = field(init=False)
    active: set[int] = field(default_factory=set)  # slots holding a row that has not been retired
    slot_row: list[int] = field(init=False)  # the row a slot holds (-1: free)
    slot_admit: list[int] = field(init=False)  # iteration of its admission
    slot_pos: list[int] = field(init=False)  # upper bound of its next position (the host's estimate for L)
    slot_grp: list[int] = field(init=False)  # its prompt: an id per prompt and prefill
    slot_plen: list[int] = field(init=False)  # its prompt's length
    slot_park: list[int | None] = field(init=False)  # the key it is parked under when its row ends
    parked: dict[int, int] = field(default_factory=dict)  # key -> parked slot, the longest parked first
    next_grp: int = 0
    leads: list[int] = field(init=False)  # the host's copy of the decoder's `lead`
    leads_stale: bool = False  # which slot holds what changed since `new_leads` last ran

    def __post_init__(self) -> None:
        self.free = list(range(self.slots))
        self.slot_row = [-1] * self.slots
        self.slot_admit = [0] * self.slots
        self.slot_pos = [0] * self.slots
        self.slot_grp = [-1] * self.slots
        self.slot_plen = [0] * self.slots
        self.slot_park = [None] * self.slots
        self.leads = list(range(self.slots))

    # ---- groups in and out ---------------------------------------------------------------------------
    def add(self, groups: Sequence[Group]) -> None:
        """Groups that wait for slots, admitted after those already waiting."""
        self.waiting += list(groups)
        self.n_waiting += sum(len(g.rows) for g in groups)

    @property
    def finished(self) -> bool:
        """No row waits and no slot holds one (parked slots hold none)."""
        return not self.n_waiting and not self.active

    def _hit(self, group: Group) -> bool:
        """The group takes a parked slot again."""
        return group.reuse is not None and group.reuse[0] in self.parked

    # ---- admission -----------------------------------------------------------------------------------
    def wants_admission(self) -> bool:
        """Rows wait and enough slots are free (or parked, to be freed): all of them, or the smaller of the
        rows waiting and the first group's size or an eighth of the pool (a prefill for a few rows would
        cost a forward each); or the first group takes its parked slot again."""
        if not self.n_waiting:
            return False
        if self._hit(self.waiting[0]):
            return True
        room = len(self.free) + len(self.parked)
        if not room:
            return False
        threshold = min(self.n_waiting, max(len(self.waiting[0].rows), self.slots // 8))
        return room >= threshold or not self.active

    def _unpark(self, k: int) -> None:
        """Free the k longest-parked slots (none for k <= 0)."""
        for key in list(self.parked)[:max(k, 0)]:
            self.free.append(self.parked.pop(key))
        self.free.sort()

    def release(self, key: int) -> None:
        """Free the slot parked under `key` (if it is)."""
        if key in self.parked:
            self.free.append(self.parked.pop(key))
            self.free.sort()

    def admit(self) -> list[Placement]:
        """Take waiting groups, in order, into the lowest free slots while they fit (freeing parked slots,
        the longest parked first, where the free ones are too few), or into their parked slot (`Group.reuse`);
        a first group larger than the free slots is split (its rest waits and is prefilled again later). The
        rows stay waiting until `placed`."""
        take: list[Placement] = []
        while self.waiting and (self.free or self.parked or self._hit(self.waiting[0])):
            group = self.waiting[0]
            if self._hit(group):
                assert group.reuse is not None and len(group.rows) == 1
                key, cached = group.reuse
                slot = self.parked.pop(key)
                self.waiting.pop(0)
                self.active.add(slot)
                self.slot_park[slot] = group.park[0] if group.park else None
                take.append(Placement(group.prompt, ((group.rows[0], slot),), cached))
                continue
            self._unpark(len(group.rows) - len(self.free))
            if len(group.rows) <= len(self.free):
                self.waiting.pop(0)
                part = group.rows
            elif not take:
                part = group.rows[: len(self.free)]
                self.waiting[0] = Group(group.prompt, group.rows[len(self.free):], group.park[len(self.free):])
            else:
                break
            dst = [self.free.pop(0) for _ in part]
            self.active.update(dst)
            for j, slot in enumerate(dst):  # `part` is the first rows of the group
                self.slot_park[slot] = group.park[j] if group.park else None
            take.append(Placement(group.prompt, tuple(zip(part, dst))))
        return take

    def placed(self, chunk: Sequence[Placement], it: int) -> None:
        """A prefill forward of `chunk` ran at iteration `it`: each of its prompts is a new group id."""
        for j, item in enumerate(chunk):
            for r, s in item.pairs:
                self.slot_row[s], self.slot_admit[s], self.slot_pos[s] = r, it, len(item.prompt)
                self.slot_grp[s], self.slot_plen[s] = self.next_grp + j, len(item.prompt)
                self.n_waiting -= 1
        self.next_grp += len(chunk)
        self.leads_stale = True

    # ---- retirement ----------------------------------------------------------------------------------
    def retire(self, it: int, ended: Sequence[bool]) -> list[int]:
        """Free the active slots whose "ended" flag is set in a snapshot taken after iteration `it`'s
        step, except those admitted at `it` or later (the flag is their slot's previous row's). Returns
        the rows that ended, by slot."""
        rows = []
        for s in sorted(self.active):
            if self.slot_admit[s] < it and ended[s]:
                rows.append(self.slot_row[s])
                self.slot_row[s] = -1
                self.active.discard(s)
                key, self.slot_park[s] = self.slot_park[s], None
                if key is None:
                    self.free.append(s)
                else:
                    self.release(key)  # a slot parked under the key before (not taken again): freed
                    self.parked[key] = s
                self.leads_stale = True
        self.free.sort()
        return rows

    # ---- compaction ----------------------------------------------------------------------------------
    def compaction(self, bucket: Callable[[int], int]) -> Move | None:
        """No rows wait: the live slots above the live count, moved into the lowest free slots, when that
        lowers the step's batch bucket (`bucket(rows)`); None when it would not."""
        if self.n_waiting:
            return None
        live = sorted(self.active)
        if not live or bucket(live[-1] + 1) <= bucket(len(live)):
            return None
        src = [s for s in live if s >= len(live)]
        dst = [s for s in self.free if s < len(live)][: len(src)]  # fewer where parked slots lie below
        src = src[len(src) - len(dst):]  # the highest first
        if not src:
            return None
        rest = set(live) - set(src) | set(dst)
        if bucket(max(rest) + 1) >= bucket(live[-1] + 1):  # parked slots keep the bucket: no move
            return None
        return Move(tuple(src), tuple(dst))

    def moved(self, move: Move, it: int) -> None:
        """`move` ran at iteration `it` (the moved rows ignore flags snapshotted before)."""
        for s, d in zip(move.src, move.dst):
            self.slot_row[d], self.slot_admit[d], self.slot_pos[d] = self.slot_row[s], it, self.slot_pos[s]
            self.slot_grp[d], self.slot_plen[d] = self.slot_grp[s], self.slot_plen[s]
            self.slot_park[d], self.slot_park[s] = self.slot_park[s], None
            self.slot_row[s] = -1
            self.active.discard(s)
            self.active.add(d)
        self.free[:] = sorted(set(self.free) - set(move.dst) | set(move.src))
        self.leads_stale = True

    # ---- shared prompt keys --------------------------------------------------------------------------
    def new_leads(self) -> list[int] | None:
        """Each active slot reads its prompt's keys from the lowest active slot of its prompt group (an
        active slot's cache is not reused before it retires); a free slot names itself. The new leads
        when they differ from the last ones, else None (rows end one at a time in the tail: most
        retirements change no lead)."""
        self.leads_stale = False
        first: dict[int, int] = {}
        new = list(range(self.slots))
        for s in sorted(self.active):
            new[s] = first.setdefault(self.slot_grp[s], s)
        if new == self.leads:
            return None
        self.leads = new
        return new

    # ---- a decode step -------------------------------------------------------------------------------
    def batch(self, bucket: Callable[[int], int]) -> int:
        """The step's batch bucket: the one that holds the highest active slot."""
        return bucket(max(self.active) + 1)

    def context(self, multiple: int) -> int:
        """The keys a step reads when it reads every row's up to one length (SDPA): the longest active
        context, rounded up to `multiple`, at most the cache length."""
        longest = max(self.slot_pos[s] for s in self.active)
        return min(self.cache_len, -(-(longest + 1) // multiple) * multiple)

    def advance(self, shared_prefix: bool) -> tuple[int, int]:
        """Every active slot moved one position on (a decode step ran). Returns the step's live KV
        tokens and those it read (a prompt's keys once per group with `shared_prefix`)."""
        live_ctx = shared_ctx = 0
        seen: set[int] = set()
        for s in sorted(self.active):
            self.slot_pos[s] = min(self.slot_pos[s] + 1, self.cache_len - 1)
            live_ctx += self.slot_pos[s]
            shared_ctx += self.slot_pos[s] - (self.slot_plen[s] if shared_prefix and self.slot_grp[s] in seen else 0)
            seen.add(self.slot_grp[s])
        return live_ctx, shared_ctx
