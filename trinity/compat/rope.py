"""megatron-core's fused-RoPE entry points on trinity's kernel without TE: unfused RoPE took ~5 of a 110 ms 0.5B step (H200).

megatron-core 0.16.1 applies RoPE fused only through `rope_utils.fused_apply_rotary_pos_emb`, TransformerEngine's
kernel, which is None without TE. `install(kernel, thd)` plugs in `trinity.models.rope.fused_rope` (the kernel,
TE's signature) and, for packed (thd) inputs, a function that says why they need TE. `install_cp_pos_emb`
replaces megatron's slicing of the rotary table per context-parallel rank, which pins host memory.
"""

from __future__ import annotations

from typing import Callable

from trinity.compat.checks import require


def install(kernel: Callable[..., object], thd: Callable[..., object]) -> bool:
    """Make `kernel` megatron's fused RoPE when TransformerEngine's is absent. Returns whether megatron now
    has a fused RoPE (TE's or ours)."""
    from megatron.core.models.common.embeddings import rope_utils

    require("rope", rope_utils, "fused_apply_rotary_pos_emb", "fused_apply_rotary_pos_emb_thd")
    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = kernel
    if rope_utils.fused_apply_rotary_pos_emb_thd is None:  # fused mode routes thd here; say why it fails
        rope_utils.fused_apply_rotary_pos_emb_thd = thd
    return rope_utils.fused_apply_rotary_pos_emb is not None


def install_cp_pos_emb(split: Callable[..., object]) -> None:
    """`split` as megatron's `get_pos_emb_on_this_cp_rank` where RoPE and YaRN call it at CP>1: megatron's
    own builds its chunk index in pinned host memory and copies it with `.cuda()`, which a CPU-only torch
    refuses (and which costs a host copy per new table on GPUs). `split` takes the same arguments."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding

    for module in (rotary_pos_embedding, yarn_rotary_pos_embedding):
        require("rope", module, "get_pos_emb_on_this_cp_rank")
        module.get_pos_emb_on_this_cp_rank = split
