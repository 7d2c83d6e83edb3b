"""Continued pre-training data (`algorithm.name: pt`): raw text and Megatron-LM indexed datasets -> rows
of `data.seq_length` tokens with the loss on every token, blended by weight, resumable.

Sources (`data.train_files`; kinds told apart by `source_kind`):
- `.jsonl` / `.json` / `.parquet` files and `datasets` folders: one document per record, its text in
  `data.text_key` (records with an empty text are skipped);
- `.txt` / `.md` files: the whole file is one document;
- Megatron indexed datasets, given by their path prefix (`<prefix>.bin` + `<prefix>.idx`, as written by
  Megatron-LM's tools/preprocess_data.py): read with megatron-core's own
  `megatron.core.datasets.indexed_dataset.IndexedDataset`. Their token ids must come from the job's
  tokenizer: a largest id outside its vocabulary is refused.

Each source is one token stream: its documents back to back, each followed by the tokenizer's EOS
(documents that already end with it, as `preprocess_data.py --append-eod` writes them, get no second
one). An indexed dataset whose documents all end with EOS is used in place (its memory-mapped .bin,
no copy), so its size is bounded by disk, not RAM.

Rows (`data.packing`):
- false (the default for pt; Megatron-LM's and LLaMA-Factory's pre-training default): the stream is
  cut into consecutive windows of seq_length + 1 tokens that overlap by one (row r's inputs are stream
  tokens [r*S, r*S+S), its labels [r*S+1, r*S+S+1)), so every token is both an input and a target, with
  no padding; attention is causal across the documents inside a row.
- true: documents are split into pieces of at most seq_length tokens and packed whole into rows
  (trinity.data.packing's first-fit-decreasing) with per-document attention and positions, as SFT
  packing; rows carry some padding and the last token of each piece has no target.

Blend (`data.train_weights`): an epoch is as many rows as all sources make together (N). Source i gets
k_i = round(w_i / sum(w) x N) of them (largest remainder), spread evenly over the epoch's slots; slot j
of source i in epoch e is the source's row perm_i[(e x k_i + j) mod n_i], so a down-weighted source
shows new rows each epoch and an up-weighted one repeats. Without weights every row of every source is
used once per epoch. The slot order is shuffled per epoch and sharded over data-parallel ranks by
trinity.data.loader.RowSampler, whose (epoch, position) state makes resume exact.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trinity.errors import UserError

TEXT_SUFFIXES = (".txt", ".md")
INDEX_SUFFIXES = (".bin", ".idx")


class SourceKind(str, enum.Enum):
    records = "records"  # jsonl / json / parquet / datasets folder, text in data.text_key
    text = "text"  # a plain text file: one document
    indexed = "indexed"  # a Megatron indexed dataset (path prefix)


def source_kind(path: str) -> SourceKind:
    """How `path` is read (by its suffix; anything else is an indexed dataset's prefix)."""
    from trinity.data.readers import READERS, is_hf_dataset_dir

    p = Path(path)
    if p.suffix in TEXT_SUFFIXES:
        return SourceKind.text
    if p.suffix in READERS or is_hf_dataset_dir(p):
        return SourceKind.records
    return SourceKind.indexed


def source_problems(files: Sequence[str], weights: Sequence[float] | None, *, check_paths: bool) -> list[str]:
    """Config problems of pt's data.train_files / data.train_weights (`key: problem; fix`)."""
    problems: list[str] = []
    if not files:
        problems.append(
            "data.train_files: no training data; list text files (.jsonl, .json, .parquet, .txt) or "
            "Megatron indexed datasets (their path prefix)"
        )
    for i, f in enumerate(files):
        kind = source_kind(f)
        if kind is SourceKind.indexed:
            if f.endswith(INDEX_SUFFIXES):
                problems.append(
                    f"data.train_files.{i}: {f}: name a Megatron indexed dataset by its path prefix, without "
                    f".bin/.idx ({f[:-4]})"
                )
            elif check_paths and not (Path(f + ".bin").is_file() and Path(f + ".idx").is_file()):
                found = [s for s in INDEX_SUFFIXES if Path(f + s).is_file()]
                what = f"only {f}{found[0]} exists" if found else f"neither {f}.bin nor {f}.idx exists"
                problems.append(
                    f"data.train_files.{i}: {f} is not a readable file or a Megatron indexed dataset ({what}); "
                    "give a .jsonl/.json/.parquet/.txt file or the prefix of a .bin + .idx pair"
                )
            elif check_paths:
                problem = indexed_size_problem(f)
                if problem:
                    problems.append(f"data.train_files.{i}: {problem}")
        elif check_paths and not Path(f).exists():
            problems.append(f"data.train_files.{i}: {f} does not exist")
        elif check_paths and Path(f).is_file() and Path(f).suffix != ".parquet":
            from trinity.data.readers import sniff_text

            problem = sniff_text(Path(f))
            if problem:
                problems.append(f"data.train_files.{i}: {problem}")
    if weights is not None:
        if len(weights) != len(files):
            problems.append(
                f"data.train_weights: {len(weights)} weights for {len(files)} train_files; give one weight per file"
            )
        if any(w < 0 for w in weights) or not sum(weights) > 0:
            problems.append("data.train_weights: weights must be >= 0 with a positive sum")
    return problems


# Megatron-LM's .idx layout (megatron.core.datasets.indexed_dataset._IndexWriter): a 9-byte magic,
# version <Q, dtype code <B, sequence count <Q, document count <Q, then int32 sequence lengths and
# int64 sequence pointers (byte offsets into the .bin).
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEAD = struct.Struct("<9sQBQQ")
_IDX_ITEM_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # megatron's DType code -> bytes per token


def indexed_size_problem(prefix: str) -> str | None:
    """Why `<prefix>.bin` cannot hold what `<prefix>.idx` indexes (a copy cut short: megatron-core would
    fail on it minutes into the job, or read past its end), from the index's header and last entry: a
    few bytes read, whatever the dataset's size. None when the sizes agree; a header megatron cannot
    read is left to its reader's own message."""
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    try:
        with idx.open("rb") as f:
            head = f.read(_IDX_HEAD.size)
            if len(head) < _IDX_HEAD.size:
                return f"{idx} is truncated: {len(head)} bytes, shorter than the index header; preprocess the dataset again"
            magic, _version, code, sequences, _documents = _IDX_HEAD.unpack(head)
            if magic != _IDX_MAGIC or code not in _IDX_ITEM_SIZES or sequences == 0:
                return None
            f.seek(_IDX_HEAD.size + 4 * (sequences - 1))
            last_length = np.frombuffer(f.read(4), dtype="<i4")
            f.seek(_IDX_HEAD.size + 4 * sequences + 8 * (sequences - 1))
            last_pointer = np.frombuffer(f.read(8), dtype="<i8")
        actual = bin_.stat().st_size
    except OSError as exc:
        return f"{prefix}: cannot read the indexed dataset: {exc.strerror} ({exc.filename})"
    if len(last_length) < 1 or len(last_pointer) < 1:
        return (f"{idx} is truncated: it lists {sequences} sequences but ends before their offsets; "
                "copy it again or preprocess the dataset again")
    expected = int(last_pointer[0]) + int(last_length[0]) * _IDX_ITEM_SIZES[code]
    if actual < expected:
        return (f"{bin_} is truncated: its index {idx} needs {expected} bytes, the file has {actual}; copy it "
                "again (a transfer cut short?) or preprocess the dataset again")
    return None


# ---------------------------------------------------------------------------------------------- sources


@dataclass
class Source:
    """One source's token stream (documents back to back, each ending with EOS)."""

    path: str
    kind: SourceKind
    tokens: np.ndarray  # 1-D integer array (a memory map for indexed datasets when possible)
    doc_starts: np.ndarray  # int64, len documents + 1: document d is tokens[doc_starts[d]:doc_starts[d + 1]]
    skipped: int = 0  # empty documents left out
    # The IndexedDataset whose memory map `tokens` views: megatron closes the map when that object is
    # collected, and reading the view after that crashes the process, so the source holds it.
    dataset: Any = None

    @property
    def num_docs(self) -> int:
        return len(self.doc_starts) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def _stream(docs: Sequence[Sequence[int]], eos: int) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((len(d) + 1 for d in docs), dtype=np.int64, count=len(docs))
    starts = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    tokens = np.empty(int(starts[-1]), dtype=np.int32)
    for d, ids in enumerate(docs):
        tokens[starts[d] : starts[d + 1] - 1] = ids
        tokens[starts[d + 1] - 1] = eos
    return tokens, starts


def _text_documents(path: str, kind: SourceKind, text_key: str) -> tuple[list[str], int]:
    if kind is SourceKind.text:
        from trinity.data.readers import read_text

        text = read_text(Path(path))
        return ([text] if text else []), (0 if text else 1)
    from trinity.data.readers import read_records

    texts, skipped = [], 0
    for record in read_records([path]):
        if record.row.get(text_key) == "":
            skipped += 1
            continue
        texts.append(record.text(text_key))
    return texts, skipped


def read_indexed(path: str, eos: int, vocab_size: int | None) -> Source:
    """A Megatron indexed dataset through megatron-core's IndexedDataset, as a token stream.

    With `vocab_size`, the largest token id is checked against it (a full read of the .bin);
    None skips that scan (see `build_pt_data`'s check_vocab).

    Megatron documents may be several sequences (preprocess_data.py --split-sentences); they are
    stored contiguously, so a document is the run of its sequences' tokens.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    problem = indexed_size_problem(path)  # megatron maps a short .bin without a word
    if problem:
        raise UserError(problem)
    try:
        ds = IndexedDataset(path)
    except (AssertionError, ValueError, OSError) as exc:  # megatron asserts on a bad header / version
        raise UserError(f"{path}: not a readable Megatron indexed dataset ({exc or type(exc).__name__})") from None
    lengths = ds.sequence_lengths.astype(np.int64)
    seq_starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=seq_starts[1:])
    total = int(seq_starts[-1])
    if total == 0:
        raise UserError(f"{path}: the indexed dataset holds no tokens")
    # One read of the whole .bin through megatron's reader: a view of its memory map, no copy.
    raw = ds.bin_reader.read(dtype=ds.index.dtype, count=total, offset=int(ds.index.sequence_pointers[0]))
    top = int(raw.max()) if vocab_size is not None else -1
    if vocab_size is not None and top >= vocab_size:
        raise UserError(
            f"{path}: token id {top} is outside the job's tokenizer vocabulary ({vocab_size} tokens), so the "
            "dataset was tokenised with another tokenizer; preprocess it again with this tokenizer "
            "(preprocess_data.py --tokenizer-type HuggingFaceTokenizer --tokenizer-model <model.tokenizer_path "
            "or model.path>) or set model.tokenizer_path to the tokenizer it was made with"
        )
    doc_starts = seq_starts[np.asarray(ds.document_indices, dtype=np.int64)]
    doc_starts = np.unique(doc_starts)  # empty documents have no tokens to train on
    ends = doc_starts[1:] - 1
    missing = np.flatnonzero(raw[ends] != eos)
    if not len(missing):
        return Source(path, SourceKind.indexed, raw, doc_starts, dataset=ds)
    # Documents without a trailing EOS (preprocessed without --append-eod): insert one after each
    # (in memory; uint16 data widens when the EOS id does not fit).
    dtype = raw.dtype if eos <= np.iinfo(raw.dtype).max else np.int32
    tokens = np.insert(raw.astype(dtype, copy=False), ends[missing] + 1, np.asarray(eos, dtype=dtype))
    shift = np.zeros(len(doc_starts), dtype=np.int64)
    flags = np.zeros(len(doc_starts) - 1, dtype=np.int64)
    flags[missing] = 1
    np.cumsum(flags, out=shift[1:])
    return Source(path, SourceKind.indexed, tokens, doc_starts + shift, dataset=ds)


def read_source(path: str, tokenizer: Any, *, eos: int, text_key: str, check_vocab: bool = True) -> Source:
    """One entry of data.train_files as a token stream."""
    kind = source_kind(path)
    if kind is SourceKind.indexed:
        return read_indexed(path, eos, len(tokenizer) if check_vocab else None)
    from trinity.data.sft import TOKENIZE_CHUNK

    texts, skipped = _text_documents(path, kind, text_key)
    if not texts:
        raise UserError(f"{path}: no documents with text (key {text_key!r})")
    ids: list[list[int]] = []
    for start in range(0, len(texts), TOKENIZE_CHUNK):
        # verbose=False: documents longer than the tokenizer's model_max_length are expected here (they
        # are cut into rows), so its warning about them would only mislead.
        ids += tokenizer(texts[start : start + TOKENIZE_CHUNK], add_special_tokens=False, verbose=False)["input_ids"]
    tokens, starts = _stream(ids, eos)
    return Source(path, kind, tokens, starts, skipped)


# ------------------------------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class WindowRows:
    """Consecutive windows of a token stream: row r = inputs stream[r*S : r*S+S], labels one further."""

    seq_len: int
    tokens: np.ndarray

    @property
    def num_rows(self) -> int:
        return max((len(self.tokens) - 1) // self.seq_len, 0)

    @property
    def row_loss_tokens(self) -> np.ndarray:
        return np.full(self.num_rows, self.seq_len, dtype=np.int64)

    def padding_fraction(self) -> float:
        return 0.0

    def rows(self, index: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        index = np.asarray(index, dtype=np.int64)
        s = self.seq_len
        window = self.tokens[(index * s)[:, None] + np.arange(s + 1)].astype(np.int64)
        n = len(index)
        return {
            "tokens": np.ascontiguousarray(window[:, :-1]),
            "labels": np.ascontiguousarray(window[:, 1:]),
            "loss_mask": np.ones((n, s), dtype=np.float32),
            "position_ids": np.broadcast_to(np.arange(s, dtype=np.int64), (n, s)).copy(),
            "doc_ids": np.zeros((n, s), dtype=np.int64),
        }


def packed_rows(source: Source, seq_len: int, pad_id: int) -> Any:
    """Documents split into pieces of at most seq_len tokens, packed with per-document attention
    (trinity.data.packing.PackedRows over the source's stream, without copying it)."""
    from trinity.data.packing import PackedRows, first_fit_decreasing

    starts, ends = source.doc_starts[:-1], source.doc_starts[1:]
    pieces = (ends - starts + seq_len - 1) // seq_len
    first = np.repeat(starts, pieces)
    k = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    piece_starts = np.append(first + k * seq_len, source.num_tokens).astype(np.int64)
    lengths = np.diff(piece_starts)
    bins = first_fit_decreasing(lengths.tolist(), seq_len)
    row_docs = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=len(lengths))
    row_starts = np.zeros(len(bins) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in bins], out=row_starts[1:])
    row_loss_tokens = np.add.reduceat(lengths[row_docs] - 1, row_starts[:-1]) if len(bins) else np.zeros(0, np.int64)
    # Every token is trained: a read-only broadcast of 1 instead of a byte per token.
    loss = np.broadcast_to(np.uint8(1), (source.num_tokens,))
    return PackedRows(seq_len, pad_id, source.tokens, loss, piece_starts, row_docs, row_starts, row_loss_tokens)


# ------------------------------------------------------------------------------------------------ blend


def blend_counts(rows: Sequence[int], weights: Sequence[float] | None) -> list[int]:
    """Rows each source contributes to one epoch of sum(rows) slots (largest remainder)."""
    total = int(sum(rows))
    if weights is None:
        return [int(r) for r in rows]
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: total - int(counts.sum())]] += 1
    return counts.tolist()


def interleave(counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(source, rank within the source) of each slot, each source's slots spread evenly over the epoch
    (slot keys (j + 0.5) / k_i merged in order), so any stretch of slots keeps the proportions."""
    src = np.repeat(np.arange(len(counts)), counts)
    rank = np.concatenate([np.arange(k) for k in counts]) if len(counts) else np.zeros(0, np.int64)
    keys = (rank + 0.5) / np.repeat(np.maximum(np.asarray(counts), 1), counts)
    order = np.lexsort((src, keys))
    return src[order], rank[order].astype(np.int64)


class PTData:
    """Pre-training rows plus their sampler, with SFTData's interface (trinity.data.loader): what the
    SFT loop iterates.

    `next_global_batch()` returns this rank's micro batches for the next step as dicts of torch tensors
    [micro_batch_size, seq_len] (`tokens`, `labels`, `position_ids`, `doc_ids`, `loss_mask`); after it,
    `last_step_loss_tokens` is the number of trained tokens in the global batch.
    """

    def __init__(self, sources: list[Source], rows: list[Any], counts: list[int], sampler: Any, *,
                 seq_len: int, packing: bool, seed: int, shuffle: bool, weights: Sequence[float] | None):
        self.sources, self.source_rows, self.counts = sources, rows, counts
        self.sampler, self.packing, self.weights = sampler, packing, weights
        self._seq_len = seq_len
        self.slot_source, self.slot_rank = interleave(counts)
        self.perms = [
            np.random.default_rng([seed, 7, i]).permutation(r.num_rows) if shuffle else np.arange(r.num_rows)
            for i, r in enumerate(rows)
        ]
        self.last_step_loss_tokens = 0

    @property
    def num_rows(self) -> int:
        return len(self.slot_source)

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.sampler.global_batch_size * self._seq_len

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    def source_rows_of(self, slots: np.ndarray, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, row of that source) of each slot in `epoch`."""
        src = self.slot_source[slots]
        rows = np.empty(len(slots), dtype=np.int64)
        for i in np.unique(src):
            sel = src == i
            n = self.source_rows[i].num_rows
            rows[sel] = self.perms[i][(epoch * self.counts[i] + self.slot_rank[slots[sel]]) % n]
        return src, rows

    def _fields(self, src: np.ndarray, rows: np.ndarray) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] | None = None
        for i in np.unique(src):
            sel = np.flatnonzero(src == i)
            part = self.source_rows[i].rows(rows[sel])
            if out is None:
                out = {k: np.empty((len(src),) + v.shape[1:], dtype=v.dtype) for k, v in part.items()}
            for k, v in part.items():
                out[k][sel] = v
        assert out is not None
        return out

    def next_global_batch(self) -> list[dict[str, Any]]:
        import torch

        slots = self.sampler.next_global_indices()
        epoch = self.sampler.epoch  # the epoch these slots belong to (the sampler advances it first)
        src, rows = self.source_rows_of(slots, epoch)
        self.last_step_loss_tokens = int(sum(
            int(self.source_rows[i].row_loss_tokens[rows[src == i]].sum()) for i in np.unique(src)
        ))
        # This rank's micro batches as positions within the step (the sampler slices, it does not look).
        return [
            {k: torch.from_numpy(v) for k, v in self._fields(src[at], rows[at]).items()}
            for at in self.sampler.rank_micro_batches(np.arange(len(slots)))
        ]

    def state_dict(self) -> dict[str, Any]:
        return {**self.sampler.state_dict(), "blend": list(self.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "blend" in state and [int(c) for c in state["blend"]] != list(self.counts):
            raise UserError(
                f"cannot resume the data order: the checkpoint drew {state['blend']} rows per epoch from the "
                f"training sources, this run draws {self.counts} (data.train_files, their weights or "
                "data.seq_length changed)"
            )
        self.sampler.load_state_dict(state)

    def describe(self) -> dict[str, Any]:
        """Numbers for `trinity validate` (its --json form too)."""
        total = max(self.num_rows, 1)
        return {
            "sources": [
                {"path": s.path, "kind": s.kind.value, "documents": s.num_docs, "tokens": s.num_tokens,
                 "skipped_empty": s.skipped, "rows": r.num_rows, "rows_per_epoch": k, "share": k / total}
                for s, r, k in zip(self.sources, self.source_rows, self.counts)
            ],
            "documents": sum(s.num_docs for s in self.sources),
            "tokens": sum(s.num_tokens for s in self.sources),
            "rows_per_epoch": self.num_rows,
            "seq_length": self._seq_len,
            "packing": self.packing,
            "padding": self.padding_fraction(),
            "steps_per_epoch": self.steps_per_epoch,
        }

    def padding_fraction(self) -> float:
        pads = [r.padding_fraction() * r.num_rows for r in self.source_rows]
        return sum(pads) / max(sum(r.num_rows for r in self.source_rows), 1)

    def summary(self) -> str:
        d = self.describe()
        layout = "packed per document" if self.packing else "concatenated"
        parts = []
        for s in d["sources"]:
            share = f", {s['share']:.1%} of rows" if len(d["sources"]) > 1 else ""
            parts.append(f"{s['path']} ({s['kind']}: {s['documents']} documents, {s['tokens']} tokens{share})")
        return (
            f"pt: {d['documents']} documents, {d['tokens']} tokens from {'; '.join(parts)}; "
            f"{d['rows_per_epoch']} rows of {d['seq_length']} tokens per epoch ({layout}, "
            f"{d['padding']:.1%} padding), {d['steps_per_epoch']} steps per epoch"
        )


# ----------------------------------------------------------------------------------------------- build


def build_pt_data(
    files: Sequence[str],
    tokenizer: Any,
    *,
    seq_len: int,
    packing: bool = False,
    global_batch_size: int,
    micro_batch_size: int,
    seed: int,
    weights: Sequence[float] | None = None,
    dp_rank: int = 0,
    dp_size: int = 1,
    shuffle: bool = True,
    text_key: str = "text",
    check_vocab: bool = True,
) -> PTData:
    """Read every source, cut or pack it into rows and set up the blend and the sampler.

    Every rank builds the same rows (reading and tokenising are deterministic) and takes its own slice
    of each step. `tokenizer` is a tokenizer object or its folder. `check_vocab` scans every indexed
    dataset for its largest token id (a full read of each .bin).
    """
    from trinity.data.loader import RowSampler, load_tokenizer, pad_token_id

    files = [str(f) for f in files]
    problems = source_problems(files, weights, check_paths=True)
    if problems:
        raise UserError(problems[0])
    tok = load_tokenizer(tokenizer)
    eos = tok.eos_token_id
    if eos is None:
        raise UserError("tokenizer has no eos_token; set one in its tokenizer_config.json")
    sources = [read_source(f, tok, eos=int(eos), text_key=text_key, check_vocab=check_vocab) for f in files]
    if packing:
        rows = [packed_rows(s, seq_len, pad_token_id(tok)) for s in sources]
    else:
        rows = [WindowRows(seq_len, s.tokens) for s in sources]
    for s, r, w in zip(sources, rows, weights or [1.0] * len(sources)):
        if r.num_rows == 0 and w > 0:
            raise UserError(
                f"{s.path}: {s.num_tokens} tokens make no row of data.seq_length {seq_len} tokens "
                "(a row needs seq_length + 1 tokens); add text or lower data.seq_length"
            )
    counts = blend_counts([r.num_rows for r in rows], weights)
    sampler = RowSampler(
        int(sum(counts)), global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
        dp_rank=dp_rank, dp_size=dp_size, seed=seed, shuffle=shuffle,
    )
    return PTData(sources, rows, counts, sampler, seq_len=seq_len, packing=packing, seed=seed, shuffle=shuffle,
                  weights=weights)


def pt_data_from_job(
    job: Any, *, dp_rank: int, dp_size: int, tokenizer: Any = None, check_vocab: bool = True
) -> PTData:
    """`build_pt_data` with the settings of a validated JobConfig (`loader.job_data_settings`)."""
    from trinity.data.loader import job_data_settings

    data = job.data
    return build_pt_data(
        data.train_files, weights=data.train_weights, dp_rank=dp_rank, dp_size=dp_size, text_key=data.text_key,
        check_vocab=check_vocab, **job_data_settings(job, tokenizer),
    )


def plan_data(job: Any) -> dict[str, Any]:
    """What `trinity validate` reports for a pt job: tokens, rows and steps per epoch (every source is
    read and tokenised once, as each rank will)."""
    data = pt_data_from_job(job, dp_rank=0, dp_size=1)
    out = data.describe()
    t = job.trainer
    out["total_steps"] = t.total_steps if t.total_steps is not None else t.total_epochs * data.steps_per_epoch
    return out
