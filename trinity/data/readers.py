"""Readers of local training files (jsonl, parquet) that name the file and line of every problem.

Every record comes out as a `Record(file, line_no, row)`; the field checkers below turn a bad value
into `UserError("<file>:<line>: <problem>")`, so a user can open the file at the line and fix it.
For parquet files `line_no` is the 1-based row number.
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
        """A chat: a non-empty list of {role, content} with string values."""
        value = self.row[key]
        if not isinstance(value, list) or not value:
            raise self.error(f"key {key!r} must be a non-empty list of {{role, content}} messages")
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


def _read_jsonl(path: Path) -> Iterator[Record]:
    with path.open("r", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
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
        raise UserError(f"{path}: not a readable parquet file ({e})") from None
    for i, row in enumerate(table.to_pylist(), start=1):
        yield Record(path, i, row)


# File suffix -> reader. A new format is one entry here.
READERS: dict[str, Callable[[Path], Iterator[Record]]] = {
    ".jsonl": _read_jsonl,
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
        if not path.is_file():
            raise UserError(f"{path}: training file not found")
        if path.suffix not in READERS:
            raise UserError(f"{path}: unsupported file type {path.suffix!r}; use one of {sorted(READERS)}")
    for path in paths:
        yield from READERS[path.suffix](path)
