"""LoRA in RL and DPO (trinity.trainer.recipes.lora_ref): the reference policy is the actor with its
adapters off (no ref engine, no second model), the rollout decodes the merged weights, and the jobs
write their adapters as PEFT folders and a merged HF export.

In process (one gloo rank, fp32): the ref log-probs of a LoRA actor whose adapters are far from zero equal
the base model's bit for bit; a rollout under `rollout_weights` samples what the adapted model gives and
leaves every base weight bit for bit as it was. Through `trinity run`: a tiny GRPO job with use_kl_loss
builds no ref engine and its KL to the ref starts at 0 and moves; DPO with LoRA learns the preference.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from tests.conftest import trinity_run

REPO = Path(__file__).resolve().parents[2]
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["all-linear"]}
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14]]


# ---------------------------------------------------------------- validation


def test_lora_job_has_no_ref_role_and_refuses_ref_settings(write_job, small_job):
    from trinity.config.loader import load_config
    from trinity.errors import ConfigError

    job = {**small_job, "algorithm": {"name": "grpo"}, "data": {**small_job["data"], "train_batch_size": 8}}
    job["actor_rollout_ref"] = {"actor": {"use_kl_loss": True, "lora": {"rank": 8}}}
    cfg = load_config(write_job(job), []).config
    assert cfg.needs_ref and list(cfg.roles()) == ["actor_rollout_ref.actor"]
    with pytest.raises(ConfigError) as err:
        load_config(write_job(job), ["actor_rollout_ref.ref.megatron.param_offload=true",
                                     "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2"])
    assert sorted(err.value.problems) == [
        f"actor_rollout_ref.ref.megatron.{key}: with actor_rollout_ref.actor.lora the reference policy is the actor "
        "with its adapters off (no ref model is built), so the ref block cannot apply; remove the key"
        for key in ("param_offload", "tensor_model_parallel_size")
    ]


# ---------------------------------------------------------------- in process


@pytest.fixture(scope="module")
def engines(tiny_qwen2_tp1):
    """(facts, the base model's chunks, a LoRA actor engine over the same weights with random adapters)."""
    from trinity.config.megatron import MegatronConfig
    from trinity.config.roles import Role
    from trinity.config.schema import LoraConfig, OptimConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.models.build import build_model
    from trinity.models.lora import lora_modules
    from trinity.trainer.engine import RoleEngine

    facts, path = tiny_qwen2_tp1
    m = MegatronConfig()

    def chunks():
        c = build_model(facts, m, device="cpu", dtype=torch.float32)
        load_hf_weights(c, path, facts)
        return c

    base = chunks()
    actor = RoleEngine(Role.actor, chunks(), m, OptimConfig(lr=1e-3, weight_decay=0.0), dtype=torch.float32,
                       total_steps=10, lora=LoraConfig(**LORA))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, _, a in lora_modules(actor.model):
            a.lora_B.copy_(torch.randn(a.lora_B.shape, generator=g) * 0.3)
    return SimpleNamespace(facts=facts, base=base, actor=actor)


def _rollout(model, facts, seed: int = 0):
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    return reference_generate(model, PROMPTS, params, vocab_size=facts.vocab_size, pad_id=0,
                    generator=torch.Generator().manual_seed(seed))


def test_ref_is_the_actor_with_adapters_off_and_gives_the_base_log_probs(engines):
    from trinity.trainer.recipes.lora_ref import AdaptersOff
    from trinity.trainer.recipes.rollout_forward import infer_logprobs

    ro = _rollout(engines.base[0], engines.facts)
    vocab = engines.facts.vocab_size
    ref = infer_logprobs(AdaptersOff(engines.actor), ro, vocab, 2)
    base = infer_logprobs(engines.base, ro, vocab, 2)
    adapted = infer_logprobs(engines.actor, ro, vocab, 2)
    assert torch.equal(ref, base)
    assert (adapted - base).abs().max() > 1e-2  # the adapters do change the policy
    # and they are on again after the reference pass
    assert torch.equal(infer_logprobs(engines.actor, ro, vocab, 2), adapted)


@pytest.mark.parametrize("keep", ["host", "device"])
def test_rollout_decodes_the_adapted_model_and_restores_the_weights(engines, keep):
    from trinity.trainer.recipes.lora_ref import rollout_weights
    from trinity.trainer.recipes.rollout_forward import infer_logprobs

    before = {n: p.detach().clone() for n, p in engines.actor.modules[0].named_parameters()}
    with rollout_weights(engines.actor, keep=keep):
        ro = _rollout(engines.actor.modules[0], engines.facts, seed=1)
    for n, p in engines.actor.modules[0].named_parameters():
        assert torch.equal(p, before[n]), n
    # what the decoder sampled from (its log-probs) is the adapted policy, not the base
    mask = ro.response_mask.bool()
    adapted = infer_logprobs(engines.actor, ro, engines.facts.vocab_size, 4)
    base = infer_logprobs(engines.base, ro, engines.facts.vocab_size, 4)
    assert (ro.logprobs - adapted)[mask].abs().max() < 1e-4
    assert (ro.logprobs - base)[mask].abs().max() > 1e-2


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_adapter_path_rollout_equals_the_merged_rollout(engines, engine):
    """rollout_weights `adapters`: nothing merged, the decoders' lean path adds x A^T B^T beside each base
    GEMM (trinity.models.lora.linear / addmm); it decodes what the merged weights decode."""
    from trinity.rollout.continuous import generate_continuous
    from trinity.rollout.decode import StaticDecoder
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams
    from trinity.trainer.recipes.lora_ref import rollout_weights

    model = engines.actor.modules[0]
    assert StaticDecoder(model, 1, 8).lean  # the path that reads the weights directly, not the hooks
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    run = reference_generate if engine == "static" else generate_continuous

    def rollout(m):
        return run(m, PROMPTS, params, vocab_size=engines.facts.vocab_size, pad_id=0)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with rollout_weights(engines.actor, keep="adapters"):
        adapters = rollout(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing merged
    with rollout_weights(engines.actor, keep="device"):
        merged = rollout(model)
    base = rollout(engines.base[0])
    mask = merged.response_mask.bool()
    assert torch.equal(adapters.tokens, merged.tokens) and torch.equal(adapters.response_mask, merged.response_mask)
    assert (adapters.logprobs - merged.logprobs)[mask].abs().max() < 1e-5
    assert not torch.equal(base.tokens, merged.tokens) or (base.logprobs - merged.logprobs)[mask].abs().max() > 1e-2


# ---------------------------------------------------------------- trinity run


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer, write_dpo_dataset, write_prompt_dataset

    root = tmp_path_factory.mktemp("lora_assets")
    tok = make_tiny_tokenizer(root / "tokenizer")
    model = make_tiny_qwen2(root / "model", tok, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    return {"model": model, "prompts": write_prompt_dataset(root / "prompts.jsonl", 64, seed=0),
            "pairs": write_dpo_dataset(root / "pairs.jsonl", 64, seed=0)}


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _peft_vs_merged(model: Path, adapter: Path, merged: Path) -> float:
    """Max |logit difference| between PEFT (base + adapter folder) and transformers on the merged export."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32),
                                         str(adapter)).eval()(tokens).logits
        ours = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()(tokens).logits
    return float((peft - ours).abs().max())


@pytest.mark.slow
def test_grpo_with_lora_builds_no_ref_engine_and_exports_adapters(assets, tmp_path):
    out = tmp_path / "grpo"
    cfg = {
        "algorithm": {"name": "grpo"},
        "model": {"path": str(assets["model"])},
        "data": {"train_files": [str(assets["prompts"])], "max_prompt_length": 32, "train_batch_size": 4},
        "cluster": {"device": "cpu", "nproc_per_node": 1},
        "trainer": {"total_steps": 3, "micro_batch_size": 4, "output_dir": str(out), "save_interval": 2,
                    "log_interval": 1, "tensorboard": False, "export_hf": True},
        "actor_rollout_ref": {
            "actor": {"ppo_mini_batch_size": 2, "use_kl_loss": True, "optim": {"lr": 5e-2, "weight_decay": 0.0},
                      "megatron": {"param_offload": True}, "lora": LORA},
            "rollout": {"n": 2, "response_length": 6},
        },
        "reward": {"function": "trinity.rewards.arithmetic_reward:closeness"},
    }
    proc = trinity_run(cfg, tmp_path / "grpo.yaml", timeout=240, reuse_conversion=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "; roles: actor" in proc.stdout and "roles: actor, ref" not in proc.stdout
    m = rows(out)
    assert [r["step"] for r in m] == [1, 2, 3]
    assert m[0]["actor/ref_kl"] == 0.0  # adapters start at B = 0: the actor is its ref
    assert m[-1]["actor/ref_kl"] > 0.0  # trained adapters move it away; the ref (adapters off) stays
    # the ref phase ran on the actor's (resident) parameters, not on a second model
    assert all(isinstance(r["time/ref_s"], float) for r in m)
    assert m[0]["mem/ref_gib"] == pytest.approx(m[0]["mem/old_logp_gib"], rel=0.05)
    assert (out / "checkpoints" / "step_2" / "adapter" / "adapter_config.json").is_file()
    assert not (out / "checkpoints" / "step_2" / "ref").exists()
    # the final merged export is what PEFT computes from the base model and the final adapters
    assert _peft_vs_merged(assets["model"], out / "adapter", out / "hf") < 1e-4
    # the last checkpoint (adapters only) converts to the same merged model, and generates the same answers
    from trinity.cli.generate import generate_answers
    from trinity.convert.api import mcore_to_hf
    from trinity.convert.verify import compare_folders

    mcore_to_hf(str(out / "checkpoints" / "step_3" / "actor"), str(tmp_path / "converted"), device="cpu", verify=True)
    compare_folders(tmp_path / "converted", out / "hf", what="converted LoRA checkpoint")
    prompts = ["1+2=", "7+5="]
    assert generate_answers(out, prompts, max_new_tokens=6, device="cpu") == \
        generate_answers(out / "hf", prompts, max_new_tokens=6, device="cpu")


@pytest.mark.slow
def test_dpo_with_lora_learns_the_preference_with_the_adapters_off_as_reference(assets, tmp_path):
    cfg = yaml.safe_load((REPO / "configs" / "dpo_tiny_cpu.yaml").read_text())
    out = tmp_path / "dpo"
    cfg["model"]["path"] = str(assets["model"])
    cfg["data"]["train_files"] = [str(assets["pairs"])]
    cfg["trainer"].update(total_steps=6, output_dir=str(out), save_interval=6, export_hf=False)
    cfg["actor_rollout_ref"].pop("ref", None)
    cfg["actor_rollout_ref"]["actor"]["lora"] = LORA
    cfg["actor_rollout_ref"]["actor"]["optim"]["lr"] = 1e-2
    proc = trinity_run(cfg, tmp_path / "dpo.yaml", timeout=240, reuse_conversion=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "reference: the actor with its LoRA adapters off" in proc.stdout
    m = {r["step"]: r for r in rows(out)}
    assert abs(m[1]["loss"] - math.log(2)) < 1e-5  # policy == ref at step 1 (B = 0)
    assert m[6]["loss"] < m[1]["loss"] - 0.05, [r["loss"] for r in m.values()]
    assert m[6]["rewards/accuracies"] > m[1]["rewards/accuracies"]
    assert (out / "checkpoints" / "step_6" / "adapter" / "adapter_model.safetensors").is_file()
