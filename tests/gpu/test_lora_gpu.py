"""LoRA on one GPU (bf16): a training step trains the adapters only (optimizer, gradients), the frozen base
stays bit for bit, a rollout on the merged weights (the decoders' lean path and CUDA graphs) leaves
every base weight bit for bit as it was, and a rollout with the adapters unmerged (rollout_weights
`adapters`: x A^T B^T inside the decode graphs) samples from the adapted model.

Run on a GPU machine: `python -m pytest tests/gpu/test_lora_gpu.py -q -s`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.facts import ModelFacts

    path = tmp_path_factory.mktemp("qwen2_small")
    cfg = Qwen2Config(num_hidden_layers=4, hidden_size=512, intermediate_size=1408, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=4096, max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    init_parallel(device="cuda", layout=ParallelLayout(), seed=1)
    yield ModelFacts.from_hf_dir(path), path
    destroy()


def _adapted_engine(facts, path):
    """An engine whose adapters change the model (B drawn at random instead of zero)."""
    from trinity.models.lora import lora_modules

    engine = _engine(facts, path)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for _, _, a in lora_modules(engine.modules):
            a.lora_B.normal_(0.0, 0.05, generator=g)
    return engine


def _engine(facts, path):
    from trinity.config.megatron import MegatronConfig
    from trinity.config.roles import Role
    from trinity.config.schema import LoraConfig, OptimConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.models.build import build_model
    from trinity.trainer.engine import RoleEngine

    m = MegatronConfig()
    chunks = build_model(facts, m, device="cuda", dtype=torch.bfloat16)
    load_hf_weights(chunks, path, facts)
    return RoleEngine(Role.actor, chunks, m, OptimConfig(lr=1e-3, weight_decay=0.0), dtype=torch.bfloat16,
                      total_steps=10, lora=LoraConfig(rank=8, alpha=16.0, target_modules=["all-linear"]))


def _batches(vocab: int) -> list:
    from trinity.trainer.recipes.sft import TokenRows

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, vocab, (2, 256), generator=g)
    return [TokenRows(tokens, torch.arange(256).expand(2, -1), torch.zeros(2, 256, dtype=torch.long),
                      tokens.roll(-1, 1), torch.ones(2, 256), torch.device("cuda"))]


def test_lora_sft_step_trains_only_the_adapters(setup):
    from trinity.models.lora import lora_modules, trainable_parameters
    from trinity.trainer.recipes.sft import train_step

    facts, path = setup
    engine = _engine(facts, path)
    model = engine.modules[0]
    base = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora." not in n}
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for n, p in model.named_parameters() if n in base)
    # the optimizer's fp32 masters are the adapters, nothing else
    masters = [p for group in engine.optimizer.param_groups for p in group["params"]]
    assert sum(p.numel() for p in masters) == trainable_parameters(engine.modules) > 0
    losses = []
    for _ in range(3):  # the same batch: the loss must fall
        loss, grad_norm = train_step(engine, _batches(facts.vocab_size), loss_tokens=512, device=torch.device("cuda"),
                                     vocab_size=facts.vocab_size)
        losses.append(loss)
        assert grad_norm > 0
    assert losses[-1] < losses[0], losses
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n
    assert all(a.lora_B.abs().max() > 0 for _, _, a in lora_modules(engine.modules))


def test_merged_rollout_restores_the_base_weights_bit_exactly(setup):
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams
    from trinity.trainer.recipes.lora_ref import rollout_weights
    from trinity.trainer.recipes.rollout_forward import infer_logprobs

    facts, path = setup
    engine = _adapted_engine(facts, path)
    model = engine.modules[0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    prompts = [[5, 6, 7, 8] * 4, [9, 10] * 8]
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    # the second call replays the captured CUDA graphs; "auto" keeps the originals on this (nearly empty) GPU
    for seed, keep in ((1, "auto"), (2, "auto"), (3, "host")):
        with rollout_weights(engine, keep=keep), torch.no_grad():
            ro = reference_generate(model, prompts, params, vocab_size=facts.vocab_size, pad_id=0,
                          generator=torch.Generator(device="cuda").manual_seed(seed))
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n]), n
    # the decoder sampled from the adapted policy (bf16: loose bound), not from the base weights
    mask = ro.response_mask.bool()
    adapted = infer_logprobs(engine, ro, facts.vocab_size, 2)
    assert (ro.logprobs - adapted)[mask].abs().mean() < 0.05


@pytest.mark.parametrize("engine_name", ["static", "continuous"])
def test_adapter_path_rollout_decodes_the_adapted_model_in_cuda_graphs(setup, engine_name):
    """rollout_weights `adapters`: nothing is merged; the decoders' lean path adds x A^T B^T inside their CUDA
    graphs. Its samples' log-probs are the adapted model's (the training forward with the adapters' hooks),
    as close as the merged rollout's, and far from the base model's."""
    from trinity.models.lora import adapters_disabled
    from trinity.rollout.continuous import RolloutStats, generate_continuous
    from trinity.rollout.decode import StaticDecoder
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams
    from trinity.trainer.recipes.lora_ref import rollout_weights
    from trinity.trainer.recipes.rollout_forward import infer_logprobs

    facts, path = setup
    engine = _adapted_engine(facts, path)
    model = engine.modules[0]
    decoder = StaticDecoder(model, 2, 64)
    assert decoder.lean and decoder.use_graph
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    prompts = [[5, 6, 7, 8] * 4, [9, 10] * 8]
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    errors = {}
    for keep in ("adapters", "device"):
        stats = RolloutStats()
        with rollout_weights(engine, keep=keep), torch.no_grad():
            gen = torch.Generator(device="cuda").manual_seed(1)
            if engine_name == "static":
                ro = reference_generate(model, prompts, params, vocab_size=facts.vocab_size, pad_id=0, generator=gen)
            else:
                ro = generate_continuous(model, prompts, params, vocab_size=facts.vocab_size, pad_id=0, generator=gen,
                                         stats=stats)
                assert stats.graph_captures > 0
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n]), n
        mask = ro.response_mask.bool()
        adapted = infer_logprobs(engine, ro, facts.vocab_size, 2)
        with adapters_disabled(engine.modules):
            base = infer_logprobs(engine, ro, facts.vocab_size, 2)
        errors[keep] = ((ro.logprobs - adapted)[mask].abs().mean().item(), (ro.logprobs - base)[mask].abs().mean().item())
    print(errors)
    for keep, (to_adapted, to_base) in errors.items():
        assert to_adapted < 0.05 and to_base > 4 * to_adapted, (keep, errors)
