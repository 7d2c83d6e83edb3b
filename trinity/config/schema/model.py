"""The `model:` block: the Hugging Face model to fine-tune."""

from __future__ import annotations

from typing import Literal

from trinity.config.megatron import StrictModel


class ModelConfig(StrictModel):
    """The Hugging Face model to fine-tune."""

    path: str
    """Local folder of an HF causal-LM checkpoint (config.json + safetensors + tokenizer files), or a
    Hugging Face hub id such as `Qwen/Qwen2.5-0.5B-Instruct` (resolved once, at validation, through
    huggingface_hub's cache: HF_HUB_CACHE / HF_HOME; with HF_HUB_OFFLINE=1 only the cache is read)."""
    tokenizer_path: str | None = None
    """Tokenizer folder (or hub id, as model.path); unset means model.path."""
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Training dtype: auto is bf16 on cuda and fp32 on cpu."""
