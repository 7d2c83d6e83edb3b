"""Tiny local assets: tokenizer round trip, correct arithmetic data, quickstart model loads and runs."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trinity.data.loader import build_sft_data
from trinity.data.prompts import build_prompt_data
from trinity.testing.tiny_assets import make_quickstart_assets, make_tiny_tokenizer, write_prompt_dataset, write_sft_dataset


def test_tokenizer_round_trips_text_and_chat(tmp_path):
    tok = AutoTokenizer.from_pretrained(str(make_tiny_tokenizer(tmp_path / "tok")))
    assert len(tok) == 259
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    for text in ["0123456789+-=", "12+7=19", " 3 - 8 = -5\n\t", "Grüße, 日本!"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    digits = tok("1234", add_special_tokens=False)["input_ids"]
    assert len(digits) == 4, "one token per digit"
    chat = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    text = tok.apply_chat_template(chat, tokenize=False)
    assert text == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n3<|im_end|>\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(1) == 2 and ids.count(2) == 2 and tok.decode(ids) == text


def check_arithmetic(prompt: str, answer: str) -> None:
    assert prompt.endswith("=")
    a, op, b = (prompt[:-1].partition("+") if "+" in prompt else prompt[:-1].partition("-"))
    assert int(answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_task_datasets_are_correct_and_seeded(tmp_path):
    sft = [json.loads(x) for x in write_sft_dataset(tmp_path / "s.jsonl", 200, seed=1).read_text().splitlines()]
    chat = [json.loads(x) for x in write_sft_dataset(tmp_path / "c.jsonl", 200, seed=1, chat=True).read_text().splitlines()]
    rl = [json.loads(x) for x in write_prompt_dataset(tmp_path / "p.jsonl", 200, seed=2).read_text().splitlines()]
    for row, conv in zip(sft, chat):
        check_arithmetic(row["prompt"], row["response"])
        assert conv["messages"] == [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]
    for row in rl:
        check_arithmetic(row["prompt"], row["answer"])
    assert {"+", "-"} <= {c for r in sft for c in r["prompt"]}
    again = write_sft_dataset(tmp_path / "s2.jsonl", 200, seed=1).read_text()
    assert again == (tmp_path / "s.jsonl").read_text()


def test_quickstart_assets_load_run_and_are_idempotent(tmp_path):
    paths = make_quickstart_assets(tmp_path / "qs", seed=0)
    assert set(paths) == {"model", "sft_train", "sft_chat_train", "rl_prompts"}
    tok = AutoTokenizer.from_pretrained(str(paths["model"]))
    model = AutoModelForCausalLM.from_pretrained(str(paths["model"]))
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.vocab_size % 64 == 0 and model.config.vocab_size >= len(tok)
    assert (paths["model"] / "model.safetensors").is_file()
    assert model.generation_config.eos_token_id == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    text = "<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n19<|endoftext|>"
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert tok.decode(ids[0]) == text
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size) and torch.isfinite(logits).all()

    # The data files feed the pipeline as they are.
    sft = build_sft_data([paths["sft_train"]], paths["model"], seq_len=128, packing=True, global_batch_size=8, micro_batch_size=4, seed=0)
    chat = build_sft_data([paths["sft_chat_train"]], paths["model"], seq_len=128, packing=True, global_batch_size=8, micro_batch_size=4, seed=0)
    rl = build_prompt_data([paths["rl_prompts"]], paths["model"], batch_size=8, max_prompt_length=64, seed=0)
    assert sft.stats.samples == chat.stats.samples == 4000 and sft.stats.truncated == 0
    assert rl.num_prompts == 1000 and rl.truncated == 0

    stamp = {p: p.stat().st_mtime_ns for p in [paths["model"] / "model.safetensors", paths["sft_train"]]}
    assert make_quickstart_assets(tmp_path / "qs", seed=0) == paths
    assert {p: p.stat().st_mtime_ns for p in stamp} == stamp, "a second call must not rewrite"


def test_quickstart_assets_rebuild_when_incomplete(tmp_path):
    out = tmp_path / "qs"
    paths = make_quickstart_assets(out, seed=0)
    (out / "assets.json").unlink()  # as if interrupted before the end
    paths["sft_train"].write_text("garbage\n")
    assert make_quickstart_assets(out, seed=0) == paths
    assert json.loads(paths["sft_train"].read_text().splitlines()[0]).keys() == {"prompt", "response"}
    assert not (out / "model.tmp").exists() and not (out / "tokenizer.tmp").exists()


def test_job_config_builds_sft_and_prompt_data(tmp_path):
    from trinity.config.schema import JobConfig
    from trinity.data.loader import sft_data_from_job
    from trinity.data.prompts import prompt_data_from_job

    paths = make_quickstart_assets(tmp_path / "qs")
    job = JobConfig.model_validate(
        {
            "model": {"path": str(paths["model"])},
            "data": {"train_files": [str(paths["sft_chat_train"])], "seq_length": 64, "packing": False, "train_batch_size": 4},
            "trainer": {"global_batch_size": 8, "micro_batch_size": 2, "seed": 3},
        }
    )
    sft = sft_data_from_job(job, dp_rank=1, dp_size=2)
    assert sft.num_rows == 4000 and sft.seq_len == 64 and sft.sampler.seed == 3
    assert [m["tokens"].shape for m in sft.next_global_batch()] == [(2, 64), (2, 64)]
    rl_job = job.model_copy(update={"data": job.data.model_copy(update={"train_files": [str(paths["rl_prompts"])]})})
    rl = prompt_data_from_job(rl_job, dp_rank=0, dp_size=2)
    assert rl.num_prompts == 1000 and len(rl.next_batch()) == 2


def test_every_converted_family_has_a_tiny_model_for_the_tiny_tokenizer(tmp_path):
    """`trinity tiny-assets --family NAME`: each family's tiny model is of its own architecture, covers the
    tokenizer and converts (ModelFacts reads it); an unknown name is refused naming the option."""
    from trinity.cli.commands import tiny_assets
    from trinity.convert.registry import WEIGHT_MAPS
    from trinity.errors import UserError
    from trinity.models.facts import SUPPORTED_ARCHITECTURES, ModelFacts
    from trinity.testing.tiny_assets import TINY_FAMILY_CONFIGS, make_tiny_family_model

    assert set(TINY_FAMILY_CONFIGS) == set(WEIGHT_MAPS)
    tok_dir = make_tiny_tokenizer(tmp_path / "tok")
    for family in sorted(set(TINY_FAMILY_CONFIGS) - {"qwen2"}):  # qwen2: the quickstart test above
        facts = ModelFacts.from_hf_dir(make_tiny_family_model(tmp_path / family, tok_dir, family))
        assert SUPPORTED_ARCHITECTURES[facts.architecture].family == family
        assert facts.vocab_size >= 259 and (tmp_path / family / "tokenizer_config.json").is_file()
    with pytest.raises(UserError, match="tiny-assets --family: 'gpt2' is not one of"):
        tiny_assets(tmp_path / "out", family="gpt2")
