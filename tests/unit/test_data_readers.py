"""Readers: records carry file:line, and every malformed input fails naming file and line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from trinity.data.prompts import tokenize_prompts
from trinity.data.readers import read_records
from trinity.data.sft import tokenize_sft
from trinity.errors import UserError
from trinity.testing.tiny_assets import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(str(make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))))


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_records_keep_file_and_line_numbers(tmp_path):
    f = write_lines(tmp_path / "a.jsonl", ['{"prompt": "1+1=", "response": "2"}', "", '{"prompt": "x", "response": "y"}'])
    g = write_lines(tmp_path / "b.jsonl", ['{"prompt": "p", "response": "r"}'])
    records = list(read_records([f, str(g)]))
    assert [(r.file.name, r.line_no) for r in records] == [("a.jsonl", 1), ("a.jsonl", 3), ("b.jsonl", 1)]
    assert records[1].row == {"prompt": "x", "response": "y"}
    assert records[1].where == f"{f}:3"


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"prompt": "1+1=", "response": ', "invalid JSON"),
        ('["prompt", "response"]', "expected a JSON object, got list"),
    ],
)
def test_unreadable_line_names_file_and_line(tmp_path, line, problem):
    f = write_lines(tmp_path / "d.jsonl", ['{"prompt": "a", "response": "b"}', line])
    with pytest.raises(UserError) as e:
        list(read_records([f]))
    assert str(e.value).startswith(f"{f}:2: {problem}")


@pytest.mark.parametrize(
    "row, problem",
    [
        ({"prompt": "1+1="}, "missing key 'response'"),
        ({"prompt": 3, "response": "2"}, "key 'prompt' must be a string, got int"),
        ({"prompt": "1+1=", "response": ""}, "key 'response' is empty"),
        ({"prompt": "1+1=", "response": "   "}, "key 'response' is blank"),
        ({"messages": "hi"}, "key 'messages' must be a non-empty list"),
        ({"messages": [{"role": "user"}]}, "messages[0] (user) has no string 'content'"),
        ({"messages": [{"role": "user", "content": "a"}]}, "no assistant message"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]}, "assistant message 1 is empty"),
    ],
)
def test_malformed_sft_record_names_file_and_line(tmp_path, tokenizer, row, problem):
    f = write_lines(tmp_path / "sft.jsonl", [json.dumps({"prompt": "a", "response": "b"}), json.dumps(row)])
    with pytest.raises(UserError) as e:
        tokenize_sft(read_records([f]), tokenizer, max_seq_len=64)
    assert str(e.value).startswith(f"{f}:2: {problem}")


@pytest.mark.parametrize(
    "row, problem",
    [
        ({"prompt": "1+1="}, "missing key 'answer'"),
        ({"prompt": "1+1=", "answer": None}, "key 'answer' must be a string or number, got NoneType"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "answer": "1"},
         "messages ends with an assistant turn"),
    ],
)
def test_malformed_prompt_record_names_file_and_line(tmp_path, tokenizer, row, problem):
    f = write_lines(tmp_path / "rl.jsonl", [json.dumps({"prompt": "a", "answer": 1}), json.dumps(row)])
    with pytest.raises(UserError) as e:
        tokenize_prompts(read_records([f]), tokenizer, max_prompt_length=64)
    assert str(e.value).startswith(f"{f}:2: {problem}")


def test_missing_file_and_unknown_suffix_are_named(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(UserError, match="nope.jsonl: training file not found"):
        list(read_records([missing]))
    csv = tmp_path / "data.csv"
    csv.write_text("a,b\n")
    with pytest.raises(UserError, match=r"data.csv: unsupported file type '.csv'"):
        list(read_records([csv]))
    with pytest.raises(UserError, match="no training files"):
        list(read_records([]))


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is not None, reason="pyarrow is installed")
def test_parquet_without_pyarrow_says_how_to_install(tmp_path):
    f = tmp_path / "train.parquet"
    f.write_bytes(b"PAR1")
    with pytest.raises(UserError) as e:
        list(read_records([f]))
    assert str(f) in str(e.value) and "pip install pyarrow" in str(e.value)


def test_parquet_rows_are_records(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    f = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "2+2="], "response": ["2", "4"]}), f)
    records = list(read_records([f]))
    assert [(r.line_no, r.row) for r in records] == [(1, {"prompt": "1+1=", "response": "2"}), (2, {"prompt": "2+2=", "response": "4"})]
