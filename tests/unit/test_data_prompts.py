"""RL prompts: rendered like SFT prompts, left-truncated, answers kept, batches sharded over DP."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from trinity.data.prompts import build_prompt_data
from trinity.data.sft import render_prompt
from trinity.errors import UserError
from trinity.testing.tiny_assets import make_tiny_tokenizer, write_prompt_dataset


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(str(make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))))


def test_prompts_are_rendered_for_generation_and_left_truncated(tmp_path, tokenizer):
    f = tmp_path / "rl.jsonl"
    rows = [
        {"question": "12+7=", "gt": 19},
        {"question": "9" * 40 + "+1=", "gt": "1" + "0" * 40},
        {"chat": [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+2="}], "gt": "4"},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = build_prompt_data(
        [f], tokenizer, batch_size=3, max_prompt_length=40, seed=0, shuffle=False,
        prompt_key="question", messages_key="chat", answer_key="gt",
    )
    first, long, chat = data.next_batch()
    assert first.prompt_ids == tokenizer(render_prompt(tokenizer, "12+7="), add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(first.prompt_ids) == "<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n"
    assert first.answer == "19" and first.source == f"{f}:1"
    assert len(long.prompt_ids) == 40 and tokenizer.decode(long.prompt_ids).endswith("9+1=<|im_end|>\n<|im_start|>assistant\n")
    assert data.truncated == 1
    assert tokenizer.decode(chat.prompt_ids) == "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"


def test_prompt_batches_shard_over_dp_and_resume(tmp_path, tokenizer):
    f = write_prompt_dataset(tmp_path / "rl.jsonl", 40, seed=2)
    ranks = [build_prompt_data([f], tokenizer, batch_size=8, max_prompt_length=64, seed=4, dp_rank=r, dp_size=2) for r in range(2)]
    one = build_prompt_data([f], tokenizer, batch_size=8, max_prompt_length=64, seed=4)
    for _ in range(7):  # 5 steps per epoch: crosses an epoch
        expected = [p.source for p in one.next_batch()]
        got = [[p.source for p in r.next_batch()] for r in ranks]
        assert len(got[0]) == 4 and got[0] + got[1] == expected
    resumed = build_prompt_data([f], tokenizer, batch_size=8, max_prompt_length=64, seed=4)
    resumed.load_state_dict(one.state_dict())
    assert [p.source for p in resumed.next_batch()] == [p.source for p in one.next_batch()]
    with pytest.raises(UserError, match=r"data.train_batch_size \(7\) must be a multiple of the data-parallel size \(2\)"):
        build_prompt_data([f], tokenizer, batch_size=7, max_prompt_length=64, seed=4, dp_size=2)
