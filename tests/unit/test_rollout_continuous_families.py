"""The continuous-batching engine across model families (CPU, fp32): QK-norm (qwen3), untied heads
(llama), megatron's submodules (the module path of MoE layers and TP > 1) against the static batch.
Apart from test_rollout_continuous.py: each case builds its own model and parallel state."""

from __future__ import annotations

import pytest

from tests.unit.test_rollout_continuous import PROMPTS, _eos_params, _same
from trinity.rollout.continuous import KVBudget, generate_continuous
from trinity.rollout.reference import reference_generate


@pytest.mark.parametrize("family,force_module", [("qwen3", False), ("llama", True), ("qwen3_moe", False)])
def test_families_and_module_path_equal_static(family, force_module, tmp_path, monkeypatch):
    """QK-norm (qwen3) and untied heads (llama) through the lean path; megatron's submodules (the module
    path: MoE layers, TP > 1) with per-row RoPE positions: the static batch's tokens and log-probs."""
    from tests.unit.test_rollout_decode import _tiny_gpt
    from trinity.rollout import continuous

    if force_module:
        monkeypatch.setattr("trinity.rollout.decode._lean_supported", lambda gpt: False)
    with _tiny_gpt(family, tmp_path) as (gpt, facts):
        prompts = [p for p in PROMPTS for _ in range(2)]
        params, _ = _eos_params(gpt, facts, prompts)
        want = reference_generate(gpt, prompts, params, vocab_size=facts.vocab_size, pad_id=0)
        dec = continuous.SlotDecoder(gpt, 2, 64)
        assert dec.lean == (family != "qwen3_moe" and not force_module)
        got = generate_continuous(gpt, prompts, params, vocab_size=facts.vocab_size, pad_id=0,
                                  budget=KVBudget(max_num_seqs=3))
        _same(got, want)
