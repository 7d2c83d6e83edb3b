"""DeepSeek-V2 / V3 (multi-latent attention, dense-then-MoE layers, shared experts, V2 softmax and V3
sigmoid + score-bias routing) against transformers' own classes on CPU (fp32, TP=1): config reading and
refusals, logits and the bit-exact round trip, and the rollout decoders' greedy tokens against HF generate."""

from __future__ import annotations

import json

import pytest
import torch

from trinity.errors import UserError
from trinity.models.facts import ModelFacts
from trinity.testing.tiny_models import make_tiny_hf_model

FAMILIES = ["deepseek_v2", "deepseek_v3"]
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
PROMPTS = [[5, 9, 17, 3, 44, 2], [7, 1], [100, 12, 8, 60]]


def _raw(family: str, **over) -> dict:
    raw = {
        "architectures": ["DeepseekV3ForCausalLM" if family == "deepseek_v3" else "DeepseekV2ForCausalLM"],
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "vocab_size": 128, "kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "n_shared_experts": 2, "first_k_dense_replace": 1, "routed_scaling_factor": 2.0,
    }
    raw.update(over)
    return raw


def test_facts_of_deepseek_configs():
    v2 = ModelFacts.from_hf_dict(_raw("deepseek_v2", topk_method="group_limited_greedy", n_group=4, topk_group=2))
    assert v2.mla.q_lora_rank is None and v2.head_dim == 24 and v2.num_experts == 8
    assert (v2.moe_dense_layers, v2.moe_shared_ffn_hidden_size, v2.moe_scaling_factor) == (1, 64, 2.0)
    # transformers 5.24's V2 router never renormalises; group_limited_greedy scores a group by its max
    assert v2.moe_score_function == "softmax" and not v2.moe_norm_topk_prob
    assert (v2.moe_num_groups, v2.moe_group_topk, v2.moe_expert_bias) == (4, 2, False)
    v3 = ModelFacts.from_hf_dict(_raw("deepseek_v3", q_lora_rank=24, n_group=4, topk_group=1,
                                      num_nextn_predict_layers=1, rope_parameters=YARN))
    assert v3.moe_score_function == "sigmoid" and v3.moe_expert_bias and v3.mtp_layers == 1
    assert (v3.moe_num_groups, v3.moe_group_topk, v3.moe_group_score_topk) == (4, 1, 2) and v3.mla.q_lora_rank == 24
    assert v2.moe_group_score_topk == 1
    # every group selected: no group limit in either library
    assert ModelFacts.from_hf_dict(_raw("deepseek_v3", n_group=1, topk_group=1)).moe_num_groups is None
    # `trinity tiny-assets --family`'s configs are accepted as they are
    from trinity.testing.tiny_assets import TINY_FAMILY_CONFIGS

    for family in FAMILIES:
        cfg = TINY_FAMILY_CONFIGS[family](vocab_size=320)
        facts = ModelFacts.from_hf_dict({**cfg.to_dict(), "architectures": cfg.architectures or _raw(family)["architectures"]})
        assert facts.family == family and facts.vocab_size == 320


@pytest.mark.parametrize("family,over,field", [
    ("deepseek_v3", {"rope_interleave": False}, "rope_interleave"),
    ("deepseek_v3", {"norm_topk_prob": False}, "norm_topk_prob"),
    ("deepseek_v3", {"n_group": 8, "topk_group": 2}, "n_group"),  # groups of one expert: no top-2 sum
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
    ("deepseek_v2", {"attention_bias": True}, "attention_bias"),
    ("deepseek_v2", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ("deepseek_v3", {"head_dim": 32}, "head_dim"),
])
def test_unsupported_deepseek_configs_are_refused_naming_the_field(family, over, field):
    with pytest.raises(UserError, match=rf"config.json: {field}: "):
        ModelFacts.from_hf_dict(_raw(family, **over))


# V2 greedy; V2 group_limited_greedy with top_k // topk_group = 2 (megatron's own router would rank groups by
# top-2 sums, HF by their max); V3 with YaRN, 2 groups of 4, one chosen
@pytest.mark.parametrize("family,rope,over", [
    ("deepseek_v2", None, {}),
    ("deepseek_v2", None, {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1}),
    ("deepseek_v3", YARN, {}),
])
def test_logits_round_trip_and_rollout_equal_hf(family, rope, over, tmp_path):
    """HF -> megatron-core: fp32 logits within 1e-5 of transformers' (V3 with YaRN and its mscales, its
    score bias perturbed), export bit-exact; the static and continuous decoders' greedy tokens are HF
    generate's."""
    import transformers
    from safetensors.torch import load_file

    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import export_hf_weights, load_hf_weights
    from trinity.convert.verify import hf_logits, mcore_logits, random_tokens
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.build import build_model
    from trinity.rollout.continuous import KVBudget, generate_continuous
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams

    src = make_tiny_hf_model(family, tmp_path / "hf", **({"rope_parameters": rope} if rope else {}), **over)
    facts = ModelFacts.from_hf_dir(src)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    new = 6
    want = [hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    init_parallel(device="cpu", layout=ParallelLayout(), seed=3)
    try:
        (gpt,) = build_model(facts, MegatronConfig(), device="cpu", dtype=torch.float32)
        load_hf_weights([gpt], src, facts)
        tokens = random_tokens(facts.vocab_size)
        ours = mcore_logits(gpt, tokens, facts.vocab_size)
        assert (ours - hf_logits(src, tokens)).abs().max() <= 1e-5
        # RL packs one row per micro batch: two documents in one row give each document's own logits
        from trinity.models.attention import document_packed_params

        row = tokens[0, :10].clone().unsqueeze(0)
        packed = gpt(row, torch.arange(10).unsqueeze(0), None,
                     packed_seq_params=document_packed_params(torch.tensor([[0] * 4 + [1] * 6])))
        for lo, hi in ((0, 4), (4, 10)):
            alone = mcore_logits(gpt, row[:, lo:hi], facts.vocab_size)
            assert (packed[:, lo:hi, : facts.vocab_size] - alone).abs().max() <= 1e-5
        exported = dict(export_hf_weights([gpt], facts))
        original = load_file(str(src / "model.safetensors"))
        assert set(exported) == set(original)
        assert all(torch.equal(exported[n], t) for n, t in original.items())
        params = SamplingParams(temperature=0.0, max_new_tokens=new)
        static = reference_generate(gpt, PROMPTS, params, vocab_size=facts.vocab_size, pad_id=0)
        cont = generate_continuous(gpt, PROMPTS, params, vocab_size=facts.vocab_size, pad_id=0,
                                   budget=KVBudget(max_num_seqs=2))
    finally:
        destroy()
    for r in (static, cont):
        got = [r.responses[i][r.response_mask[i].bool()].tolist() for i in range(len(PROMPTS))]
        assert got == want
    assert torch.equal(static.tokens, cont.tokens)


def test_convert_api_round_trip_through_a_dist_checkpoint(tmp_path):
    """`trinity convert hf-to-mcore` / `mcore-to-hf` (megatron's distributed checkpoint in between, the router
    bias buffer and the MTP layer count in the config included): verified logits, then bit for bit back."""
    from trinity.convert.api import hf_to_mcore, mcore_to_hf

    src = make_tiny_hf_model("deepseek_v3", tmp_path / "hf")
    assert json.loads((src / "config.json").read_text())["num_nextn_predict_layers"] == 1
    report = hf_to_mcore(str(src), str(tmp_path / "mc"), dtype="fp32", verify=True)
    assert report.max_abs_diff is not None and report.max_abs_diff <= 1e-4
    back = mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "back"), verify=True)
    assert "bit for bit" in (back.verified or "")


def test_validate_v2_lite_config_and_refusals(tmp_path, write_job):
    """DeepSeek-V2-Lite's config.json (its auto_map removed: transformers ships the class): validate reads it
    (YaRN factor 40 with mscale = mscale_all_dim, 64 experts, 2 shared); LoRA on q/k/v and mbridge are refused."""
    from tests.conftest import HF_CONFIGS
    from trinity.config.loader import load_config

    facts = ModelFacts.from_hf_dir(HF_CONFIGS / "deepseek_v2_lite")
    assert (facts.num_experts, facts.moe_router_topk, facts.moe_shared_ffn_hidden_size) == (64, 6, 2816)
    assert facts.mla.q_lora_rank is None and facts.rope_scaling["factor"] == 40
    assert 15.0e9 < facts.num_parameters() < 16.5e9  # "16B" (15.7B)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    job = {
        "model": {"path": str(HF_CONFIGS / "deepseek_v2_lite")},
        "data": {"train_files": [str(data)], "seq_length": 512},
        "cluster": {"device": "cuda", "nproc_per_node": 8},
        "trainer": {"global_batch_size": 16, "micro_batch_size": 1},
        "actor_rollout_ref": {"actor": {"megatron": {"expert_model_parallel_size": 8}}},
    }
    load_config(write_job(job), check_paths=False)
    job["actor_rollout_ref"]["actor"]["lora"] = {"rank": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                               "kv_b_proj", "q_a_proj"]}
    job["actor_rollout_ref"]["actor"]["megatron"]["use_mbridge"] = True
    with pytest.raises(UserError) as err:
        load_config(write_job(job), check_paths=False)
    assert "lora.target_modules: linear_qkv (q_proj, k_proj, v_proj) does not exist" in str(err.value)
    assert "megatron.use_mbridge: DeepseekV2ForCausalLM (multi-latent attention)" in str(err.value)
    assert "q_a_proj / q_b_proj do not exist in this model (q_lora_rank is null)" in str(err.value)
    assert "exist only in multi-latent attention" not in str(err.value)  # kv_b_proj: a target of this model
    # V2's full model routes group-limited: trinity's router, which has no aux loss
    v2 = json.loads((HF_CONFIGS / "deepseek_v2_lite" / "config.json").read_text())
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "config.json").write_text(json.dumps(
        {**v2, "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3}))
    grouped = {**job, "model": {"path": str(tmp_path / "v2")}, "actor_rollout_ref": {"actor": {"megatron": {
        "expert_model_parallel_size": 8, "override_transformer_config": {"moe_router_load_balancing_type": "aux_loss"}}}}}
    with pytest.raises(UserError, match=r"override_transformer_config.moe_router_load_balancing_type: with DeepSeek's"):
        load_config(write_job(grouped), check_paths=False)
    job["actor_rollout_ref"]["actor"]["lora"]["target_modules"] = ["o_proj", "kv_a_proj_with_mqa", "kv_b_proj"]
    del job["actor_rollout_ref"]["actor"]["megatron"]["use_mbridge"]
    load_config(write_job(job), check_paths=False)
    # MLA's up-projections recompute (megatron's mla_up_proj; test_mla_up_proj_recompute_... below)
    job["actor_rollout_ref"]["actor"]["megatron"]["override_transformer_config"] = {
        "recompute_granularity": "selective", "recompute_modules": ["mla_up_proj", "core_attn"]}
    load_config(write_job(job), check_paths=False)


@pytest.mark.slow  # two tiny DeepSeek-V3 builds: ~12 s on 2 cores
def test_mla_up_proj_recompute_gives_the_same_loss_and_gradients(tmp_path):
    from trinity.config.megatron import MegatronConfig
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.build import build_model

    facts = ModelFacts.from_hf_dir(make_tiny_hf_model("deepseek_v3", tmp_path / "hf"))
    tokens = torch.randint(0, facts.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    init_parallel(device="cpu", layout=ParallelLayout(), seed=3)
    try:
        got = {}
        for name, over in (("plain", {}), ("recompute", {"recompute_granularity": "selective",
                                                          "recompute_modules": ["mla_up_proj"]})):
            (gpt,) = build_model(facts, MegatronConfig(override_transformer_config=over), device="cpu", dtype=torch.float32)
            if name == "plain":
                state = {n: p.detach().clone() for n, p in gpt.named_parameters()}
            else:
                assert all(layer.self_attention.recompute_up_proj for layer in gpt.decoder.layers)
                with torch.no_grad():
                    for n, p in gpt.named_parameters():
                        p.copy_(state[n])
            loss = gpt(tokens, torch.arange(16).expand(2, 16), None).float().square().mean()
            loss.backward()
            got[name] = (loss.item(), {n: p.grad.clone() for n, p in gpt.named_parameters() if p.grad is not None})
    finally:
        destroy()
    (l0, g0), (l1, g1) = got["plain"], got["recompute"]
    assert l0 == l1 and g0.keys() == g1.keys() and len(g0) > 10
    assert all(torch.equal(g0[n], g1[n]) for n in g0)


def test_mtp_tensors_are_left_unloaded_with_a_warning(tmp_path, caplog):
    """A V3 checkpoint with its multi-token-prediction layer (model.layers.<num_hidden_layers>.*) loads
    without it, saying so; the same tensor in a model without MTP layers is refused, naming it."""
    from safetensors.torch import load_file, save_file

    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.build import build_model

    src = make_tiny_hf_model("deepseek_v3", tmp_path / "hf")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    facts = ModelFacts.from_hf_dir(src)
    init_parallel(device="cpu", layout=ParallelLayout(), seed=3)
    try:
        (gpt,) = build_model(facts, MegatronConfig(), device="cpu", dtype=torch.float32)
        with caplog.at_level("WARNING"):
            load_hf_weights([gpt], src, facts)
        assert "multi-token-prediction layers (num_nextn_predict_layers=1, model.layers.2+) are not loaded" in caplog.text
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
        with pytest.raises(UserError, match=r"tensor 'model.layers.2.eh_proj.weight' is not in the weight map"):
            load_hf_weights([gpt], src, ModelFacts.from_hf_dir(src))
    finally:
        destroy()


def test_lora_on_mla_projections_gives_peft_logits(tmp_path):
    """Adapters on MLA's latent projections and o_proj (random A and B): our logits = transformers + PEFT
    loading our PEFT folder, whose targets are HF's module names."""
    from types import SimpleNamespace

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.convert.verify import mcore_logits, random_tokens
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.build import build_model
    from trinity.models.lora import apply_lora, lora_modules
    from trinity.convert.peft_io import save_peft_folder

    src = make_tiny_hf_model("deepseek_v3", tmp_path / "hf")
    facts = ModelFacts.from_hf_dir(src)
    tokens = random_tokens(facts.vocab_size)
    targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    init_parallel(device="cpu", layout=ParallelLayout(), seed=3)
    try:
        (gpt,) = build_model(facts, MegatronConfig(), device="cpu", dtype=torch.float32)
        load_hf_weights([gpt], src, facts)
        apply_lora([gpt], SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, target_modules=targets))
        assert len(list(lora_modules([gpt]))) == 5 * facts.num_layers
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _, _, a in lora_modules([gpt]):
                a.lora_A.copy_(torch.randn(a.lora_A.shape, generator=g) * 0.2)
                a.lora_B.copy_(torch.randn(a.lora_B.shape, generator=g) * 0.2)
        ours = mcore_logits(gpt, tokens, facts.vocab_size)
        folder = save_peft_folder([gpt], facts, tmp_path / "peft", rank=4, alpha=8.0, dropout=0.0, base_model=str(src))
    finally:
        destroy()
    assert json.loads((folder / "adapter_config.json").read_text())["target_modules"] == sorted(targets)
    base = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    with torch.no_grad():
        plain = base(tokens).logits.float()
        theirs = PeftModel.from_pretrained(base, str(folder)).eval()(tokens).logits.float()
    assert (ours - plain).abs().max() > 1e-2  # the adapters matter
    assert (ours - theirs).abs().max() < 1e-4
