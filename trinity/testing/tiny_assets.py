"""Locally made tiny assets for the quickstart and tests: tokenizer, arithmetic task, Qwen2 model (or a
tiny model of another supported family: `trinity tiny-assets --family NAME`).

Nothing here touches the network. The task ("12+7=" -> "19", "3-8=" -> "-5") is small enough for a
~0.6M-parameter model to learn on CPU in minutes, and has exact answers for RL rewards.

The tokenizer is Qwen2's byte-level BPE without merges (one token per UTF-8 byte, so one per ASCII
character, and digits stay single tokens) plus `<|endoftext|>` (EOS and padding), `<|im_start|>` and
`<|im_end|>`: 259 tokens. Its chat template is Qwen's without the default system prompt, to keep rows
short. It round-trips any UTF-8 text exactly.
"""

from __future__ import annotations

import functools
import json
import random
import shutil
from pathlib import Path
from typing import Any, Callable

from trinity.testing.tiny_models import FAMILIES, tiny_hf_config, tiny_hf_model

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Operands 0..20: the 4-layer quickstart model reaches ~95% exact answers after 500 SFT steps of 64
# samples (HF model, AdamW lr 3e-3, fp32 CPU, ~5 min on 2 busy cores); with 0..99 it is at ~19% after 1500 steps.
DEFAULT_MAX_OPERAND = 20
# Written last by make_quickstart_assets: its presence means the assets are complete.
COMPLETE_MARKER = "assets.json"


def make_tiny_tokenizer(out_dir: str | Path) -> Path:
    """Save a byte-level tokenizer without merges (one token per byte) into `out_dir`; returns out_dir.

    It is a transformers `Qwen2Tokenizer`: AutoTokenizer loads a qwen2 model folder's tokenizer with
    that class whatever tokenizer_config.json says, rebuilding the byte-level pipeline itself, so a
    tokenizer of any other shape would silently drop characters there.
    """
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte symbols
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(symbols))}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        extra_special_tokens=list(SPECIAL_TOKENS[1:]),
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    tokenizer.save_pretrained(str(out))
    return out


def arithmetic_problem(rng: random.Random, max_operand: int = DEFAULT_MAX_OPERAND) -> tuple[str, str]:
    """One problem: ("a+b=" or "a-b=", the exact answer as text)."""
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    if rng.random() < 0.5:
        return f"{a}+{b}=", str(a + b)
    return f"{a}-{b}=", str(a - b)


def _write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(out)
    return out


def write_sft_dataset(
    path: str | Path, n: int, seed: int, *, chat: bool = False, max_operand: int = DEFAULT_MAX_OPERAND
) -> Path:
    """n arithmetic SFT samples as jsonl: {"prompt", "response"}, or {"messages"} with `chat`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt, answer = arithmetic_problem(rng, max_operand)
        if chat:
            rows.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
        else:
            rows.append({"prompt": prompt, "response": answer})
    return _write_jsonl(path, rows)


def write_dpo_dataset(path: str | Path, n: int, seed: int, *, max_operand: int = DEFAULT_MAX_OPERAND) -> Path:
    """n DPO preference pairs as jsonl: the exact result is chosen over "no idea". Every second pair is in
    the conversational form (prompt and answers as chat messages), the others are plain strings."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt, answer = arithmetic_problem(rng, max_operand)
        if i % 2:
            rows.append({"prompt": [{"role": "user", "content": prompt}],
                         "chosen": [{"role": "assistant", "content": answer}],
                         "rejected": [{"role": "assistant", "content": "no idea"}]})
        else:
            rows.append({"prompt": prompt, "chosen": answer, "rejected": "no idea"})
    return _write_jsonl(path, rows)


def write_prompt_dataset(path: str | Path, n: int, seed: int, *, max_operand: int = DEFAULT_MAX_OPERAND) -> Path:
    """n arithmetic RL prompts as jsonl: {"prompt", "answer"} (answer is the exact result as text)."""
    rng = random.Random(seed)
    rows = [dict(zip(("prompt", "answer"), arithmetic_problem(rng, max_operand))) for _ in range(n)]
    return _write_jsonl(path, rows)


def make_tiny_qwen2(
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    *,
    seed: int = 0,
    num_layers: int = 4,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
) -> Path:
    """A random-init Qwen2ForCausalLM sized for the tiny tokenizer, saved (safetensors) with its tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
    config = Qwen2Config(
        vocab_size=-(-len(tokenizer) // 64) * 64,  # rounded up so TP splits evenly
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return _save_with_tokenizer(Qwen2ForCausalLM(config), tokenizer, out_dir)


def _save_with_tokenizer(model: Any, tokenizer: Any, out_dir: str | Path) -> Path:
    """Save `model` (safetensors) and `tokenizer` to out_dir; generation stops at either end marker: EOS
    after a plain response, <|im_end|> after a chat turn."""
    from transformers import GenerationConfig

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, im_end], pad_token_id=tokenizer.pad_token_id
    )
    out = Path(out_dir)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


QUICKSTART_FAMILY = "qwen2"
# Family name -> factory of its tiny transformers config (keyword overrides: vocabulary, sizes, token ids);
# every family trinity converts has one (tests/unit/test_data_tiny_assets.py checks).
TINY_FAMILY_CONFIGS: dict[str, Callable[..., Any]] = {
    name: functools.partial(tiny_hf_config, name) for name in FAMILIES
}


def make_tiny_family_model(out_dir: str | Path, tokenizer_dir: str | Path, family: str, *, seed: int = 0) -> Path:
    """A random-init model of `family` at the quickstart model's size, for the tiny tokenizer, saved with it
    (the quickstart's own Qwen2 for "qwen2"). The family's features stay on (e.g. Mistral's short window)."""
    if family == QUICKSTART_FAMILY:
        return make_tiny_qwen2(out_dir, tokenizer_dir, seed=seed)
    if family not in TINY_FAMILY_CONFIGS:
        raise ValueError(f"unknown family {family!r}; one of {sorted(TINY_FAMILY_CONFIGS)}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, head_dim=32)
    if "head_dim" in FAMILIES[family].defaults:  # DeepSeek's: the RoPE part of MLA's heads, its own
        del shape["head_dim"]
    config = TINY_FAMILY_CONFIGS[family](
        vocab_size=-(-len(tokenizer) // 64) * 64, **shape, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return _save_with_tokenizer(tiny_hf_model(config, seed=seed), tokenizer, out_dir)


def make_quickstart_assets(out_dir: str | Path, *, seed: int = 0, family: str = QUICKSTART_FAMILY) -> dict[str, Path]:
    """Tokenizer + tiny model (Qwen2, or `family`'s) in out_dir/model, arithmetic data in out_dir/data;
    returns their paths.

    Idempotent: when out_dir/assets.json (written last) records the same seed and task, nothing is
    redone. Each part is made
    in a temporary sibling and renamed into place, so an interrupted run leaves no half-written part.
    """
    out = Path(out_dir)
    paths = {
        "model": out / "model",
        "sft_train": out / "data" / "sft_train.jsonl",
        "sft_chat_train": out / "data" / "sft_chat_train.jsonl",
        "rl_prompts": out / "data" / "rl_prompts.jsonl",
    }
    marker = out / COMPLETE_MARKER
    recipe = {"seed": seed, "max_operand": DEFAULT_MAX_OPERAND, "family": family}
    if marker.is_file() and all(p.exists() for p in paths.values()):
        if {k: v for k, v in json.loads(marker.read_text()).items() if k in recipe} == recipe:
            return paths
    marker.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    tmp_model, tmp_tokenizer = out / "model.tmp", out / "tokenizer.tmp"
    for tmp in (tmp_model, tmp_tokenizer):
        shutil.rmtree(tmp, ignore_errors=True)
    make_tiny_family_model(tmp_model, make_tiny_tokenizer(tmp_tokenizer), family, seed=seed)
    shutil.rmtree(tmp_tokenizer)
    shutil.rmtree(paths["model"], ignore_errors=True)
    tmp_model.rename(paths["model"])
    write_sft_dataset(paths["sft_train"], 4000, seed)
    write_sft_dataset(paths["sft_chat_train"], 4000, seed, chat=True)
    write_prompt_dataset(paths["rl_prompts"], 1000, seed + 1)
    marker.write_text(json.dumps({**recipe, **{k: str(v) for k, v in paths.items()}}, indent=1) + "\n")
    return paths
