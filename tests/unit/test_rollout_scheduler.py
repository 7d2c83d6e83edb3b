"""The continuous engine's host-side bookkeeping (trinity.rollout.slot_table.SlotTable), without a model:
admission (a group larger than the free slots is split), retirement (flags snapshotted before a slot's
admission do not apply), compaction plans, the shared-prompt leads and the prefill chunks."""

from __future__ import annotations

from trinity.rollout.buckets import Buckets
from trinity.rollout.slot_table import Group, Move, Placement, SlotTable, group_prompts, prefill_chunks


def _table(slots: int, groups: list[Group], cache_len: int = 64) -> SlotTable:
    table = SlotTable(slots, cache_len)
    table.add(groups)
    return table


def _admit(table: SlotTable, it: int) -> list[Placement]:
    take = table.admit()
    for chunk in prefill_chunks(take):
        table.placed(chunk, it)
    return take


def test_rows_of_one_prompt_form_one_group_in_order_of_first_appearance():
    groups = group_prompts([[1, 2], [3], [1, 2], [4, 5, 6], [3]])
    assert groups == [Group((1, 2), (0, 2)), Group((3,), (1, 4)), Group((4, 5, 6), (3,))]


def test_admission_takes_whole_groups_into_the_lowest_slots_and_splits_a_first_group_too_large():
    table = _table(5, [Group((1,), (0, 1, 2)), Group((2, 2), (3, 4, 5)), Group((3,), (6,))])
    assert table.n_waiting == 7 and table.wants_admission()  # every slot free
    take = _admit(table, it=0)
    # the second group does not fit the 2 slots left: it waits whole (only a first group is split)
    assert take == [Placement((1,), ((0, 0), (1, 1), (2, 2)))]
    assert table.free == [3, 4] and table.active == {0, 1, 2} and table.n_waiting == 4
    assert table.slot_row == [0, 1, 2, -1, -1] and table.slot_plen[:3] == [1, 1, 1]
    table.retire(1, [True, True, True, False, False])  # flags from a step after the admission
    assert table.free == [0, 1, 2, 3, 4]
    take = _admit(table, it=2)
    assert take == [Placement((2, 2), ((3, 0), (4, 1), (5, 2))), Placement((3,), ((6, 3),))]
    assert table.n_waiting == 0 and table.free == [4]
    # one prefill of both prompts (shortest first) gave each its own group id
    assert table.slot_grp[:4] == [2, 2, 2, 1]


def test_a_group_larger_than_the_free_slots_is_split_and_its_rest_waits():
    table = _table(3, [Group((9, 9), (0, 1, 2, 3, 4)), Group((8,), (5,))])
    take = _admit(table, it=0)
    assert take == [Placement((9, 9), ((0, 0), (1, 1), (2, 2)))]
    assert table.waiting == [Group((9, 9), (3, 4)), Group((8,), (5,))] and table.n_waiting == 3
    table.retire(1, [True, False, False])
    # one free slot of three: below the threshold (the first group's 2 rows), no admission yet
    assert table.free == [0] and not table.wants_admission()
    table.retire(2, [True, True, False])
    assert table.free == [0, 1] and table.wants_admission()
    take = _admit(table, it=3)
    # the rest of the split group is prefilled again (a new group id), the next group waits for a slot
    assert take == [Placement((9, 9), ((3, 0), (4, 1)))]
    assert table.slot_grp == [1, 1, 0] and table.waiting == [Group((8,), (5,))]


def test_admission_waits_for_an_eighth_of_the_pool_or_the_first_group():
    table = _table(64, [Group((1,), tuple(range(64)))])
    _admit(table, it=0)
    table.add([Group((2, r), (r,)) for r in range(64, 74)])  # 10 prompts of one row each
    table.retire(1, [s < 7 for s in range(64)])  # 7 free: below 64 // 8
    assert len(table.free) == 7 and not table.wants_admission()
    table.retire(2, [s < 8 for s in range(64)])
    assert len(table.free) == 8 and table.wants_admission()
    table = _table(64, [Group((1,), tuple(range(64)))])
    _admit(table, it=0)
    table.add([Group((2,), tuple(range(64, 84)))])  # one prompt of 20 rows: it waits for 20 slots
    table.retire(1, [s < 19 for s in range(64)])
    assert not table.wants_admission()
    table.retire(2, [s < 20 for s in range(64)])
    assert table.wants_admission()


def test_flags_snapshotted_before_a_slots_admission_do_not_retire_its_new_row():
    table = _table(2, [Group((1,), (0, 1)), Group((2,), (2,))])
    _admit(table, it=0)
    assert table.retire(3, [True, False]) == [0]  # row 0 ended in the step after iteration 3
    _admit(table, it=4)  # row 2 takes slot 0 at iteration 4
    assert table.slot_row == [2, 1]
    # a lagged snapshot of iteration 4's step (before row 2's first decode step) still says slot 0 ended:
    # it was row 0's flag, and row 2 stays
    assert table.retire(4, [True, False]) == [] and table.active == {0, 1}
    assert table.retire(5, [True, True]) == [2, 1]  # by slot
    assert table.finished


def test_compaction_moves_the_live_rows_above_the_live_count_into_the_lowest_free_slots():
    buckets = Buckets.plain(8)  # 1, 2, 4, 8
    table = _table(8, [Group((1,), tuple(range(8)))])
    _admit(table, it=0)
    table.retire(1, [True, False, True, True, True, False, True, False])
    assert sorted(table.active) == [1, 5, 7]
    move = table.compaction(buckets)  # 3 live rows: bucket 4 instead of 8
    assert move == Move((5, 7), (0, 2))
    table.moved(move, it=2)
    assert sorted(table.active) == [0, 1, 2] and table.free == [3, 4, 5, 6, 7]
    assert table.slot_row[:3] == [5, 1, 7] and table.slot_admit[0] == table.slot_admit[2] == 2
    # flags of the slots' former rows (snapshotted at 1) do not retire the moved ones
    assert table.retire(1, [True, False] + [True] * 6) == []
    assert table.compaction(buckets) is None  # already in the smallest bucket for 3 rows
    table.retire(3, [False, True, False] + [False] * 5)
    assert table.compaction(buckets) == Move((2,), (1,))  # 2 rows in bucket 4 -> bucket 2


def test_no_compaction_while_rows_wait_or_when_the_bucket_would_not_shrink():
    buckets = Buckets((2, 4, 8))
    table = _table(8, [Group((1,), tuple(range(8))), Group((2,), (8,))])
    _admit(table, it=0)
    table.retire(1, [True] * 7 + [False])
    assert table.n_waiting and table.compaction(buckets) is None
    table = _table(8, [Group((1,), tuple(range(8)))])
    _admit(table, it=0)
    table.retire(1, [False, False, True, False, True, True, True, True])
    assert table.compaction(buckets) is None  # slots 0, 1 and 3 live: bucket 4 either way
    table = _table(8, [Group((1,), tuple(range(8)))])
    _admit(table, it=0)
    table.retire(1, [True, True, True, False, True, True, True, True])
    assert table.compaction(buckets) == Move((3,), (0,))


def test_each_slot_reads_its_prompt_from_the_lowest_active_slot_of_its_group():
    table = _table(6, [Group((1,), (0, 1, 2)), Group((2, 2), (3, 4)), Group((3, 3, 3), (5,))])
    _admit(table, it=0)
    assert table.slot_grp == [0, 0, 0, 1, 1, 2]
    assert table.new_leads() == [0, 0, 0, 3, 3, 5] and not table.leads_stale
    assert table.new_leads() is None  # unchanged: nothing to copy to the device
    table.retire(1, [True, False, False, False, True, False])
    assert table.leads_stale
    # the group's lowest slot retired: its other rows read slot 1's copy; a free slot names itself
    assert table.new_leads() == [0, 1, 1, 3, 4, 5]
    table.retire(2, [False, False, False, False, False, True])
    assert table.new_leads() is None  # slot 5 was its group's only row: no lead changes


def test_advance_counts_a_shared_prompt_once():
    table = _table(4, [Group((1, 2, 3), (0, 1, 2)), Group((4,), (3,))], cache_len=64)
    _admit(table, it=0)
    live, read = table.advance(shared_prefix=True)
    assert table.slot_pos == [4, 4, 4, 2]
    assert live == 4 + 4 + 4 + 2 and read == live - 2 * 3  # two of the group's three rows read no prompt
    assert table.advance(shared_prefix=False)[1] == 5 + 5 + 5 + 3
    assert table.batch(Buckets.plain(4)) == 4 and table.context(256) == 64  # capped at the cache length


def test_prefill_chunks_bound_the_padded_tokens():
    items = [Placement(tuple(range(n)), ((n, n),)) for n in (5, 3, 9, 4)]
    chunks = prefill_chunks(items, tokens=16)
    # shortest first; a chunk's padded tokens (its width x its prompts) at most 16
    assert [[len(p.prompt) for p in c] for c in chunks] == [[3, 4, 5], [9]]
    assert prefill_chunks(items, tokens=4) == [[p] for p in sorted(items, key=lambda p: len(p.prompt))]


def test_a_parked_slot_is_taken_again_by_its_next_turn_and_freed_the_longest_parked_first():
    # rows 0-2, one conversation each (park keys 10, 11, 12); 4 slots
    table = _table(4, [Group((1, 2), (0, 1, 2), (10, 11, 12))])
    _admit(table, it=0)
    assert table.retire(1, [True, False, True, False]) == [0, 2]
    # ended rows keep their slots, parked under their keys, the oldest parked first; nothing is free
    assert table.parked == {10: 0, 12: 2} and table.free == [3] and table.active == {1}
    assert not table.finished
    # the next turn of conversation 10 (its first 3 tokens cached) takes slot 0 back at once
    table.add([Group((1, 2, 7, 8), (3,), (13,), (10, 3))])
    assert table.wants_admission()
    take = _admit(table, it=2)
    assert take == [Placement((1, 2, 7, 8), ((3, 0),), cached=3)] and take[0].computed == 1
    assert table.parked == {12: 2} and table.active == {0, 1} and table.slot_pos[0] == 4
    # a reuse whose slot was freed meanwhile is prefilled whole into a free slot
    table.release(12)
    assert table.free == [2, 3]
    table.add([Group((1, 2, 5), (4,), (14,), (12, 2))])
    assert _admit(table, it=3) == [Placement((1, 2, 5), ((4, 2),))]
    # new rows need more slots than are free: the longest-parked slots are freed for them
    table.retire(4, [True, True, True, False])  # rows 3, 1, 4 end: parked under 13, 11, 14
    assert list(table.parked) == [13, 11, 14] and table.free == [3]
    table.add([Group((6,), (5, 6, 7))])
    assert table.wants_admission()
    assert _admit(table, it=5) == [Placement((6,), ((5, 0), (6, 1), (7, 3)))]
    assert table.parked == {14: 2} and table.free == []
    # no live row: finished, parked slots or not
    table.retire(6, [True, True, False, True])
    assert table.finished and table.parked == {14: 2} and table.free == [0, 1, 3]


def test_prefill_chunks_keep_prompts_with_cached_tokens_apart_and_count_the_computed_ones():
    cached = [Placement(tuple(range(100)), ((0, 0),), cached=98), Placement(tuple(range(50)), ((1, 1),), cached=10)]
    whole = [Placement((1, 2, 3), ((2, 2),)), Placement((4,), ((3, 3),))]
    chunks = prefill_chunks(cached + whole, tokens=80)
    # whole prompts first, then the cached ones by tokens computed (2 and 40: 2 x 40 <= 80, one forward)
    assert chunks == [[whole[1], whole[0]], [cached[0], cached[1]]]


def test_compaction_leaves_parked_slots_and_moves_only_where_the_bucket_shrinks():
    buckets = Buckets.plain(8)
    table = _table(8, [Group((1,), tuple(range(8)), tuple(range(100, 108)))])
    _admit(table, it=0)
    table.retire(1, [True, True, False, True, True, True, True, False])  # rows 2 and 7 live
    assert sorted(table.active) == [2, 7] and table.free == []
    table.release(100)  # slot 0 free, the others parked
    assert table.compaction(buckets) == Move((7,), (0,))  # bucket 8 -> 4 (slots 0 and 2)
    table = _table(8, [Group((1,), tuple(range(8)), tuple(range(100, 108)))])
    _admit(table, it=0)
    table.retire(1, [True, True, True, False, True, True, True, False])  # rows 3 and 7 live
    table.release(104)  # slot 4 free: moving 7 there leaves bucket 8
    assert table.compaction(buckets) is None
