"""JSON arrays (alpaca, ShareGPT), JSON Lines under a .json name and Hugging Face `datasets` folders as
training files: read into our layout, validated by `trinity validate`, and every bad input named by
file and line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HF_CONFIGS
from trinity.config.loader import load_config
from trinity.data.readers import read_records
from trinity.data.sft import SFTKeys, record_segments
from trinity.errors import ConfigError, UserError

ALPACA = [
    {"instruction": "Add the numbers.", "input": "2 + 3", "output": "5"},
    {"instruction": "Name a primary colour.", "input": "", "output": "Red"},
]
SHAREGPT = [
    {"conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "What is 2 + 3?"},
        {"from": "gpt", "value": "5"},
    ]},
]


def write_json(path: Path, value, indent: int | None = 2) -> Path:
    path.write_text(json.dumps(value, indent=indent), encoding="utf-8")
    return path


def test_alpaca_array_becomes_prompt_and_response_with_object_lines(tmp_path):
    f = write_json(tmp_path / "alpaca.json", ALPACA)
    records = list(read_records([f]))
    assert [r.row["prompt"] for r in records] == ["Add the numbers.\n2 + 3", "Name a primary colour."]
    assert [r.row["response"] for r in records] == ["5", "Red"]
    # line_no is where each object starts in the (indented) file: [ on line 1, objects on 2 and 7
    lines = f.read_text().splitlines()
    assert [lines[r.line_no - 1].strip() for r in records] == ["{", "{"]
    assert [r.line_no for r in records] == [2, 7]


def test_sharegpt_array_becomes_messages(tmp_path):
    f = write_json(tmp_path / "chat.json", SHAREGPT, indent=None)
    (record,) = read_records([f])
    assert record.messages("messages") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
    ]
    # data.messages_key: conversations reads the ShareGPT turns too
    assert record.messages("conversations") == record.messages("messages")


def test_sharegpt_unknown_speaker_is_named_not_dropped(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "function_call", "value": "{}"}]}]
    f = write_json(tmp_path / "tools.json", rows, indent=None)
    (record,) = read_records([f])
    with pytest.raises(UserError) as e:
        record.messages("messages")
    assert str(e.value).startswith(f"{f}:1: messages[1] has 'from': 'function_call'")


def test_alpaca_system_or_history_is_refused_not_dropped(tmp_path):
    f = write_json(tmp_path / "a.json", [ALPACA[0], {**ALPACA[1], "system": "You are terse."}])
    with pytest.raises(UserError) as e:
        list(read_records([f]))
    assert str(e.value) == (f"{f}:7: alpaca key 'system' is not read (only instruction, input, output are); "
                            "write the sample as messages instead")


def test_json_lines_under_a_json_name(tmp_path):
    """datasets' to_json writes JSON Lines with a .json suffix."""
    f = tmp_path / "lines.json"
    f.write_text("\n".join(json.dumps(r) for r in ALPACA) + "\n")
    assert [(r.line_no, r.row["response"]) for r in read_records([f])] == [(1, "5"), (2, "Red")]


@pytest.mark.parametrize("text, line, problem", [
    ('[\n{"prompt": "a", "response": "b"},\n3\n]', 3, "expected a JSON object, got int"),
    ('[\n{"prompt": "a", "response": "b"}\n{"prompt": "c"}\n]', 3, "invalid JSON (expected ',' or ']' between items)"),
    ('[\n{"prompt": "a", "response": }\n]', 2, "invalid JSON (Expecting value"),
    ('[{"prompt": "a", "response": "b"}]\n]', 2, "invalid JSON (text after the closing ']')"),
])
def test_bad_json_array_names_file_and_line(tmp_path, text, line, problem):
    f = tmp_path / "bad.json"
    f.write_text(text)
    with pytest.raises(UserError) as e:
        list(read_records([f]))
    assert str(e.value).startswith(f"{f}:{line}: {problem}"), str(e.value)


def test_sft_segments_from_alpaca_json(tmp_path):
    """The mapped rows go through the SFT tokenisation path unchanged (prompt/response keys)."""
    from transformers import AutoTokenizer

    from trinity.testing.tiny_assets import make_tiny_tokenizer

    tok = AutoTokenizer.from_pretrained(str(make_tiny_tokenizer(tmp_path / "tok")))
    f = write_json(tmp_path / "alpaca.json", ALPACA)
    record = next(iter(read_records([f])))
    segments = record_segments(record, tok, SFTKeys())
    assert segments[-1] == ("5" + tok.eos_token, True)  # loss on the alpaca output
    assert "Add the numbers.\n2 + 3" in segments[0][0] and segments[0][1] is False


def _job(train_files, write_job):
    return write_job({
        "model": {"path": str(HF_CONFIGS / "qwen2_5_0_5b")},
        "data": {"train_files": [str(f) for f in train_files], "seq_length": 512},
        "cluster": {"device": "cuda", "nproc_per_node": 8},
        "trainer": {"global_batch_size": 16},
    })


def test_validate_accepts_json_and_dataset_folders(tmp_path, write_job):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    datasets.Dataset.from_list(ALPACA).save_to_disk(str(folder))
    cfg = load_config(_job([write_json(tmp_path / "a.json", ALPACA), folder], write_job)).config
    assert cfg.data.train_files[1] == str(folder)


def test_validate_refuses_a_plain_folder(tmp_path, write_job):
    (tmp_path / "plain").mkdir()
    with pytest.raises(ConfigError) as e:
        load_config(_job([tmp_path / "plain"], write_job))
    assert any(p.startswith("data.train_files.0: ") and "is a directory but not a datasets folder" in p
               for p in e.value.problems), e.value.problems


def test_dataset_folder_and_dataset_dict_rows(tmp_path):
    datasets = pytest.importorskip("datasets")
    one = tmp_path / "one"
    datasets.Dataset.from_list(SHAREGPT + SHAREGPT).save_to_disk(str(one))
    records = list(read_records([one]))
    assert [r.where for r in records] == [f"{one}:1", f"{one}:2"]
    assert records[0].messages("messages")[1] == {"role": "user", "content": "What is 2 + 3?"}

    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ALPACA),
                          "test": datasets.Dataset.from_list(ALPACA[:1])}).save_to_disk(str(splits))
    assert [r.row["response"] for r in read_records([splits])] == ["5", "Red"]

    only_test = tmp_path / "only_test"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(ALPACA)}).save_to_disk(str(only_test))
    with pytest.raises(UserError, match=r"a DatasetDict without a 'train' split \(splits: \['test'\]\)"):
        list(read_records([only_test]))


def test_dataset_folder_without_the_datasets_package_is_one_line(tmp_path):
    """In a child process where `import datasets` fails: one line naming the folder and the pip command."""
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "state.json").write_text("{}")
    (folder / "dataset_info.json").write_text("{}")
    code = (
        "import sys; sys.modules['datasets'] = None\n"
        "from trinity.data.readers import read_records\n"
        "from trinity.errors import UserError\n"
        f"try:\n    list(read_records([{str(folder)!r}]))\n"
        "except UserError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == f"{folder}: a Hugging Face datasets folder; reading it needs the datasets package: pip install datasets", out
