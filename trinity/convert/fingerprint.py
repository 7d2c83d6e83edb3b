"""The identity of an HF folder's weights, in a module of its own: `trinity run` checks its conversion
cache with it before every launch, and importing `trinity.convert.dist_ckpt` (torch, megatron-core) for
that cost ~5.7 s of CPU in the CLI process of every job (py-spy, a 2-rank CPU job)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def source_fingerprint(hf_dir: str | Path) -> str:
    """Identity of an HF folder's weights and config (names, sizes, mtimes)."""
    h = hashlib.sha256()
    for f in sorted(Path(hf_dir).iterdir()):
        if f.is_file() and f.suffix in (".json", ".safetensors", ".bin"):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]
