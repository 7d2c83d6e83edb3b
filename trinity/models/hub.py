"""Hugging Face hub ids as model.path / model.tokenizer_path, resolved to a local snapshot folder once,
when the config is loaded (`trinity validate`, `trinity run` and every worker read the same folder).

A value that is an existing path stays as it is. A value shaped like a hub id (`org/name`, not a
path on disk) is looked up in huggingface_hub's cache (HF_HUB_CACHE, else HF_HOME/hub); when it is not
there and HF_HUB_OFFLINE is not set, it is downloaded into that cache (weights, configs and tokenizer
files only).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from trinity.errors import UserError

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# What a training job reads from a model repo: configs, safetensors weights, tokenizer and chat template.
_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"]


def looks_like_hub_id(value: str) -> bool:
    """`org/name` that is not a path on disk (a local folder always wins)."""
    return bool(_HUB_ID.match(value)) and not Path(value).exists() and ".." not in value


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_model_path(value: str) -> str:
    """The local folder for `value`: itself when it is a path, the cached (or downloaded) snapshot of a
    hub id. Raises UserError (one line) when a hub id cannot be had."""
    if not looks_like_hub_id(value):
        return value
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise UserError(f"{value} is not a local folder, and huggingface_hub (which resolves hub ids) is "
                        "not installed; pass a local folder or run `pip install huggingface_hub`") from None
    # huggingface_hub reads these variables when it is imported: read them at call time instead.
    cache_dir = os.environ.get("HF_HUB_CACHE") or None
    offline = _offline()
    try:
        return snapshot_download(value, cache_dir=cache_dir, local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the cache (LocalEntryNotFoundError and friends)
        pass
    if not offline:
        try:
            return snapshot_download(value, cache_dir=cache_dir, allow_patterns=_PATTERNS)
        except Exception as exc:  # noqa: BLE001 - no network, unknown repo, gated repo: one line for all
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(
                f"{value} is not a local folder and could not be downloaded from the Hugging Face hub "
                f"({reason}); pass a local folder, or set HF_HUB_OFFLINE=1 with a warm cache (HF_HUB_CACHE)"
            ) from None
    where = cache_dir or "the default cache (HF_HOME/hub)"
    raise UserError(
        f"{value} is not a local folder and not in the Hugging Face cache ({where}) while HF_HUB_OFFLINE is set; "
        "pass a local folder, or set HF_HUB_OFFLINE with a warm cache (HF_HUB_CACHE pointing at it)"
    )
