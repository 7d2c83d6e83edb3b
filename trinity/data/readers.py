"""Readers of local training files that name the file and line of every problem.

Formats: JSON Lines (`.jsonl`), JSON (`.json`: an array of objects, or JSON Lines under a .json name as
`datasets`' `to_json` writes them), parquet, and Hugging Face `datasets` folders (`save_to_disk`).
Every record comes out as a `Record(file, line_no, row)`; the field checkers below turn a bad value
into `UserError("<file>:<line>: <problem>")`, so a user can open the file at the line and fix it.
For a JSON array `line_no` is the line where the object starts; for parquet and dataset folders it is
the 1-based row number.

Two common public layouts are read as ours (`normalise_layout`), so such files train as they are:
alpaca (`instruction`, optional `input`, `output`) becomes prompt / response, and ShareGPT
(`conversations` of `{from, value}`) becomes `messages` of `{role, content}`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trinity.errors import UserError


@dataclass(frozen=True)
class Record:
    """One sample of a training file: where it came from and its fields."""

    file: Path
    line_no: int
    row: dict[str, Any]

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line_no}"

    def error(self, problem: str) -> UserError:
        """A UserError naming this record's file and line."""
        return UserError(f"{self.where}: {problem}")

    def text(self, key: str) -> str:
        """The non-empty string in field `key`."""
        if key not in self.row:
            raise self.error(f"missing key {key!r} (keys present: {sorted(self.row)})")
        value = self.row[key]
        if not isinstance(value, str):
            raise self.error(f"key {key!r} must be a string, got {type(value).__name__}")
        if not value:
            raise self.error(f"key {key!r} is empty")
        return value

    def answer(self, key: str) -> str:
        """A ground-truth answer: a string or a number (JSON writers often store `19`, not `"19"`)."""
        if key not in self.row:
            raise self.error(f"missing key {key!r} (keys present: {sorted(self.row)})")
        value = self.row[key]
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise self.error(f"key {key!r} must be a string or number, got {type(value).__name__}")
        text = str(value)
        if not text:
            raise self.error(f"key {key!r} is empty")
        return text

    def messages(self, key: str) -> list[dict[str, str]]:
        """A chat: a non-empty list of {role, content} (or ShareGPT's {from, value}) with string values."""
        value = self.row[key]
        if not isinstance(value, list) or not value:
            raise self.error(f"key {key!r} must be a non-empty list of {{role, content}} messages")
        if all(isinstance(m, dict) and "from" in m and "role" not in m for m in value):
            value = sharegpt_messages(self, key, value)
        chat: list[dict[str, str]] = []
        for i, message in enumerate(value):
            if not isinstance(message, dict):
                raise self.error(f"{key}[{i}] must be an object with role and content")
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str) or not role:
                raise self.error(f"{key}[{i}] has no string 'role'")
            if not isinstance(content, str):
                raise self.error(f"{key}[{i}] ({role}) has no string 'content'")
            chat.append({"role": role, "content": content})
        return chat


# ShareGPT speaker names -> chat roles (the names FastChat, LLaMA-Factory and ShareGPT dumps use).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}


def sharegpt_messages(record: Record, key: str, turns: list[Any]) -> list[dict[str, Any]]:
    """ShareGPT turns `{from, value}` as `{role, content}`; an unknown speaker (tool calls, observations)
    is an error, not a silently dropped turn."""
    out = []
    for i, turn in enumerate(turns):
        speaker = turn.get("from")
        role = SHAREGPT_ROLES.get(speaker.lower()) if isinstance(speaker, str) else None
        if role is None:
            raise record.error(
                f"{key}[{i}] has 'from': {speaker!r}, which is not a ShareGPT speaker this reader maps "
                f"(one of {sorted(SHAREGPT_ROLES)}); convert the turn to role/content"
            )
        out.append({"role": role, "content": turn.get("value")})
    return out


def normalise_layout(record: Record) -> Record:
    """Read alpaca and ShareGPT rows as prompt/response and messages (see the module docstring); rows
    already in our layout, or in neither, pass unchanged."""
    row = record.row
    if "messages" not in row and isinstance(row.get("conversations"), list):
        return Record(record.file, record.line_no, {**row, "messages": row["conversations"]})
    if "prompt" not in row and "response" not in row and "instruction" in row and "output" in row:
        for unread in ("system", "history"):
            if row.get(unread):
                raise record.error(
                    f"alpaca key {unread!r} is not read (only instruction, input, output are); "
                    "write the sample as messages instead"
                )
        instruction, extra = row["instruction"], row.get("input") or ""
        if not isinstance(instruction, str) or not isinstance(extra, str):
            raise record.error("alpaca keys 'instruction' and 'input' must be strings")
        prompt = f"{instruction}\n{extra}" if extra else instruction
        return Record(record.file, record.line_no, {**row, "prompt": prompt, "response": row["output"]})
    return record


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def not_utf8(path: Path, raw: bytes, exc: UnicodeDecodeError, first_line: int = 1) -> UserError:
    """The one line for bytes of `path` that are not UTF-8 (a binary file, or text saved in another
    encoding): the file, the line (`raw` starts at `first_line`), the byte and the fix."""
    newline = b"\n"
    line = first_line + raw.count(newline, 0, exc.start)
    column = exc.start - raw.rfind(newline, 0, exc.start)
    return UserError(
        f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {column}); the file is binary "
        "or in another encoding: save it as UTF-8 text (e.g. iconv -f latin1 -t utf-8)"
    )


def read_bytes(path: Path) -> bytes:
    """The whole of `path`; an unreadable file (permissions, a folder) is one line naming it."""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UserError(f"{path}: cannot read the file: {exc.strerror}") from None


def read_text(path: Path) -> str:
    """The whole of `path` as UTF-8 text, or one line naming the file and line that is not UTF-8."""
    raw = read_bytes(path)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise not_utf8(path, raw, exc) from None


# How much of a text data file `trinity validate` reads to tell text from a binary file.
SNIFF_BYTES = 1 << 16


def sniff_text(path: Path) -> str | None:
    """Why `path` is not a UTF-8 text file, judged on its first SNIFF_BYTES (a binary file saved
    under a .jsonl name fails there); None when that start is text or the file cannot be opened (its
    reader says why). Instant whatever the file's size, for `trinity validate`."""
    try:
        with path.open("rb") as f:
            head = f.read(SNIFF_BYTES + 1)
    except OSError:
        return None
    cut = len(head) > SNIFF_BYTES
    head = head[:SNIFF_BYTES]
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if not (cut and exc.reason == "unexpected end of data"):  # a character cut by the sniff's end is fine
            return str(not_utf8(path, head, exc))
        text = head[: exc.start].decode("utf-8")
    nul = text.find("\0")
    if nul >= 0:
        return f"{path}:{_line_of(text, nul)}: not text (a NUL byte); the file is binary: give a UTF-8 text file"
    return None


def _read_json(path: Path) -> Iterator[Record]:
    """A JSON array of objects; a file whose first value is an object is read as JSON Lines."""
    text = read_text(path)
    start = len(text) - len(text.lstrip())
    if text[start:start + 1] != "[":
        yield from _read_jsonl(path)
        return
    decoder = json.JSONDecoder()
    pos, first = start + 1, True
    while True:
        pos = _skip_space(text, pos)
        if text[pos:pos + 1] == "]":
            after = _skip_space(text, pos + 1)
            if after != len(text):
                raise UserError(f"{path}:{_line_of(text, after)}: invalid JSON (text after the closing ']')")
            return
        if not first:
            if text[pos:pos + 1] != ",":
                raise UserError(f"{path}:{_line_of(text, pos)}: invalid JSON (expected ',' or ']' between items)")
            pos = _skip_space(text, pos + 1)
        first = False
        try:
            row, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise UserError(f"{path}:{_line_of(text, pos)}: expected a JSON object, got {type(row).__name__}")
        yield Record(path, _line_of(text, pos), row)
        pos = end


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def is_hf_dataset_dir(path: Path) -> bool:
    """A folder written by `datasets`' `save_to_disk` (a Dataset or a DatasetDict)."""
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file() or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())
    )


def _read_hf_dataset(path: Path) -> Iterator[Record]:
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"{path}: a Hugging Face datasets folder; reading it needs the datasets package: pip install datasets"
        ) from None
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises several types for a damaged folder
        raise UserError(f"{path}: not a readable datasets folder ({type(e).__name__}: {_one_line(e)})") from None
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise UserError(
                f"{path}: a DatasetDict without a 'train' split (splits: {sorted(data)}); "
                f"list the split's folder instead, e.g. {path / sorted(data)[0]}"
            )
        data = data["train"]
    for i, row in enumerate(data, start=1):
        yield Record(path, i, dict(row))


def _one_line(exc: BaseException) -> str:
    """A third-party exception's text on one line (pyarrow's span several)."""
    return " ".join(str(exc).split())


def _read_jsonl(path: Path) -> Iterator[Record]:
    try:
        f = path.open("rb")
    except OSError as exc:
        raise UserError(f"{path}: cannot read the file: {exc.strerror}") from None
    with f:
        for line_no, raw in enumerate(f, start=1):
            try:  # line by line: a multi-gigabyte file is never held whole
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise not_utf8(path, raw, exc, first_line=line_no) from None
            if not line.strip():
                continue  # blank lines (often a trailing newline) are not samples
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{line_no}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
            yield Record(path, line_no, row)


def _read_parquet(path: Path) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(
            f"{path}: reading parquet needs pyarrow; install it with `pip install pyarrow` "
            "(or `pip install trinity-mcore[parquet]`), or convert the file to jsonl"
        ) from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several unrelated types for corrupt files
        raise UserError(f"{path}: not a readable parquet file ({_one_line(e)})") from None
    for i, row in enumerate(table.to_pylist(), start=1):
        yield Record(path, i, row)


# File suffix -> reader. A new format is one entry here.
READERS: dict[str, Callable[[Path], Iterator[Record]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".parquet": _read_parquet,
}


def read_records(files: Iterable[str | Path]) -> Iterator[Record]:
    """Every record of `files`, in the given order (file by file, line by line).

    Raises UserError for a missing file, an unknown suffix, or a line that is not a JSON object.
    """
    paths = [Path(f) for f in files]
    if not paths:
        raise UserError("data.train_files: no training files given")
    for path in paths:  # check all first: fail before spending time on the ones that exist
        if is_hf_dataset_dir(path):
            continue
        if not path.is_file():
            raise UserError(f"{path}: training file not found")
        if path.suffix not in READERS:
            raise UserError(
                f"{path}: unsupported file type {path.suffix!r}; use one of {sorted(READERS)} or a datasets folder"
            )
    for path in paths:
        reader = _read_hf_dataset if is_hf_dataset_dir(path) else READERS[path.suffix]
        for record in reader(path):
            yield normalise_layout(record)
