"""Deterministic, resumable batches of training rows, sharded over data-parallel ranks.

Order: epoch e visits the rows in `permutation(num_rows)` drawn from `numpy.random.default_rng([seed, e])`
(identity without shuffle). A step takes the next `global_batch_size` rows of that order; rank r of
D gets the r-th contiguous slice of `global_batch_size / D` rows, split into micro batches. An epoch's
last `num_rows % global_batch_size` rows are skipped (every step has a full global batch), and the next
epoch starts with a new permutation.

The state is (epoch, position): loading it makes the next batch exactly the one an uninterrupted run
would have produced next, whatever the DP size of either run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trinity.data.packing import PackedRows, pack, pad
from trinity.data.readers import read_records
from trinity.data.sft import Overlength, SFTKeys, SFTStats, tokenize_sft
from trinity.errors import UserError


class RowSampler:
    """Which rows each step uses, for one data-parallel rank (see module doc for the order)."""

    def __init__(
        self,
        num_rows: int,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        what: str = "trainer.global_batch_size",
    ):
        if global_batch_size % (dp_size * micro_batch_size):
            raise UserError(
                f"{what} ({global_batch_size}) must be a multiple of micro_batch_size ({micro_batch_size}) "
                f"x data-parallel size ({dp_size})"
            )
        if num_rows < global_batch_size:
            raise UserError(
                f"the training data makes {num_rows} rows, fewer than {what} ({global_batch_size}); "
                "add data or lower it"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
        self.num_rows, self.seed, self.shuffle = num_rows, seed, shuffle
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, np.arange(0)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_rows // self.global_batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Row indices in the order epoch `epoch` visits them."""
        if self._order_epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order = rng.permutation(self.num_rows) if self.shuffle else np.arange(self.num_rows)
            self._order_epoch = epoch
        return self._order

    def next_global_indices(self) -> np.ndarray:
        """Rows of the next step across all ranks (length global_batch_size); advances the state."""
        if self.position + self.global_batch_size > self.num_rows:
            self.epoch, self.position = self.epoch + 1, 0
        order = self.epoch_order(self.epoch)
        rows = order[self.position : self.position + self.global_batch_size]
        self.position += self.global_batch_size
        return rows

    def rank_micro_batches(self, global_indices: np.ndarray) -> list[np.ndarray]:
        """This rank's slice of a step's rows, split into micro batches."""
        per_rank = self.global_batch_size // self.dp_size
        mine = global_indices[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        return [mine[i : i + self.micro_batch_size] for i in range(0, per_rank, self.micro_batch_size)]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_rows": self.num_rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["num_rows"]) != self.num_rows or int(state["seed"]) != self.seed:
            raise UserError(
                f"cannot resume the data order: the checkpoint was made with {state['num_rows']} rows and "
                f"seed {state['seed']}, this run has {self.num_rows} rows and seed {self.seed} "
                "(training files, seq_length, packing or trainer.seed changed)"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class SFTData:
    """SFT rows plus their sampler: what the trainer iterates.

    `next_global_batch()` returns this rank's micro batches for the next optimizer step, each a dict
    of torch tensors of shape [micro_batch_size, seq_len]: `tokens`, `labels`, `position_ids`,
    `doc_ids` (int64) and `loss_mask` (float32); see trinity.data.packing for their meaning. Build the
    attention mask with `packing.block_causal_mask(batch["doc_ids"])` (or `packing.cu_seqlens` for
    varlen kernels) on the device. After each call, `last_step_loss_tokens` is the number of trained
    tokens in the whole global batch over all DP ranks, for per-token loss normalisation without an
    all-reduce.
    """

    def __init__(self, rows: PackedRows, sampler: RowSampler, stats: SFTStats, source: str = "the training data"):
        self.rows, self.sampler, self.stats, self.source = rows, sampler, stats, source
        self.last_step_loss_tokens = 0

    @property
    def num_rows(self) -> int:
        return self.rows.num_rows

    @property
    def seq_len(self) -> int:
        return self.rows.seq_len

    @property
    def tokens_per_step(self) -> int:
        """Token positions per optimizer step over all DP ranks, padding included."""
        return self.sampler.global_batch_size * self.rows.seq_len

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    def next_global_batch(self) -> list[dict[str, Any]]:
        import torch

        indices = self.sampler.next_global_indices()
        self.last_step_loss_tokens = int(self.rows.row_loss_tokens[indices].sum())
        if not self.last_step_loss_tokens:
            # A step without targets would report loss 0 and teach nothing; tokenize_sft keeps only
            # samples with a trained label, so this means rows were built from other samples.
            shown = ", ".join(map(str, indices[:8].tolist())) + (", ..." if len(indices) > 8 else "")
            raise UserError(
                f"{self.source}: a global batch has no token to train on (epoch {self.sampler.epoch}, rows "
                f"{shown}); a step would report loss 0 and learn nothing: every sample needs a response token"
            )
        return [
            {name: torch.from_numpy(a) for name, a in self.rows.rows(micro).items()}
            for micro in self.sampler.rank_micro_batches(indices)
        ]

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def summary(self) -> str:
        return (
            f"{self.stats.summary()}; {self.num_rows} rows of {self.seq_len} tokens, "
            f"{self.rows.padding_fraction():.1%} padding, {self.steps_per_epoch} steps per epoch"
        )


# Files AutoTokenizer builds a vocabulary from (transformers 5): a `tokenizers` file, a sentencepiece
# or tiktoken model, a byte-level BPE vocabulary with its merges, or a WordPiece vocabulary. Without
# any of them it does not fail: it returns a tokenizer that encodes every text to no tokens, and a job
# trains at loss 0 on nothing.
TOKENIZER_FILES_HINT = "tokenizer.json, tokenizer.model, or vocab.json + merges.txt"
# Probe text for a tokenizer that loads but drops text (digits and ASCII letters: in every vocabulary).
_PROBE_TEXT = "Hello world 123"


def missing_tokenizer_files(folder: str | Path) -> str | None:
    """What `folder` lacks to be a tokenizer folder (a phrase naming the files), None when complete.

    Checks file names only (instant, no transformers import), for `trinity validate` and the workers.
    """
    p = Path(folder)
    if any((p / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.txt")):
        return None
    has_vocab, has_merges = (p / "vocab.json").is_file(), (p / "merges.txt").is_file()
    if has_vocab and has_merges:
        return None
    if has_vocab or has_merges:
        there, lacking = ("vocab.json", "merges.txt") if has_vocab else ("merges.txt", "vocab.json")
        return f"{lacking} ({there} is there; a BPE vocabulary needs both)"
    return f"tokenizer files ({TOKENIZER_FILES_HINT})"


def tokenizer_size(folder: str | Path) -> int | None:
    """How many token ids the tokenizer in `folder` can produce (its largest id + 1, added tokens
    included), read from its JSON files without transformers, for `trinity validate`; None when the
    folder's vocabulary is not in JSON (a sentencepiece tokenizer.model) or cannot be read (its
    loader says why)."""
    p = Path(folder)
    ids: list[int] = []
    if (p / "tokenizer.json").is_file():
        spec = _read_json_file(p / "tokenizer.json")
        model = spec.get("model")
        ids += _vocab_ids(model.get("vocab") if isinstance(model, dict) else None)
        ids += [t["id"] for t in spec.get("added_tokens") or [] if isinstance(t, dict) and isinstance(t.get("id"), int)]
    elif (p / "vocab.json").is_file():
        ids += _vocab_ids(_read_json_file(p / "vocab.json"))
    if not ids:
        return None
    added = _read_json_file(p / "tokenizer_config.json").get("added_tokens_decoder") or {}
    ids += [int(k) for k in added if str(k).isdigit()]
    ids += [v for v in _read_json_file(p / "added_tokens.json").values() if isinstance(v, int)]
    return max(ids) + 1


def _vocab_ids(vocab: Any) -> list[int]:
    """Token ids of a `tokenizers` vocabulary: {token: id} (BPE, WordPiece) or [[piece, score], ...]
    (Unigram, ids by position)."""
    if isinstance(vocab, dict):
        return [v for v in vocab.values() if isinstance(v, int)]
    if isinstance(vocab, list):
        return [len(vocab) - 1] if vocab else []
    return []


def _read_json_file(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; {} when it is missing or not a readable object."""
    import json

    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def check_tokenizer_folder(folder: str | Path) -> None:
    """UserError naming `folder` and the files it lacks, before AutoTokenizer would load an empty tokenizer."""
    if not Path(folder).is_dir():
        raise UserError(f"{folder}: tokenizer folder does not exist")
    missing = missing_tokenizer_files(folder)
    if missing:
        raise UserError(
            f"{folder}: the tokenizer folder has no {missing}; copy them from the original model "
            "folder, or set model.tokenizer_path to a folder that has them"
        )


def check_tokenizer_encodes(tokenizer: Any) -> None:
    """UserError when the tokenizer turns text into no tokens (incomplete or mismatched tokenizer files)."""
    ids = tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"]
    if not ids:
        where = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise UserError(
            f"{where}: the tokenizer encodes text to no tokens ({_PROBE_TEXT!r} -> []); its vocabulary files "
            f"are missing or broken ({TOKENIZER_FILES_HINT}): copy them from the original model folder"
        )


def load_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object, loading it with AutoTokenizer when given a folder.

    Refuses a folder without tokenizer files, one with its own tokenizer code (`auto_map`), and a
    tokenizer that encodes text to nothing.
    """
    if isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        from trinity.models.facts import refuse_custom_code

        check_tokenizer_folder(tokenizer)
        refuse_custom_code(tokenizer)
        folder = tokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
        except (OSError, ValueError, KeyError, TypeError) as e:  # corrupt JSON is a ValueError
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise UserError(
                f"{folder}: cannot load the tokenizer ({type(e).__name__}: {first}); its files are damaged or "
                "from another model: copy them again from the original model folder"
            ) from e
    check_tokenizer_encodes(tokenizer)
    return tokenizer


def pad_token_id(tokenizer: Any) -> int:
    """Id used for padding and for labels without a target (pad token, else EOS)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise UserError("tokenizer has neither pad_token nor eos_token; set one in its tokenizer_config.json")
    return int(pad_id)


def build_sft_data(
    files: Sequence[str | Path],
    tokenizer: Any,
    *,
    seq_len: int,
    packing: bool,
    global_batch_size: int,
    micro_batch_size: int,
    seed: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    shuffle: bool = True,
    prompt_key: str = "prompt",
    response_key: str = "response",
    messages_key: str = "messages",
    overlength: Overlength = Overlength.truncate,
) -> SFTData:
    """Read, tokenise and pack (or pad) SFT files into rows of `seq_len` tokens, with a sampler.

    Every rank builds the same rows (tokenisation is deterministic) and takes its own slice of
    each step. `tokenizer` is a tokenizer object or its folder.
    """
    tok = load_tokenizer(tokenizer)
    keys = SFTKeys(prompt_key=prompt_key, response_key=response_key, messages_key=messages_key)
    samples, stats = tokenize_sft(read_records(files), tok, max_seq_len=seq_len, keys=keys, overlength=overlength)
    names = ", ".join(map(str, files))
    if not stats.records:
        raise UserError(f"{names}: no samples; the training files hold no records")
    if not samples:
        raise UserError(
            f"{names}: all {stats.records} samples were dropped as too long: none has a response token within "
            f"data.seq_length = {seq_len} tokens; raise data.seq_length or shorten the prompts"
        )
    rows = (pack if packing else pad)(samples, seq_len, pad_id=pad_token_id(tok))
    sampler = RowSampler(
        rows.num_rows,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        shuffle=shuffle,
    )
    return SFTData(rows, sampler, stats, source=names)


def job_data_settings(job: Any, tokenizer: Any = None) -> dict[str, Any]:
    """The data settings every training-data builder takes from a validated JobConfig (data.*, trainer.*,
    model.*): one place, so SFT and PT read the same keys the same way."""
    data, trainer = job.data, job.trainer
    return {
        "tokenizer": tokenizer if tokenizer is not None else (job.model.tokenizer_path or job.model.path),
        "seq_len": data.seq_length,
        "packing": data.packing,
        "global_batch_size": trainer.global_batch_size,
        "micro_batch_size": trainer.micro_batch_size,
        "seed": trainer.seed,
        "shuffle": data.shuffle,
    }


def sft_data_from_job(job: Any, *, dp_rank: int, dp_size: int, tokenizer: Any = None) -> SFTData:
    """`build_sft_data` with the settings of a validated JobConfig."""
    data = job.data
    return build_sft_data(
        data.train_files, dp_rank=dp_rank, dp_size=dp_size, prompt_key=data.prompt_key,
        response_key=data.response_key, messages_key=data.messages_key, **job_data_settings(job, tokenizer),
    )
