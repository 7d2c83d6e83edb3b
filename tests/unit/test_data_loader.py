"""Sampler and SFTData: deterministic order, exact resumption, disjoint covering DP shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from trinity.data.loader import RowSampler, build_sft_data
from trinity.errors import UserError
from trinity.testing.tiny_assets import make_tiny_tokenizer, write_sft_dataset


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    tok = AutoTokenizer.from_pretrained(str(make_tiny_tokenizer(root / "tok")))
    return tok, write_sft_dataset(root / "sft.jsonl", 300, seed=5)


def global_steps(sampler: RowSampler, n: int) -> list[list[int]]:
    return [sampler.next_global_indices().tolist() for _ in range(n)]


def test_epochs_visit_distinct_rows_in_a_seeded_order():
    s = RowSampler(10, global_batch_size=4, micro_batch_size=1, seed=7)
    steps = global_steps(s, 4)  # 2 steps per epoch; the 2 leftover rows of each epoch are skipped
    e0, e1 = steps[0] + steps[1], steps[2] + steps[3]
    assert len(set(e0)) == 8 and len(set(e1)) == 8 and e0 != e1
    assert steps == global_steps(RowSampler(10, global_batch_size=4, micro_batch_size=1, seed=7), 4)
    assert steps != global_steps(RowSampler(10, global_batch_size=4, micro_batch_size=1, seed=8), 4)
    plain = RowSampler(10, global_batch_size=4, micro_batch_size=1, shuffle=False)
    assert global_steps(plain, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5])
def test_resume_at_step_k_reproduces_the_rest(k):
    full = global_steps(RowSampler(11, global_batch_size=4, micro_batch_size=2, seed=3), 8)
    first = RowSampler(11, global_batch_size=4, micro_batch_size=2, seed=3)
    assert global_steps(first, k) == full[:k]
    resumed = RowSampler(11, global_batch_size=4, micro_batch_size=2, seed=3)
    resumed.load_state_dict(first.state_dict())
    assert global_steps(resumed, 8 - k) == full[k:]


@pytest.mark.parametrize("dp_size, micro", [(2, 1), (2, 2), (4, 1)])
def test_dp_shards_are_disjoint_and_cover_each_step(dp_size, micro):
    ranks = [RowSampler(50, global_batch_size=8, micro_batch_size=micro, dp_rank=r, dp_size=dp_size, seed=1) for r in range(dp_size)]
    reference = RowSampler(50, global_batch_size=8, micro_batch_size=8, seed=1)
    for _ in range(13):  # crosses two epoch boundaries (6 steps per epoch)
        expected = reference.next_global_indices()
        shards = []
        for s in ranks:
            micros = s.rank_micro_batches(s.next_global_indices())
            assert [len(m) for m in micros] == [micro] * (8 // dp_size // micro)
            shards.append(np.concatenate(micros))
        together = np.concatenate(shards)
        assert len(set(together.tolist())) == 8 and sorted(together) == sorted(expected)


def test_sampler_errors_name_the_setting():
    with pytest.raises(UserError, match=r"trainer.global_batch_size \(6\) must be a multiple of micro_batch_size \(2\) x data-parallel size \(2\)"):
        RowSampler(100, global_batch_size=6, micro_batch_size=2, dp_size=2)
    with pytest.raises(UserError, match=r"makes 3 rows, fewer than trainer.global_batch_size \(4\)"):
        RowSampler(3, global_batch_size=4, micro_batch_size=1)
    s = RowSampler(20, global_batch_size=4, micro_batch_size=1, seed=1)
    with pytest.raises(UserError, match="cannot resume the data order"):
        RowSampler(21, global_batch_size=4, micro_batch_size=1, seed=1).load_state_dict(s.state_dict())


@pytest.mark.parametrize("packing", [True, False])
def test_sft_data_batches_and_exact_resume(assets, packing):
    tok, path = assets
    kwargs = dict(seq_len=64, packing=packing, global_batch_size=4, micro_batch_size=1, seed=11)
    data = [build_sft_data([path], tok, dp_rank=r, dp_size=2, **kwargs) for r in range(2)]
    assert data[0].num_rows == data[1].num_rows and data[0].tokens_per_step == 4 * 64
    if packing:
        assert data[0].num_rows <= 300 / 2  # ~29-token samples, two per 64-token row
    else:
        assert data[0].num_rows == 300
    steps = data[0].steps_per_epoch + 2
    per_rank = [[d.next_global_batch() for _ in range(steps)] for d in data]
    for step in range(steps):
        micros = per_rank[0][step] + per_rank[1][step]
        assert len(micros) == 4
        mb = micros[0]
        assert set(mb) == {"tokens", "labels", "loss_mask", "position_ids", "doc_ids"}
        assert mb["tokens"].shape == (1, 64) and mb["tokens"].dtype == torch.int64
        assert mb["loss_mask"].dtype == torch.float32
    # rank 0 resumed after 3 steps sees exactly the batches of the uninterrupted run
    fresh = build_sft_data([path], tok, dp_rank=0, dp_size=2, **kwargs)
    for _ in range(3):
        fresh.next_global_batch()
    resumed = build_sft_data([path], tok, dp_rank=0, dp_size=2, **kwargs)
    resumed.load_state_dict(fresh.state_dict())
    for step in range(3, steps):
        for a, b in zip(resumed.next_global_batch(), per_rank[0][step]):
            assert all(torch.equal(a[k], b[k]) for k in a)


def test_last_step_loss_tokens_counts_all_ranks(assets):
    tok, path = assets
    data = [build_sft_data([path], tok, seq_len=64, packing=True, global_batch_size=4, micro_batch_size=2, seed=0, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(3):
        batches = [d.next_global_batch() for d in data]
        total = sum(float(m["loss_mask"].sum()) for b in batches for m in b)
        assert data[0].last_step_loss_tokens == data[1].last_step_loss_tokens == total > 0


def test_resume_with_another_dp_size_continues_the_same_global_order():
    single = RowSampler(30, global_batch_size=6, micro_batch_size=6, seed=2)
    full = global_steps(RowSampler(30, global_batch_size=6, micro_batch_size=6, seed=2), 9)
    global_steps(single, 4)
    ranks = [RowSampler(30, global_batch_size=6, micro_batch_size=1, dp_rank=r, dp_size=3, seed=2) for r in range(3)]
    for s in ranks:
        s.load_state_dict(single.state_dict())
    for step in range(4, 9):
        got = [np.concatenate(s.rank_micro_batches(s.next_global_indices())).tolist() for s in ranks]
        assert sum(got, []) == full[step]
