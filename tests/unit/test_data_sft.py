"""SFT tokenisation: loss exactly on response / assistant tokens, truncation policy, speed."""

from __future__ import annotations

import copy
import json
import time

import pytest
from transformers import AutoTokenizer

from trinity.data.readers import Record, read_records
from trinity.data.sft import Overlength, SFTKeys, render_prompt, tokenize_sft
from trinity.errors import UserError
from trinity.testing.tiny_assets import make_tiny_tokenizer, write_sft_dataset


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(str(make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))))


def rec(row: dict, line: int = 1) -> Record:
    from pathlib import Path

    return Record(Path("mem.jsonl"), line, row)


def split(tokenizer, sample) -> tuple[str, str]:
    """(text of the untrained tokens, text of the trained tokens)."""
    ids, mask = sample.input_ids, sample.loss_mask
    return (
        tokenizer.decode([t for t, m in zip(ids, mask) if not m]),
        tokenizer.decode([t for t, m in zip(ids, mask) if m]),
    )


def test_prompt_response_loss_is_exactly_response_and_eos(tokenizer):
    (sample,), stats = tokenize_sft([rec({"prompt": "12+7=", "response": "19"})], tokenizer, max_seq_len=64)
    prompt_ids = tokenizer(render_prompt(tokenizer, "12+7="), add_special_tokens=False)["input_ids"]
    response_ids = tokenizer("19", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert sample.input_ids == prompt_ids + response_ids
    assert sample.loss_mask == [0] * len(prompt_ids) + [1] * len(response_ids)
    assert split(tokenizer, sample) == ("<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n", "19<|endoftext|>")
    assert (stats.samples, stats.tokens, stats.loss_tokens) == (1, len(sample), 3)


def test_chat_messages_loss_on_every_assistant_turn(tokenizer):
    chat = [
        {"role": "system", "content": "Add."},
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+3="},
        {"role": "assistant", "content": "5"},
    ]
    (sample,), _ = tokenize_sft([rec({"messages": chat})], tokenizer, max_seq_len=256)
    full = tokenizer.apply_chat_template(chat, tokenize=False)
    assert tokenizer.decode(sample.input_ids) == full
    mask_runs = "".join(str(m) for m in sample.loss_mask)
    assert mask_runs.count("01") == 2  # two trained spans
    untrained, trained = split(tokenizer, sample)
    assert trained == "2<|im_end|>\n5<|im_end|>\n"
    assert untrained == (
        "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
        "<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n"
    )


def test_messages_win_over_prompt_and_custom_keys(tokenizer):
    keys = SFTKeys(prompt_key="q", response_key="a", messages_key="conv")
    rows = [
        {"q": "3+4=", "a": "7"},
        {"q": "ignored", "a": "ignored", "conv": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
    ]
    samples, _ = tokenize_sft([rec(r, i) for i, r in enumerate(rows, 1)], tokenizer, max_seq_len=64, keys=keys)
    assert split(tokenizer, samples[0])[1] == "7<|endoftext|>"
    assert split(tokenizer, samples[1])[1] == "y<|im_end|>\n"


def test_without_chat_template_prompt_is_raw_text(tokenizer):
    raw = copy.deepcopy(tokenizer)
    raw.chat_template = None
    (sample,), _ = tokenize_sft([rec({"prompt": "12+7=", "response": "19"})], raw, max_seq_len=64)
    assert split(raw, sample) == ("12+7=", "19<|endoftext|>")
    with pytest.raises(UserError, match="mem.jsonl:1: chat messages need a tokenizer with a chat template"):
        tokenize_sft([rec({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})], raw, max_seq_len=64)


def test_template_that_rewrites_history_is_refused(tokenizer):
    odd = copy.deepcopy(tokenizer)
    # Renders the number of messages first, so adding a turn changes earlier text.
    odd.chat_template = "{{ messages|length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(UserError, match="mem.jsonl:4: the tokenizer's chat template rewrites earlier turns"):
        tokenize_sft([rec({"messages": chat}, 4)], odd, max_seq_len=64)


def test_truncate_and_drop_are_counted(tokenizer):
    rows = [
        {"prompt": "1+1=", "response": "2"},  # 25 tokens
        {"prompt": "1+1=", "response": "2" * 30},  # 54: truncation keeps some response
        {"prompt": "9" * 60, "response": "2"},  # prompt alone exceeds the limit: nothing to train on
    ]
    records = [rec(r, i) for i, r in enumerate(rows, 1)]
    samples, stats = tokenize_sft(records, tokenizer, max_seq_len=40, overlength=Overlength.truncate)
    assert [len(s) for s in samples] == [25, 40]
    assert (stats.samples, stats.truncated, stats.dropped) == (2, 1, 1)
    assert samples[1].loss_mask[-1] == 1 and sum(samples[1].loss_mask) == 40 - 23  # 23 prompt tokens
    samples, stats = tokenize_sft(records, tokenizer, max_seq_len=40, overlength=Overlength.drop)
    assert [len(s) for s in samples] == [25]
    assert (stats.samples, stats.truncated, stats.dropped) == (1, 0, 2)


def test_ten_thousand_samples_tokenise_in_seconds(tokenizer, tmp_path):
    f = write_sft_dataset(tmp_path / "sft.jsonl", 10_000, seed=3)
    start = time.perf_counter()
    samples, stats = tokenize_sft(read_records([f]), tokenizer, max_seq_len=64)
    elapsed = time.perf_counter() - start
    assert stats.samples == 10_000 and stats.dropped == 0
    first = json.loads(f.read_text().splitlines()[0])
    assert split(tokenizer, samples[0])[1] == first["response"] + "<|endoftext|>"
    assert elapsed < 20, f"tokenising 10k samples took {elapsed:.1f} s"


def test_raw_prompt_gets_the_bos_the_tokenizer_would_add():
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate("0123456789+-=")}}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>")
    (sample,), _ = tokenize_sft([rec({"prompt": "1+2=", "response": "3"})], tok, max_seq_len=16)
    assert sample.input_ids == tok("1+2=")["input_ids"] + [vocab["3"], vocab["</s>"]]
    assert sample.loss_mask == [0, 0, 0, 0, 0, 1, 1]


def test_raw_text_gets_the_bos_its_tokenizer_adds(tmp_path):
    """`with_bos` (raw prompts of `trinity generate`, SFT and RL): a tokenizer that adds a BOS (Gemma's
    <bos>; here the tiny tokenizer with a BOS post-processor) gets it as text, one that adds none nothing."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from trinity.data.sft import tokenize_texts, with_bos
    from trinity.testing.tiny_assets import make_tiny_tokenizer

    tok = AutoTokenizer.from_pretrained(str(make_tiny_tokenizer(tmp_path / "tok")))
    assert with_bos(tok, "hi") == "hi"
    tok.bos_token = tok.eos_token
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, tok.bos_token_id)])
    plain = tokenize_texts(tok, ["hi"])[0]
    assert tokenize_texts(tok, [with_bos(tok, "hi")]) == [[tok.bos_token_id, *plain]]
