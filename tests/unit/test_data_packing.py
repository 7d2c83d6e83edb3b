"""Packing: documents stay whole, labels never cross documents, masks equal brute-force references."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from trinity.data.packing import first_fit_decreasing, pack, pad
from trinity.models.doc_masks import block_causal_mask, cu_seqlens
from trinity.data.sft import Sample

PAD = 0


def random_samples(n: int, max_len: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        length = rng.randint(2, max_len)
        prompt = rng.randint(1, length - 1)
        ids = [rng.randint(3, 99) for _ in range(length)]
        samples.append(Sample(ids, [0] * prompt + [1] * (length - prompt)))
    return samples


def test_first_fit_decreasing_known_case():
    # Sorted: 7(i1) 6(i3) 5(i0) 4(i4) 3(i2) 2(i5) into capacity 10:
    # 7 -> bin0; 6 -> bin1; 5 -> bin2; 4 -> bin1 (6+4); 3 -> bin0 (7+3); 2 -> bin2 (5+2).
    bins = first_fit_decreasing([5, 7, 3, 6, 4, 2], 10)
    assert bins == [[1, 2], [3, 4], [0, 5]]


def test_first_fit_decreasing_is_a_partition_within_capacity():
    rng = random.Random(0)
    lengths = [rng.randint(1, 64) for _ in range(500)]
    bins = first_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert len(bins) <= 1.25 * sum(lengths) / 64 + 2  # FFD is near-optimal on random sizes
    assert bins == first_fit_decreasing(lengths, 64)
    with pytest.raises(ValueError, match="exceed seq_len=64"):
        first_fit_decreasing([65], 64)


def unpack_documents(rows: dict, r: int) -> list[tuple[list[int], list[int], list[float]]]:
    """Brute force: walk a row token by token and cut documents at doc_id changes."""
    docs: dict[int, list[int]] = {}
    for t in range(rows["tokens"].shape[1]):
        d = int(rows["doc_ids"][r, t])
        if d >= 0:
            docs.setdefault(d, []).append(t)
    out = []
    for d in sorted(docs):
        pos = docs[d]
        assert pos == list(range(pos[0], pos[0] + len(pos))), "a document must be contiguous"
        out.append(([int(rows["tokens"][r, t]) for t in pos], [int(rows["labels"][r, t]) for t in pos], [float(rows["loss_mask"][r, t]) for t in pos]))
    return out


@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_rows_hold_whole_documents_with_in_document_labels(mode):
    samples = random_samples(60, 24, seed=1)
    packed = (pack if mode == "pack" else pad)(samples, 32, pad_id=PAD)
    rows = packed.all_rows()
    seen = []
    for r in range(packed.num_rows):
        for tokens, labels, loss in unpack_documents(rows, r):
            i = next(i for i, s in enumerate(samples) if s.input_ids == tokens and i not in seen)
            seen.append(i)
            mask = samples[i].loss_mask
            assert labels[:-1] == tokens[1:], "label = next token of the same document"
            assert loss[:-1] == [float(m) for m in mask[1:]], "loss where the next token is a response token"
            assert loss[-1] == 0.0 and labels[-1] == PAD, "the last token has no target in its document"
        pad_pos = rows["doc_ids"][r] < 0
        assert (rows["tokens"][r, pad_pos] == PAD).all() and (rows["loss_mask"][r, pad_pos] == 0).all()
        # positions restart at every document
        d = rows["doc_ids"][r]
        for t in range(packed.seq_len):
            if d[t] >= 0:
                expected = 0 if t == 0 or d[t - 1] != d[t] else rows["position_ids"][r, t - 1] + 1
                assert rows["position_ids"][r, t] == expected
    assert sorted(seen) == list(range(len(samples))), "every sample exactly once"
    if mode == "pad":
        assert packed.num_rows == len(samples) and (rows["doc_ids"].max(axis=1) == 0).all()
    else:
        assert packed.num_rows < len(samples) / 2
    assert rows["loss_mask"].sum() == sum(sum(s.loss_mask[1:]) for s in samples)
    assert packed.row_loss_tokens.tolist() == rows["loss_mask"].sum(axis=1).astype(int).tolist()
    assert packed.padding_fraction() == pytest.approx((rows["doc_ids"] < 0).mean())
    some = [2, 0, 2]
    assert all(np.array_equal(packed.rows(some)[k], rows[k][some]) for k in rows)


def reference_mask(doc_ids: np.ndarray) -> np.ndarray:
    b, s = doc_ids.shape
    masked = np.ones((b, 1, s, s), dtype=bool)
    for r in range(b):
        for q in range(s):
            for k in range(s):
                if doc_ids[r, q] < 0:
                    masked[r, 0, q, k] = k != q  # padding attends to itself only
                else:
                    masked[r, 0, q, k] = not (k <= q and doc_ids[r, k] == doc_ids[r, q])
    return masked


def test_block_causal_mask_equals_brute_force():
    doc_ids = pack(random_samples(12, 9, seed=2), 16, pad_id=PAD).all_rows()["doc_ids"]
    mask = block_causal_mask(torch.from_numpy(doc_ids))
    assert mask.dtype == torch.bool and mask.shape == (doc_ids.shape[0], 1, 16, 16)
    assert np.array_equal(mask.numpy(), reference_mask(doc_ids))


def test_cu_seqlens_equals_document_lengths():
    doc_ids = pack(random_samples(12, 9, seed=3), 16, pad_id=PAD).all_rows()["doc_ids"]
    cu, max_len = cu_seqlens(torch.from_numpy(doc_ids))
    lengths = []
    for r in range(doc_ids.shape[0]):
        ids = doc_ids[r].tolist()
        for d in sorted(set(ids), key=ids.index):
            lengths.append(ids.count(d))
    assert cu.dtype == torch.int32
    assert cu.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert cu[-1] == doc_ids.size and max_len == max(lengths)


def test_packed_attention_equals_separate_documents():
    """Attention over a packed row with the block mask gives each document's own attention."""
    torch.manual_seed(0)
    samples = random_samples(6, 10, seed=4)
    doc_ids = torch.from_numpy(pack(samples, 24, pad_id=PAD).all_rows()["doc_ids"])
    q, k, v = (torch.randn(doc_ids.shape[0], 2, 24, 8) for _ in range(3))
    packed = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~block_causal_mask(doc_ids))
    assert torch.isfinite(packed).all(), "padding rows must not produce NaN"
    for r in range(doc_ids.shape[0]):
        for d in doc_ids[r].unique().tolist():
            if d < 0:
                continue
            span = (doc_ids[r] == d).nonzero().flatten()
            sl = slice(int(span[0]), int(span[-1]) + 1)
            alone = torch.nn.functional.scaled_dot_product_attention(q[r : r + 1, :, sl], k[r : r + 1, :, sl], v[r : r + 1, :, sl], is_causal=True)
            torch.testing.assert_close(packed[r : r + 1, :, sl], alone, rtol=1e-5, atol=1e-6)
