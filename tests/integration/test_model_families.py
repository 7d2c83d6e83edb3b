"""The families of issue 44 end to end on CPU (fp32, TP=1): rollout decoders against HF `generate`, packed
training rows with sliding windows, a few SFT steps; TP=2 and PP=2 logits against HF in two gloo ranks.

Logits and the bit-exact round trip at TP=1 are test_convert_roundtrip.py's CASES; refusals are in
tests/unit/test_models_config.py. Each tiny model (trinity.testing.tiny_models) has the family's
features switched on at sizes the tests' sequences exceed: Mistral a 4-token window, Phi-3 a 5-token
window and 0.75 partial rotary, Qwen2-MoE a gated shared expert and top-k of the full softmax, GLM-4
interleaved RoPE on half of each head and post-block norms."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_two_ranks
from trinity.config.megatron import MegatronConfig
from trinity.distributed.layout import ParallelLayout
from trinity.models.facts import ModelFacts
from trinity.testing.tiny_models import make_tiny_hf_model

FAMILIES = ["mistral", "phi3", "qwen2_moe", "glm4"]
PROMPTS = [[5, 9, 17, 3, 44, 2, 8, 11], [7, 1], [100, 12, 8, 60]]
NEW = 8

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache: dict[tuple, object] = {}

    def make(family: str, **overrides):
        key = (family, *sorted(overrides.items()))
        if key not in cache:
            cache[key] = make_tiny_hf_model(family, tmp_path_factory.mktemp(family), **overrides)
        return cache[key]

    return make


@pytest.fixture
def tp1():
    from trinity.distributed.parallel import destroy, init_parallel

    init_parallel(device="cpu", layout=ParallelLayout(), seed=5)
    yield
    destroy()


def _loaded(path, block=None):
    from trinity.convert.builtin import load_hf_weights
    from trinity.models.build import build_model

    facts = ModelFacts.from_hf_dir(path)
    chunks = build_model(facts, block or MegatronConfig(), device="cpu", dtype=torch.float32)
    load_hf_weights(chunks, path, facts)
    return chunks, facts


@pytest.mark.parametrize("family,overrides", [(f, {}) for f in FAMILIES] + [("mixtral", {"sliding_window": 4})])
def test_rollout_decoders_equal_hf_generate(tp1, tiny, family, overrides):
    """Greedy tokens of the static decoder (lean and module paths) and of the continuous engine are HF's;
    prompts plus responses run past the window, so a decoder that ignored it would differ (Mixtral's
    optional window too)."""
    from transformers import AutoModelForCausalLM

    from trinity.rollout.continuous import KVBudget, generate_continuous
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams

    path = tiny(family, **overrides)
    (gpt,), facts = _loaded(path)
    gpt.eval()
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    want = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    static = reference_generate(gpt, PROMPTS, params, vocab_size=facts.vocab_size, pad_id=0)
    assert static.responses.tolist() == want
    cont = generate_continuous(gpt, PROMPTS, params, vocab_size=facts.vocab_size, pad_id=0,
                               budget=KVBudget(max_num_seqs=2))
    assert cont.responses.tolist() == want
    assert (cont.logprobs - static.logprobs).abs().max().item() <= 1e-5
    import trinity.rollout.decode as decode

    lean = decode._lean_supported
    try:
        decode._lean_supported = lambda gpt: False  # megatron's submodules (MoE, TE layers) take the window too
        module = reference_generate(gpt, PROMPTS, params, vocab_size=facts.vocab_size, pad_id=0)
    finally:
        decode._lean_supported = lean
    assert module.responses.tolist() == want


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_see_their_window_and_sft_steps_lower_the_loss(tp1, tiny, family):
    """Packed training rows (the documents kernel and the dense mask) give each document its own logits
    with the window; then five optimizer steps on the packed rows lower the loss."""
    from trinity.models.attention import document_packed_params, document_batch, packed_causal_mask

    (gpt,), facts = _loaded(tiny(family))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, facts.vocab_size, (2, 16), generator=g)
    pos = torch.arange(16).expand(2, 16)
    doc_ids = torch.tensor([[0] * 9 + [1] * 7, [0] * 3 + [1] * 3 + [2] * 10])
    packed = document_packed_params(doc_ids)
    assert packed.documents is not None and document_batch(doc_ids) is not None
    gpt.eval()
    with torch.no_grad():
        kernel = gpt(ids, pos, None, packed_seq_params=packed)
        dense = gpt(ids, pos, packed_causal_mask(doc_ids))
        alone = gpt(ids[:1, 9:], pos[:1, :7], None)  # the second document of row 0, on its own
    torch.testing.assert_close(kernel, dense, atol=1e-5, rtol=0)
    torch.testing.assert_close(kernel[:1, 9:], alone, atol=1e-5, rtol=0)
    gpt.train()
    opt = torch.optim.AdamW(gpt.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = gpt(ids, pos, None, labels=ids, packed_seq_params=document_packed_params(doc_ids)).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


def _two_rank_logits(rank: int, port: int, paths: dict, want: dict) -> None:
    """TP=2, PP=2 (a stage's hidden states sent over gloo) and, for MoE families, EP=2: logits of each
    family against HF's."""
    import os

    import torch.distributed as dist

    from trinity.distributed.parallel import destroy, init_parallel

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    from trinity.models.build import causal_mask

    tokens = want["tokens"]
    b, s = tokens.shape
    pos = torch.arange(s).expand(b, s)
    # init_parallel again (without destroy in between) re-forms megatron's groups over the same ranks
    for layout in (ParallelLayout(tp=2), ParallelLayout(pp=2), ParallelLayout(ep=2)):
        init_parallel(device="cpu", layout=layout, seed=5, timeout_s=120)
        block = MegatronConfig(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                               expert_model_parallel_size=layout.ep)
        for family, path in paths.items():
            if layout.ep > 1 and not ModelFacts.from_hf_dir(path).is_moe:
                continue
            (gpt,), facts = _loaded(path, block)
            gpt.eval()
            with torch.no_grad():
                if layout.pp == 2 and rank == 1:
                    hidden = torch.empty(s, b, facts.hidden_size)
                    dist.recv(hidden, src=0)
                    gpt.set_input_tensor(hidden)
                out = gpt(tokens, pos, causal_mask(s), runtime_gather_output=True)
            if layout.pp == 2 and rank == 0:
                dist.send(out.contiguous(), dst=1)
                continue
            diff = (out[..., : facts.vocab_size] - want[family]).abs().max().item()
            assert diff <= 1e-5, (family, layout, diff)
    destroy()


@pytest.mark.multiproc
@pytest.mark.slow
def test_tp2_and_pp2_logits_equal_hf(tiny):
    from trinity.convert.verify import hf_logits, random_tokens

    paths = {f: tiny(f) for f in FAMILIES}
    tokens = random_tokens(128)
    want = {f: hf_logits(p, tokens) for f, p in paths.items()}
    run_two_ranks(_two_rank_logits, paths, {"tokens": tokens, **want})


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_adapters_save_as_a_peft_folder_that_peft_runs_with_our_logits(tp1, tiny, family, tmp_path):
    """LoRA target names map through the family's weight map (Phi-3's fused qkv_proj / gate_up_proj as
    one PEFT module each): PEFT on the HF model gives the adapted model's logits."""
    from types import SimpleNamespace

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trinity.models.build import causal_mask
    from trinity.models.lora import apply_lora, lora_modules
    from trinity.convert.peft_io import save_peft_folder

    path = tiny(family)
    chunks, facts = _loaded(path)
    targets = ["linear_qkv", "linear_proj"] + ([] if facts.is_moe else ["linear_fc1", "linear_fc2"])
    apply_lora(chunks, SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, target_modules=targets))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, _, a in lora_modules(chunks):
            a.lora_A.copy_(torch.randn(a.lora_A.shape, generator=g) * 0.2)
            a.lora_B.copy_(torch.randn(a.lora_B.shape, generator=g) * 0.2)
    tokens = torch.randint(0, facts.vocab_size, (2, 12), generator=g)
    chunks[0].eval()
    with torch.no_grad():
        ours = chunks[0](tokens, torch.arange(12).expand(2, 12), causal_mask(12))[..., : facts.vocab_size]
    folder = save_peft_folder(chunks, facts, tmp_path / "adapter", rank=4, alpha=8.0, dropout=0.0, base_model=str(path))
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32), str(folder))
    with torch.no_grad():
        theirs = hf.eval()(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-4


def test_glm4_post_norms_are_in_the_dist_checkpoint(tp1, tiny):
    """GLM-4's post-block norms are children of megatron's attention and MLP modules, whose sharded state
    dicts (what dist checkpoints save and load) must carry them; megatron's MLP asks each child for its own."""
    (gpt,), _ = _loaded(tiny("glm4"))
    sharded = gpt.sharded_state_dict()
    for name in ("self_attention.post_layernorm.weight", "mlp.post_layernorm.weight"):
        tensor = sharded[f"decoder.layers.1.{name}"]
        # saved under the layer-stacked key, as megatron saves its own norms (any PP layout loads it)
        assert tensor.key == f"decoder.layers.{name}" and tensor.global_shape == (2, 64)
        assert tensor.data is gpt.decoder.layers[1].get_parameter(name)
