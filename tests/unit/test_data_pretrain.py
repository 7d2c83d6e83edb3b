"""Pre-training data (trinity.data.pretrain) without a model: sources, rows, blends, resume, config
forms, and the Megatron-LM tutorial command translated by docs/pretraining.md's table."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.conftest import HF_CONFIGS
from trinity.config.loader import load_config
from trinity.config.schema import DataConfig, JobConfig
from trinity.errors import ConfigError, UserError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from trinity.testing.tiny_assets import make_tiny_tokenizer

    return AutoTokenizer.from_pretrained(str(make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))))


def write_indexed(prefix: Path, docs: list[list[int]], dtype=np.uint16) -> Path:
    """A Megatron indexed dataset made with megatron-core's own builder."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for ids in docs:
        builder.add_item(torch.tensor(ids))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


def build(files, tok, **kw):
    from trinity.data.pretrain import build_pt_data

    args = dict(seq_len=16, global_batch_size=8, micro_batch_size=2, seed=0)
    return build_pt_data([str(f) for f in files], tok, **{**args, **kw})


# ------------------------------------------------------------------------------------------- config forms


@pytest.mark.parametrize("value", [
    [{"path": "a", "weight": 0.3}, {"path": "b", "weight": 0.7}],
    [0.3, "a", 0.7, "b"],
    ["0.3", "a", "0.7", "b"],
    "0.3 a 0.7 b",
])
def test_blend_forms_normalise_to_paths_and_weights(value):
    d = DataConfig(train_files=value)
    assert d.train_files == ["a", "b"] and d.train_weights == [0.3, 0.7]


def test_plain_paths_stay_plain_and_pt_concatenates_by_default():
    d = DataConfig(train_files=["x.jsonl", "y.jsonl"])
    assert d.train_files == ["x.jsonl", "y.jsonl"] and d.train_weights is None
    assert DataConfig(train_files="x.jsonl").train_files == ["x.jsonl"]
    base = {"model": {"path": "m"}}
    assert JobConfig.model_validate(base).data.packing is True  # sft
    assert JobConfig.model_validate({**base, "algorithm": {"name": "pt"}}).data.packing is False
    explicit = JobConfig.model_validate({**base, "algorithm": {"name": "pt"}, "data": {"packing": True}})
    assert explicit.data.packing is True
    pt = JobConfig.model_validate({**base, "algorithm": {"name": "pt"}})
    assert not pt.is_rl and not pt.needs_ref


@pytest.mark.parametrize("value, message", [
    ([0.3, "a", 0.7], "data.train_files: Megatron's form alternates weights and paths"),
    ([{"path": "a", "wieght": 2}], "data.train_files: entry 0 must be a mapping of `path`"),
    (["a", {"path": "b"}], "data.train_files: mixes paths and other entries"),
])
def test_malformed_blends_name_the_key(write_job, value, message):
    with pytest.raises(ConfigError) as e:
        load_config(write_job({"algorithm": {"name": "pt"}, "model": {"path": str(HF_CONFIGS / "qwen2_5_0_5b")},
                               "data": {"train_files": value}}), check_paths=False)
    assert any(p.startswith(message) for p in e.value.problems), e.value.problems


def test_rules_for_pt_sources(write_job, tmp_path):
    (tmp_path / "half.idx").write_bytes(b"")
    job = {"algorithm": {"name": "pt"}, "model": {"path": str(HF_CONFIGS / "qwen2_5_0_5b")},
           "data": {"train_files": [str(tmp_path / "c.bin"), str(tmp_path / "half"), str(tmp_path / "nope.txt")],
                    "train_weights": [1, 2]}}
    with pytest.raises(ConfigError) as e:
        load_config(write_job(job))
    problems = e.value.problems
    assert f"data.train_files.0: {tmp_path / 'c.bin'}: name a Megatron indexed dataset by its path prefix, without .bin/.idx ({tmp_path / 'c'})" in problems
    assert any(p.startswith(f"data.train_files.1: {tmp_path / 'half'} is not a readable file or a Megatron indexed "
                            f"dataset (only {tmp_path / 'half'}.idx exists)") for p in problems), problems
    assert f"data.train_files.2: {tmp_path / 'nope.txt'} does not exist" in problems
    assert "data.train_weights: 2 weights for 3 train_files; give one weight per file" in problems
    sft = {**job, "algorithm": {"name": "sft"}, "data": {"train_files": [0.5, "a.jsonl", 0.5, "b.jsonl"]}}
    with pytest.raises(ConfigError) as e:
        load_config(write_job(sft), check_paths=False)
    assert any(p.startswith("data.train_weights: blend weights apply to algorithm.name pt only, not sft")
               for p in e.value.problems), e.value.problems


# ------------------------------------------------------------------------------------------------ rows


def test_text_sources_concatenate_with_eos_and_rows_overlap_by_one(tok, tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ["hello", "", "world!"]))
    (tmp_path / "b.txt").write_text("line one\nline two\n")
    data = build([tmp_path / "a.jsonl", tmp_path / "b.txt"], tok, seq_len=4, global_batch_size=2, micro_batch_size=1,
                 shuffle=False)
    eos = tok.eos_token_id
    a, b = data.sources
    assert a.skipped == 1 and a.num_docs == 2 and b.num_docs == 1
    assert a.tokens.tolist() == tok("hello")["input_ids"] + [eos] + tok("world!")["input_ids"] + [eos]
    rows = data.source_rows[0].rows(np.arange(data.source_rows[0].num_rows))
    assert data.source_rows[0].num_rows == (len(a.tokens) - 1) // 4 == 3
    stream = a.tokens.tolist()
    for r in range(3):
        assert rows["tokens"][r].tolist() == stream[4 * r : 4 * r + 4]
        assert rows["labels"][r].tolist() == stream[4 * r + 1 : 4 * r + 5]
    assert rows["loss_mask"].sum() == 12 and (rows["doc_ids"] == 0).all()
    assert rows["position_ids"][2].tolist() == [0, 1, 2, 3]


def test_packing_keeps_documents_apart_and_splits_long_ones(tok, tmp_path):
    texts = ["ab", "cdefghijk", "lmn"]  # 3, 10 and 4 tokens with EOS; 10 splits into 8 + 2
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    data = build([tmp_path / "a.jsonl"], tok, seq_len=8, packing=True, global_batch_size=1, micro_batch_size=1)
    rows = data.source_rows[0].all_rows()
    assert sorted(rows["loss_mask"].sum(axis=1).tolist()) == sorted(data.source_rows[0].row_loss_tokens.tolist())
    assert int(rows["loss_mask"].sum()) == (3 - 1) + (8 - 1) + (2 - 1) + (4 - 1)
    eos = tok.eos_token_id
    for r in range(len(rows["tokens"])):
        ids = rows["doc_ids"][r]
        for j in range(7):
            if rows["loss_mask"][r, j]:  # a trained label is the next token of the same document
                assert ids[j] == ids[j + 1] and rows["labels"][r, j] == rows["tokens"][r, j + 1]
        starts = [j for j in range(8) if ids[j] >= 0 and (j == 0 or ids[j] != ids[j - 1])]
        assert all(rows["position_ids"][r, j] == 0 for j in starts)
    assert (rows["tokens"] == eos).sum() >= 3


# ---------------------------------------------------------------------------------------- indexed data


def test_indexed_dataset_gets_eos_only_where_missing_and_is_read_in_place(tok, tmp_path):
    eos = tok.eos_token_id
    docs = [tok("abc")["input_ids"], tok("de")["input_ids"] + [eos]]
    data = build([write_indexed(tmp_path / "mixed", docs)], tok, seq_len=2, global_batch_size=1, micro_batch_size=1)
    (src,) = data.sources
    assert src.tokens.tolist() == docs[0] + [eos] + docs[1]
    assert src.doc_starts.tolist() == [0, 4, 7]
    complete = write_indexed(tmp_path / "eod", [d + [eos] for d in (tok("abc")["input_ids"], tok("de")["input_ids"])])
    (src,) = build([complete], tok, seq_len=2, global_batch_size=1, micro_batch_size=1).sources
    assert not src.tokens.flags.owndata  # a view of megatron's memory map, not a copy
    assert src.tokens.tolist() == docs[0] + [eos] + docs[1]


def test_indexed_ids_outside_the_tokenizer_are_refused(tok, tmp_path):
    prefix = write_indexed(tmp_path / "other_tok", [[5, 6, 300, 7]])
    with pytest.raises(UserError) as e:
        build([prefix], tok, seq_len=2, global_batch_size=1, micro_batch_size=1)
    assert str(e.value).startswith(
        f"{prefix}: token id 300 is outside the job's tokenizer vocabulary ({len(tok)} tokens), so the dataset "
        "was tokenised with another tokenizer"
    )
    # The training ranks skip the scan (trinity run made it before launching): no error there.
    assert build([prefix], tok, seq_len=2, global_batch_size=1, micro_batch_size=1, check_vocab=False).num_rows == 2


# ------------------------------------------------------------------------------------ blends and resume


def _letter_sources(tmp_path: Path) -> list[Path]:
    """Source A (jsonl) holds 'a' and EOS tokens, B (txt) 'b' (and one final EOS): a row's source shows
    in its first token."""
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": "a" * 30}) + "\n" for _ in range(20)))
    (tmp_path / "b.txt").write_text("b" * 1200)
    return [tmp_path / "a.jsonl", tmp_path / "b.txt"]


def test_blend_draws_rows_in_proportion_to_the_weights(tok, tmp_path):
    files = _letter_sources(tmp_path)
    a_id, b_id = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")
    data = build(files, tok, weights=[1.0, 3.0])
    rows_a, rows_b = (r.num_rows for r in data.source_rows)
    assert (rows_a, rows_b) == ((20 * 31 - 1) // 16, 1200 // 16)  # 38 and 75 rows of 16 tokens
    assert data.counts == [28, 85]  # 113 slots per epoch split 1:3 (28.25, 84.75)
    per_step = []  # rows of A in each step
    for _ in range(3 * data.steps_per_epoch):
        firsts = np.concatenate([m["tokens"][:, 0].numpy() for m in data.next_global_batch()])
        assert set(firsts.tolist()) <= {a_id, b_id, tok.eos_token_id}  # B's rows all start with 'b'
        per_step.append(int((firsts != b_id).sum()))
    share = sum(per_step) / (8 * len(per_step))
    assert share == pytest.approx(0.25, abs=0.02), share
    # every stretch of 4 steps (32 rows) stays close to 1:3: the slots interleave, they are not in blocks
    for i in range(0, len(per_step) - 3, 4):
        assert 4 <= sum(per_step[i : i + 4]) <= 12, per_step
    # A is down-weighted (28 of its 38 rows per epoch): epoch 1 continues where epoch 0 stopped.
    slots_a = np.flatnonzero(data.slot_source == 0)
    e0 = set(data.source_rows_of(slots_a, 0)[1].tolist())
    e1 = set(data.source_rows_of(slots_a, 1)[1].tolist())
    assert len(e0) == 28 and e0 | e1 == set(range(rows_a))


def test_unweighted_sources_use_every_row_once_per_epoch(tok, tmp_path):
    data = build(_letter_sources(tmp_path), tok)
    assert data.counts == [r.num_rows for r in data.source_rows]
    epoch = data.sampler.epoch_order(0)
    src, rows = data.source_rows_of(epoch, 0)
    pairs = set(zip(src.tolist(), rows.tolist()))
    assert len(pairs) == data.num_rows


def test_resume_continues_with_the_same_rows_on_any_dp_size(tok, tmp_path):
    files = _letter_sources(tmp_path)
    first = build(files, tok, weights=[1, 3])
    for _ in range(3):
        first.next_global_batch()
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints keep it as JSON
    expected = [first.next_global_batch() for _ in range(20)]  # crosses into epoch 2

    ranks = [build(files, tok, weights=[1, 3], dp_rank=r, dp_size=2) for r in range(2)]
    for d in ranks:
        d.load_state_dict(state)
    for step, want in enumerate(expected):
        got = [m for d in ranks for m in d.next_global_batch()]
        assert sum(d.last_step_loss_tokens for d in ranks) == 2 * 8 * 16
        for key in ("tokens", "labels", "position_ids"):
            assert np.array_equal(np.concatenate([m[key].numpy() for m in got]),
                                  np.concatenate([m[key].numpy() for m in want])), (step, key)

    other = build(files, tok, weights=[1, 1])
    with pytest.raises(UserError, match="cannot resume the data order: the checkpoint drew"):
        other.load_state_dict(state)


# --------------------------------------------------------------------------- the Megatron-LM tutorial


def _doc_job_yaml() -> str:
    text = (REPO / "docs" / "pretraining.md").read_text()
    section = text[text.index("## From Megatron-LM") :]
    return re.search(r"```yaml\n(.*?)```", section, re.S).group(1)


def test_the_tutorial_command_translated_by_the_docs_validates(tmp_path, monkeypatch, capsys):
    """The job file of docs/pretraining.md, as written, next to a Qwen2.5-7B folder (its config.json,
    a small stand-in tokenizer) and a Megatron dataset `my_dataset_text_document` made with that tokenizer."""
    from trinity.cli.commands import validate
    from trinity.testing.tiny_assets import make_tiny_tokenizer

    model = tmp_path / "Qwen2.5-7B"
    make_tiny_tokenizer(model)
    shutil.copy(HF_CONFIGS / "qwen2_5_7b" / "config.json", model / "config.json")
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 259, size=int(n)).tolist() for n in rng.integers(500, 1500, size=300)]
    write_indexed(tmp_path / "my_dataset_text_document", docs)
    (tmp_path / "pt_qwen2_5_7b.yaml").write_text(_doc_job_yaml())
    monkeypatch.chdir(tmp_path)

    assert validate(Path("pt_qwen2_5_7b.yaml"), [], json_out=True) == 0
    plan = json.loads(capsys.readouterr().out)
    (role,) = plan["roles"]
    assert plan["algorithm"] == "pt" and plan["world_size"] == 16
    assert role["layout"].startswith("TP=4 PP=2 CP=1 DP=2") and role["microbatches"] == 32
    data = plan["data"]
    tokens = sum(len(d) + 1 for d in docs)  # + the EOS each document gets
    assert data["tokens"] == tokens and data["seq_length"] == 4096 and data["packing"] is False
    assert data["rows_per_epoch"] == (tokens - 1) // 4096
    assert data["steps_per_epoch"] == data["rows_per_epoch"] // 64 and data["total_steps"] == 100000
    cfg = load_config(Path("pt_qwen2_5_7b.yaml")).config
    optim = cfg.actor_rollout_ref.actor.optim
    assert (optim.lr, optim.min_lr, optim.lr_scheduler) == (1.5e-4, 1.5e-5, "cosine")
    assert (cfg.trainer.save_interval, cfg.trainer.log_interval, cfg.model.dtype) == (1000, 10, "bf16")
    assert yaml.safe_load(_doc_job_yaml())["cluster"]["master_port"] == 6000
