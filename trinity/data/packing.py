"""Samples -> fixed-length training rows, packed (several documents per row) or padded (one per row).

Row fields (numpy arrays of shape [rows, seq_len] from `PackedRows.rows`; torch where batches are made):
- `tokens`: input ids; padding is `pad_id`.
- `labels`: the next token of the same document (megatron's convention: labels are already shifted).
  The last token of each document has no next token in its document, so its label is `pad_id` with
  loss_mask 0: a label never crosses a document boundary.
- `loss_mask`: float32, 1 where `labels` is a trained (response) token.
- `position_ids`: 0, 1, ... restarting at each document.
- `doc_ids`: index of the token's document within its row (0, 1, ...); -1 for padding.

Attention for a row is block-diagonal causal over `doc_ids` (trinity.models.doc_masks builds the
masks and varlen boundaries from them). A sample is never split across rows: samples must be at most
`seq_len` tokens (tokenize_sft truncates or drops longer ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trinity.data.sft import Sample

ROW_FIELDS = ("tokens", "labels", "loss_mask", "position_ids", "doc_ids")


@dataclass(frozen=True)
class PackedRows:
    """Training rows, kept compact: each rank holds the whole data set, so rows are built on demand.

    Documents are stored back to back (`doc_tokens` int32, `doc_loss` uint8, document d at
    `doc_starts[d]:doc_starts[d + 1]`); row r holds documents `row_docs[row_starts[r]:row_starts[r + 1]]`
    in that order. That is ~5 bytes per token instead of 33 for the five materialised int64 fields.
    """

    seq_len: int
    pad_id: int
    doc_tokens: np.ndarray
    doc_loss: np.ndarray
    doc_starts: np.ndarray
    row_docs: np.ndarray
    row_starts: np.ndarray
    row_loss_tokens: np.ndarray  # trained labels per row, for loss normalisation without building rows

    @property
    def num_rows(self) -> int:
        return len(self.row_starts) - 1

    def padding_fraction(self) -> float:
        return 1.0 - len(self.doc_tokens) / max(self.num_rows * self.seq_len, 1)

    def rows(self, index: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """The fields of the rows at `index` (see module doc), as arrays of shape [len(index), seq_len]."""
        index = np.asarray(index, dtype=np.int64)
        n, s = len(index), self.seq_len
        tokens = np.full((n, s), self.pad_id, dtype=np.int64)
        labels = np.full((n, s), self.pad_id, dtype=np.int64)
        loss_mask = np.zeros((n, s), dtype=np.float32)
        position_ids = np.zeros((n, s), dtype=np.int64)
        doc_ids = np.full((n, s), -1, dtype=np.int64)
        for out, r in enumerate(index):
            offset = 0
            for doc, d in enumerate(self.row_docs[self.row_starts[r] : self.row_starts[r + 1]]):
                ids = self.doc_tokens[self.doc_starts[d] : self.doc_starts[d + 1]]
                end = offset + len(ids)
                tokens[out, offset:end] = ids
                labels[out, offset : end - 1] = ids[1:]
                loss_mask[out, offset : end - 1] = self.doc_loss[self.doc_starts[d] + 1 : self.doc_starts[d + 1]]
                position_ids[out, offset:end] = np.arange(len(ids))
                doc_ids[out, offset:end] = doc
                offset = end
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids, "doc_ids": doc_ids}

    def all_rows(self) -> dict[str, np.ndarray]:
        """Every row materialised (for inspection and tests; training uses `rows`)."""
        return self.rows(np.arange(self.num_rows))


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices: items by decreasing length (ties by index) into the first bin with room.

    A max-segment tree over the bins' free space finds the first fitting bin in O(log n), so 100k
    samples pack in about a second. Items keep their original order inside a bin.
    """
    n = len(lengths)
    too_long = [i for i in range(n) if lengths[i] > capacity]
    if too_long:
        raise ValueError(f"{len(too_long)} samples exceed seq_len={capacity}, e.g. sample {too_long[0]}")
    size = 1
    while size < max(n, 1):
        size *= 2
    free = [capacity] * (2 * size)  # tree node = max free space of the bins below it
    bins: list[list[int]] = []
    for item in sorted(range(n), key=lambda i: (-lengths[i], i)):
        need, node = lengths[item], 1
        while node < size:  # descend to the leftmost bin with free space >= need
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        b = node - size
        if b == len(bins):
            bins.append([])
        bins[b].append(item)
        free[node] -= need
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return [sorted(b) for b in bins]


def _rows(samples: Sequence[Sample], bins: Sequence[Sequence[int]], seq_len: int, pad_id: int) -> PackedRows:
    lengths = np.fromiter((len(x) for x in samples), dtype=np.int64, count=len(samples))
    if len(samples) and not lengths.min():
        # tokenize_sft never makes one; an empty document would shift every later document's loss count.
        raise ValueError(f"sample {int(np.argmin(lengths))} has no tokens")
    doc_starts = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=doc_starts[1:])
    empty = np.zeros(0, dtype=np.int32)
    doc_tokens = np.concatenate([empty] + [np.array(x.input_ids, dtype=np.int32) for x in samples])
    doc_loss = np.concatenate([empty.astype(np.uint8)] + [np.array(x.loss_mask, dtype=np.uint8) for x in samples])
    row_docs = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=len(samples))
    row_starts = np.zeros(len(bins) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in bins], out=row_starts[1:])
    # Trained labels per document: its loss tokens except the first token, which is never a label.
    doc_trained = np.zeros(len(samples), dtype=np.int64)
    row_loss_tokens = np.zeros(len(bins), dtype=np.int64)
    if len(samples):  # reduceat needs non-empty input; samples are never empty (checked above)
        doc_trained = np.add.reduceat(doc_loss.astype(np.int64), doc_starts[:-1]) - doc_loss[doc_starts[:-1]]
        row_loss_tokens = np.add.reduceat(doc_trained[row_docs], row_starts[:-1])
    return PackedRows(seq_len, pad_id, doc_tokens, doc_loss, doc_starts, row_docs, row_starts, row_loss_tokens)


def pack(samples: Sequence[Sample], seq_len: int, *, pad_id: int) -> PackedRows:
    """Pack samples into rows of `seq_len` tokens (first-fit-decreasing; deterministic)."""
    bins = first_fit_decreasing([len(s) for s in samples], seq_len)
    return _rows(samples, bins, seq_len, pad_id)


def pad(samples: Sequence[Sample], seq_len: int, *, pad_id: int) -> PackedRows:
    """One sample per row, padded to `seq_len`, in sample order."""
    too_long = [i for i, s in enumerate(samples) if len(s) > seq_len]
    if too_long:
        raise ValueError(f"{len(too_long)} samples exceed seq_len={seq_len}, e.g. sample {too_long[0]}")
    return _rows(samples, [[i] for i in range(len(samples))], seq_len, pad_id)
