"""Checks that a conversion kept the model: logits against transformers, tensors bit for bit."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from trinity.convert.hf_io import HFCheckpoint
from trinity.errors import UserError

# Max |logit difference| accepted when both sides compute in fp32 from the same (rounded) weights.
TOLERANCE = 1e-4


@dataclass(frozen=True)
class Diff:
    max_abs: float
    mean_abs: float


def causal_mask(seq: int) -> torch.Tensor:
    """megatron-core's convention: True = masked out. Explicit, because the default builds it on cuda."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


def mcore_logits(model: torch.nn.Module, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits of a single-stage (PP=1, TP=1) GPTModel, fp32, padded vocab rows stripped."""
    b, s = tokens.shape
    device = next(model.parameters()).device
    pos = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    with torch.no_grad():
        out = model(tokens.to(device), pos, causal_mask(s).to(device))
    return out[..., :vocab_size].float().cpu()


def hf_logits(hf_dir: str | Path, tokens: torch.Tensor, round_to: torch.dtype | None = None) -> torch.Tensor:
    """Logits of the transformers model in fp32; `round_to` first rounds its weights to that dtype,
    so that a bf16 conversion is compared with the same weights, not with rounding noise."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, trust_remote_code=False)
    model.eval()
    if round_to is not None and round_to != torch.float32:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(round_to).float())
    with torch.no_grad():
        return model(tokens).logits.float()


def compare_logits(a: torch.Tensor, b: torch.Tensor, *, what: str, tolerance: float = TOLERANCE) -> Diff:
    """Max/mean |a - b|; UserError if above `tolerance`."""
    if a.shape != b.shape:
        raise UserError(f"{what}: logits shapes differ {list(a.shape)} vs {list(b.shape)}")
    d = (a - b).abs()
    diff = Diff(float(d.max()), float(d.mean()))
    if not diff.max_abs <= tolerance:
        raise UserError(
            f"{what}: verification failed, max |Δlogits| {diff.max_abs:.3e} > tolerance {tolerance:.0e} "
            f"(mean {diff.mean_abs:.3e})"
        )
    return diff


def random_tokens(vocab_size: int, *, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=g)


def compare_folders(written: str | Path, reference: str | Path, *, what: str) -> Diff:
    """Every tensor of `written` equals `reference`'s bit for bit, with the same names (streamed)."""
    a, b = HFCheckpoint(written), HFCheckpoint(reference)
    names_a, names_b = set(a.names()), set(b.names())
    if names_a != names_b:
        extra = sorted(names_a - names_b)[:3]
        lost = sorted(names_b - names_a)[:3]
        raise UserError(f"{what}: tensor names differ (only in output: {extra}, only in source: {lost})")
    try:
        for name in sorted(names_a):
            x, y = a.get(name), b.get(name)
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                d = float((x.float() - y.float()).abs().max()) if x.shape == y.shape else float("inf")
                raise UserError(f"{what}: tensor {name!r} differs from the source (max |Δ| {d:.3e})")
    finally:
        a.close()
        b.close()
    return Diff(0.0, 0.0)
