"""GPTModel chunks from tiny HF models of each family, built and stepped on CPU (TP=1)."""

from __future__ import annotations

import pytest
import torch

from trinity.config.megatron import MegatronConfig
from trinity.distributed.layout import ParallelLayout
from trinity.models.facts import ModelFacts
from trinity.testing.tiny_models import FAMILIES, make_tiny_hf_model

SEQ = 16


@pytest.fixture(scope="module")
def tp1():
    from trinity.distributed.parallel import destroy, init_parallel

    init_parallel(device="cpu", layout=ParallelLayout(), seed=5)
    yield
    destroy()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cache: dict[tuple, object] = {}

    def make(family: str, **kw):
        key = (family, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = make_tiny_hf_model(family, tmp_path_factory.mktemp(family), **kw)
        return cache[key]

    return make


def _build(facts, block=None, **kw):
    from trinity.models.build import build_model

    return build_model(facts, block or MegatronConfig(), device="cpu", dtype=torch.float32, **kw)


def _batch(b: int = 2, s: int = SEQ):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (b, s), generator=g)
    return ids, torch.arange(s).expand(b, s)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_builds_with_the_hf_parameter_count(tp1, tiny_dir, family):
    from trinity.models.build import padded_vocab_size

    facts = ModelFacts.from_hf_dir(tiny_dir(family))
    (model,) = _build(facts)
    assert model.trinity_backend == "local+sdpa"
    padding = (padded_vocab_size(facts, 1) - facts.vocab_size) * facts.hidden_size * 2
    assert sum(p.numel() for p in model.parameters()) == facts.num_parameters() + padding
    ids, pos = _batch()
    logits = model(ids, pos, None)
    assert logits.shape == (2, SEQ, padded_vocab_size(facts, 1)) and torch.isfinite(logits).all()


def test_parameter_names_are_the_documented_local_spec_names(tp1, tiny_dir):
    qwen3 = {n for n, _ in _build(ModelFacts.from_hf_dir(tiny_dir("qwen3")))[0].named_parameters()}
    layer = "decoder.layers.1."
    expected = {
        "embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight",
        layer + "input_layernorm.weight", layer + "self_attention.linear_qkv.weight",
        layer + "self_attention.q_layernorm.weight", layer + "self_attention.k_layernorm.weight",
        layer + "self_attention.linear_proj.weight", layer + "pre_mlp_layernorm.weight",
        layer + "mlp.linear_fc1.weight", layer + "mlp.linear_fc2.weight",
    }
    assert expected <= qwen3 and len(qwen3) == 3 + 2 * 8
    qwen2 = {n for n, _ in _build(ModelFacts.from_hf_dir(tiny_dir("qwen2")))[0].named_parameters()}
    assert layer + "self_attention.linear_qkv.bias" in qwen2
    moe = dict(_build(ModelFacts.from_hf_dir(tiny_dir("qwen3_moe")))[0].named_parameters())
    assert moe[layer + "mlp.router.weight"].shape == (4, 64)
    assert moe[layer + "mlp.experts.local_experts.3.linear_fc1.weight"].shape == (2 * 32, 64)  # gate|up


def test_tied_embeddings_have_no_output_layer_weight(tp1, tiny_dir):
    from trinity.models.build import padded_vocab_size

    facts = ModelFacts.from_hf_dir(tiny_dir("qwen2", tie_word_embeddings=True))
    (model,) = _build(facts)
    names = {n for n, _ in model.named_parameters()}
    assert "output_layer.weight" not in names and model.share_embeddings_and_output_weights
    padding = (padded_vocab_size(facts, 1) - facts.vocab_size) * facts.hidden_size
    assert sum(p.numel() for p in model.parameters()) == facts.num_parameters() + padding


def test_value_head_gives_one_value_per_token(tp1, tiny_dir):
    facts = ModelFacts.from_hf_dir(tiny_dir("qwen2", tie_word_embeddings=True))
    (critic,) = _build(facts, value_head=True)
    assert critic.output_layer.weight.shape == (1, 64)
    assert not critic.share_embeddings_and_output_weights  # the head never ties to the embedding
    ids, pos = _batch()
    values = critic(ids, pos, None)
    assert values.shape == (2, SEQ, 1)
    values.sum().backward()
    assert critic.output_layer.weight.grad.abs().sum() > 0


def _loss_and_grads(model, ids, pos):
    from trinity.models.build import causal_mask

    model.zero_grad(set_to_none=True)
    loss = model(ids, pos, causal_mask(ids.size(1)), labels=ids).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_recompute_none_full_selective_give_identical_loss_and_grads(tp1, tiny_dir):
    facts = ModelFacts.from_hf_dir(tiny_dir("qwen2"))
    ids, pos = _batch()
    results, attention_calls = [], []
    for recompute in ({}, {"recompute_granularity": "full"},
                      {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]}):
        torch.manual_seed(11)  # same init for every variant
        from trinity.compat import cpu_compat

        cpu_compat.model_parallel_seed(11)
        block = MegatronConfig.model_validate({"override_transformer_config": recompute})
        (model,) = _build(facts, block)
        model.train()
        calls = []
        model.decoder.layers[0].self_attention.core_attention.register_forward_hook(lambda *a: calls.append(1))
        results.append(_loss_and_grads(model, ids, pos))
        attention_calls.append(len(calls))
    assert attention_calls == [1, 2, 2]  # recompute really ran attention again in backward
    base_loss, base_grads = results[0]
    for loss, grads in results[1:]:
        assert torch.equal(loss, base_loss)
        for name, g in base_grads.items():
            torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=0, msg=name)


def test_default_mask_is_causal_and_packed_rows_equal_separate_documents(tp1, tiny_dir):
    from trinity.models.attention import packed_causal_mask
    from trinity.models.build import causal_mask

    (model,) = _build(ModelFacts.from_hf_dir(tiny_dir("llama")))
    model.eval()
    ids, pos = _batch(b=1, s=12)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos, None), model(ids, pos, causal_mask(12)), atol=1e-5, rtol=0)
        # Two documents packed in one row with continuing positions: RoPE is relative, so with a
        # block-diagonal mask each document's logits equal those of the document on its own.
        doc_ids = torch.tensor([[0] * 5 + [1] * 7])
        packed = model(ids, pos, packed_causal_mask(doc_ids))
        first = model(ids[:, :5], pos[:, :5], None)
        second = model(ids[:, 5:], pos[:, :7], None)
    torch.testing.assert_close(packed[:, :5], first, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[:, 5:], second, atol=1e-5, rtol=0)
    assert not torch.allclose(packed[:, 5:], model(ids, pos, None)[:, 5:].detach(), atol=1e-3)


def test_document_packed_params_through_the_model_equal_the_dense_mask(tp1, tiny_dir):
    """megatron hands sbhd packed_seq_params to every layer (and RoPE) unchanged: the packed row's
    logits and gradients equal the dense block-diagonal mask's, with full recompute too."""
    from trinity.models.attention import document_packed_params, packed_causal_mask

    block = MegatronConfig()
    block.override_transformer_config.recompute_granularity = "full"
    (model,) = _build(ModelFacts.from_hf_dir(tiny_dir("qwen2")), block)
    ids, pos = _batch(b=2, s=12)
    doc_ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 3 + [1] * 3 + [2] * 6])
    out = model(ids, pos, None, packed_seq_params=document_packed_params(doc_ids))
    out.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    expected = model(ids, pos, packed_causal_mask(doc_ids))
    expected.float().square().mean().backward()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=0, msg=n)


def test_packed_attention_gives_our_spec_boundaries_and_transformer_engine_the_dense_mask(tp1, tiny_dir):
    """The SFT loop's attention arguments: real tokens get the logits of the trainer's dense
    block-causal mask (padding, -1, differs only in what the padding itself sees)."""
    from trinity.models.doc_masks import block_causal_mask
    from trinity.models import spec as specs
    from trinity.models.build import packed_attention

    (model,) = _build(ModelFacts.from_hf_dir(tiny_dir("qwen2")))
    model.eval()
    ids, pos = _batch(b=2, s=12)
    doc_ids = torch.tensor([[0] * 5 + [1] * 4 + [-1] * 3, [0] * 12])
    kwargs = packed_attention(model, doc_ids, torch.device("cpu"))
    assert kwargs["attention_mask"] is None and kwargs["packed_seq_params"].doc_ids is not None
    with torch.no_grad():
        out = model(ids, pos, **kwargs)
        expected = model(ids, pos, block_causal_mask(doc_ids))
    real = doc_ids >= 0
    torch.testing.assert_close(out[real], expected[real], atol=1e-5, rtol=0)
    model.trinity_backend = specs.BACKEND_TE
    dense = packed_attention(model, doc_ids, torch.device("cpu"))
    assert set(dense) == {"attention_mask"} and torch.equal(dense["attention_mask"], block_causal_mask(doc_ids))


def test_rl_forward_over_left_padded_rows_equals_the_rollout_mask(tp1, tiny_dir):
    """The RL roles' forward (prompt padding and the sequence as two packed documents) gives the real
    tokens the logits of the rollout's own padding mask."""
    from trinity.rollout.reference import attention_mask
    from trinity.trainer.recipes.rollout_forward import forward_output

    (model,) = _build(ModelFacts.from_hf_dir(tiny_dir("qwen2")))
    model.eval()
    ids, pos = _batch(b=2, s=12)
    key_mask = torch.tensor([[0] * 4 + [1] * 8, [1] * 12])
    with torch.no_grad():
        out = forward_output(model, ids, key_mask).transpose(0, 1)  # [S, B, V] -> [B, S, V]
        expected = model(ids, pos, attention_mask(key_mask))
    real = key_mask.bool()
    torch.testing.assert_close(out[real], expected[real], atol=1e-5, rtol=0)
    # the masks matter: row 1 with every key padded (each token sees itself only) differs
    assert not torch.allclose(out[1], model(ids, pos, attention_mask(torch.ones(2, 12).long() - key_mask))[1])
    # and row 0's real tokens do not see its left padding, unlike plain causal attention
    with torch.no_grad():
        causal = model(ids, pos, None)
    assert not torch.allclose(out[0][real[0]], causal[0][real[0]], atol=1e-3)


def test_grouped_gemm_without_its_kernel_is_a_clear_error(tp1, tiny_dir):
    from trinity.errors import UserError

    facts = ModelFacts.from_hf_dir(tiny_dir("qwen3_moe"))
    with pytest.raises(UserError, match="moe_grouped_gemm"):
        _build(facts, MegatronConfig(moe_grouped_gemm=True))


def test_context_parallel_without_te_builds_ring_attention(tp1, tiny_dir):
    from trinity.errors import UserError
    from trinity.models.ring_attention import RingCoreAttention

    facts = ModelFacts.from_hf_dir(tiny_dir("qwen2"))
    with pytest.raises(UserError, match="torch_compile"):
        _build(facts, MegatronConfig(context_parallel_size=2, torch_compile="layers"))
    model = _build(facts, MegatronConfig(context_parallel_size=2))
    chunk = model[0] if isinstance(model, list) else model
    assert all(type(layer.self_attention.core_attention) is RingCoreAttention for layer in chunk.decoder.layers)


def test_cpu_compat_enable_is_idempotent_and_disable_restores(tp1):
    import megatron.core.tensor_parallel.random as mrandom

    from trinity.compat import cpu_compat

    assert cpu_compat.is_enabled()  # init_parallel(device="cpu") enabled it
    patched = list(cpu_compat._patches)
    cpu_compat.enable()
    assert cpu_compat._patches == patched  # second call applies nothing
    assert torch.cuda.current_device() == "cpu"
    cpu_compat.disable()
    try:
        assert not cpu_compat.is_enabled()
        assert mrandom._get_cuda_rng_state is not cpu_compat._get_cpu_rng_state
        if not torch.cuda.is_available():
            with pytest.raises((AssertionError, RuntimeError)):
                torch.cuda.current_device()
    finally:
        cpu_compat.enable()
    assert len(cpu_compat._patches) == len(patched)


def test_cpu_compat_synchronizes_nothing_on_a_machine_with_a_gpu(tp1, monkeypatch):
    """CPU mode on a machine with a GPU: megatron's pipeline shape exchange calls torch.cuda.synchronize()
    with no device, which must not look up the patched current device ("cpu": "invalid argument to
    exchangeDevice" on a 2-GPU machine). Checked by enabling CPU mode as there (CUDA reported available)."""
    from trinity.compat import cpu_compat

    cpu_compat.disable()
    try:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        cpu_compat.enable()
        monkeypatch.undo()
        assert torch.cuda.current_device() == "cpu"
        assert torch.cuda.synchronize() is None  # the real one raises here: no CUDA in this torch, or "cpu"
    finally:
        cpu_compat.disable()
        cpu_compat.enable()
