"""Gemma 2 and Gemma 3 (text) end to end on tiny models (CPU, fp32): the rollout engine's decoders against
HF generate, training, refusals. Conversion (logits, round trip) is in test_convert_roundtrip.py, TP/PP
logits in test_models_tp2.py.

The tiny models (trinity.testing.tiny_models) turn every feature on where it bites: sliding windows of 4
keys (shorter than prompt + response), soft caps of a few units, query_pre_attn_scalar unlike head_dim,
Gemma 3's local RoPE base and linear scaling on global layers."""

from __future__ import annotations

import json

import pytest
import torch

from trinity.errors import UserError
from trinity.models.facts import ModelFacts
from trinity.rollout.reference import reference_generate
from trinity.rollout.types import SamplingParams

pytestmark = pytest.mark.timeout(180)

GEMMA = ["gemma2", "gemma3"]
# prompts of different lengths (left padding in the static batch), the longest past the window
PROMPTS = [[5, 9, 17, 3, 44, 2, 8, 11], [7, 1], [100, 12, 8, 60]]
NEW = 8


@pytest.mark.parametrize("family", GEMMA)
def test_greedy_static_and_continuous_equal_hf_generate(family, tmp_path):
    """Static batch (KV cache and full forwards) and the continuous engine give HF's greedy tokens: the
    window over the cache, the capped scores, sandwich norms, embedding scale and capped logits of the
    decoders' module path."""
    from transformers import AutoModelForCausalLM

    from tests.unit.test_rollout_decode import _tiny_gpt
    from trinity.rollout.continuous import KVBudget, generate_continuous

    with _tiny_gpt(family, tmp_path) as (gpt, facts):
        params = SamplingParams(temperature=0.0, max_new_tokens=NEW)
        static = reference_generate(gpt, PROMPTS, params, vocab_size=facts.vocab_size, pad_id=0)
        full = reference_generate(gpt, PROMPTS, params, vocab_size=facts.vocab_size, pad_id=0, use_cache=False)
        cont = generate_continuous(gpt, PROMPTS, params, vocab_size=facts.vocab_size, pad_id=0,
                                   budget=KVBudget(max_num_seqs=2))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    for i, p in enumerate(PROMPTS):
        want = hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist()
        assert static.responses[i].tolist() == want, i
        assert full.responses[i].tolist() == want, i
        assert cont.responses[i].tolist() == want, i
    assert (static.logprobs - full.logprobs).abs().max().item() <= 1e-5
    assert (static.logprobs - cont.logprobs).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", GEMMA)
def test_training_lowers_the_loss_and_peft_adapters_give_our_logits(family, tmp_path):
    """Three Adam steps through megatron's schedule and optimizer lower the loss (gradients through the
    capped attention, sandwich norms and capped logits); LoRA on the HF target names, saved as a PEFT
    folder, gives PEFT-on-transformers the logits of our adapted model."""
    from types import SimpleNamespace

    from tests.integration.test_models_cpu_compat import train_steps
    from tests.unit.test_lora_peft import TOKENS, _peft_logits, _randomise
    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.build import build_model, causal_mask
    from trinity.models.lora import apply_lora
    from trinity.convert.peft_io import save_peft_folder
    from trinity.testing.tiny_models import make_tiny_hf_model

    hf_dir = make_tiny_hf_model(family, tmp_path / "hf", tie_word_embeddings=True)
    facts = ModelFacts.from_hf_dir(hf_dir)
    init_parallel(device="cpu", layout=ParallelLayout(), seed=4)
    try:
        losses = [loss for loss, _ in train_steps(hf_dir, distributed_optimizer=False)]
        assert losses[2] < losses[1] < losses[0], losses
        chunks = build_model(facts, MegatronConfig(), device="cpu", dtype=torch.float32)
        load_hf_weights(chunks, hf_dir, facts)
        lora = SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "o_proj", "up_proj", "down_proj"])
        apply_lora(chunks, lora)
        _randomise(chunks)
        pos = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
        with torch.no_grad():
            ours = chunks[0](TOKENS, pos, causal_mask(TOKENS.shape[1]))[..., :facts.vocab_size]
        folder = save_peft_folder(chunks, facts, tmp_path / "adapter", rank=4, alpha=8.0, dropout=0.0,
                                  base_model=str(hf_dir))
    finally:
        destroy()
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert (_peft_logits(hf_dir, folder) - ours).abs().max() < 1e-4


def _config(family: str, tmp_path, **changes) -> dict:
    from trinity.testing.tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model(family, tmp_path / family)
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    return raw


@pytest.mark.parametrize("family,changes,message", [
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not supported"),
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
     "layer_types must list 'sliding_attention' or 'full_attention'"),
    ("gemma2", {"architectures": ["Gemma3ForConditionalGeneration"]},
     "multimodal Gemma 3 (vision tower and projector) is not supported; use a text-only Gemma3ForCausalLM"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0},
                                    "sliding_attention": {"rope_type": "default"}}},
     "rope_parameters.full_attention: rope_type 'yarn' of the global layers is not supported"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default"},
                                    "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope_parameters.sliding_attention: rope_type 'linear' of the sliding layers is not supported"),
    ("gemma3", {"rope_parameters": None, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_scaling: rope_type 'dynamic' of the global layers is not supported"),
    ("gemma3", {"attn_logit_softcapping": 50.0},
     "attn_logit_softcapping=50.0: transformers' Gemma3ForCausalLM does not apply it"),
])
def test_unsupported_features_are_refused_naming_the_field(family, changes, message, tmp_path):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelFacts.from_hf_dict(_config(family, tmp_path, **changes))


def test_gemma2_facts_follow_transformers_defaults(tmp_path):
    """Keys an older config.json lacks take Gemma2Config's defaults: soft caps 30 / 50, every other layer
    sliding from layer 0, query_pre_attn_scalar 256, head_dim 256, tied embeddings."""
    raw = _config("gemma2", tmp_path)
    for key in ("layer_types", "final_logit_softcapping", "attn_logit_softcapping", "query_pre_attn_scalar",
                "head_dim", "tie_word_embeddings", "sliding_window"):
        raw.pop(key)
    facts = ModelFacts.from_hf_dict(raw)
    assert (facts.final_logit_softcapping, facts.attn_logit_softcapping) == (30.0, 50.0)
    assert facts.sliding_layers == (True, False, True) and facts.sliding_window == 4096
    assert (facts.query_pre_attn_scalar, facts.head_dim, facts.tie_word_embeddings) == (256.0, 256, True)


def test_mbridge_backend_is_refused_for_gemma(tmp_path):
    from trinity.convert.api import check_layout

    facts = ModelFacts.from_hf_dict(_config("gemma2", tmp_path))
    with pytest.raises(UserError, match="--backend: mbridge has no name map for Gemma2ForCausalLM"):
        check_layout(facts, tp=1, pp=1, vpp=None, ep=1, backend="mbridge", device="cpu")


def test_gemma3_facts_read_both_config_formats(tmp_path):
    """transformers 5's nested rope_parameters and layer_types, and an older config.json's rope_theta,
    rope_local_base_freq, rope_scaling and sliding_window_pattern, give the same facts."""
    raw = _config("gemma3", tmp_path)
    new = ModelFacts.from_hf_dict(raw)
    assert new.sliding_layers == (True,) * 5 + (False,) and new.qk_norm
    assert (new.rope_theta, new.rope_local_theta, new.global_rope_factor) == (50000.0, 100.0, 4.0)
    assert new.final_logit_softcapping is None and new.attn_logit_softcapping is None
    for key in ("rope_parameters", "layer_types"):
        raw.pop(key)
    raw.update(rope_theta=50000.0, rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
               sliding_window_pattern=6)
    assert ModelFacts.from_hf_dict(raw) == new
    raw.pop("sliding_window_pattern")  # Gemma3TextConfig's default pattern: 6
    assert ModelFacts.from_hf_dict(raw).sliding_layers == new.sliding_layers


@pytest.mark.parametrize("family", GEMMA)
def test_packed_documents_equal_each_document_alone(family, tmp_path):
    """Packed rows (the SFT loop's document_packed_params): a sliding or capped layer takes the dense
    block-diagonal mask with its window, the others the packed kernel; each document's logits equal
    those of the document alone, the second starting mid-row (RoPE is relative, the window counts keys)."""
    from tests.unit.test_rollout_decode import _tiny_gpt
    from trinity.models.attention import document_packed_params

    with _tiny_gpt(family, tmp_path) as (gpt, facts):
        gpt.eval()
        ids = torch.randint(0, facts.vocab_size, (1, 14), generator=torch.Generator().manual_seed(2))
        pos = torch.arange(14).unsqueeze(0)
        doc_ids = torch.tensor([[0] * 6 + [1] * 8])
        with torch.no_grad():
            packed = gpt(ids, pos, None, packed_seq_params=document_packed_params(doc_ids))
            first = gpt(ids[:, :6], pos[:, :6], None)
            second = gpt(ids[:, 6:], pos[:, :8], None)
            whole = gpt(ids, pos, None)
    torch.testing.assert_close(packed[:, :6], first, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[:, 6:], second, atol=1e-5, rtol=0)
    assert not torch.allclose(packed[:, 6:], whole[:, 6:], atol=1e-3)  # the documents did not see each other
