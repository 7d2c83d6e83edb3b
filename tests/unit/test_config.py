"""Job config: parsing, overrides, and each cross-field rule naming its exact key path."""

from __future__ import annotations

import copy
import json
import re

import pytest

from tests.conftest import FIXTURES, HF_CONFIGS, REPO
from trinity.config.loader import load_config
from trinity.errors import ConfigError, UserError

ACTOR = "actor_rollout_ref.actor.megatron"


def problems_of(path, overrides=()):
    with pytest.raises(ConfigError) as err:
        load_config(path, list(overrides))
    return err.value.problems


def with_keys(job, **dotted):
    job = copy.deepcopy(job)
    for key, value in dotted.items():
        node = job
        parts = key.split("__")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return job


def test_valid_job_and_defaults(write_job, small_job):
    loaded = load_config(write_job(small_job))
    cfg = loaded.config
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 1
    assert loaded.facts.num_layers == 24
    assert list(cfg.roles()) == [f"actor_rollout_ref.actor"]


def test_precedence_defaults_yaml_overrides(write_job, small_job):
    job = with_keys(small_job, trainer__total_steps=5)
    path = write_job(job)
    assert load_config(path).config.trainer.total_steps == 5
    cfg = load_config(path, ["trainer.total_steps=10", f"{ACTOR}.tensor_model_parallel_size=2",
                             "data.train_files=[" + str(FIXTURES / "data" / "sft.jsonl") + "]"]).config
    assert cfg.trainer.total_steps == 10
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 2
    assert cfg.trainer.keep_last == 2  # default untouched


def test_bad_override_syntax(write_job, small_job):
    assert problems_of(write_job(small_job), ["trainer.total_steps"]) == [
        "override 'trainer.total_steps': must look like dotted.key=value"
    ]


def test_unknown_key_did_you_mean_with_line(write_job, small_job):
    job = with_keys(small_job, actor_rollout_ref__actor__megatron__tensor_model_paralel_size=2)
    (p,) = problems_of(write_job(job))
    assert p.startswith(f"{ACTOR}.tensor_model_paralel_size: unknown key")
    assert "did you mean 'tensor_model_parallel_size'" in p
    assert "job.yaml:" in p


def test_yaml_syntax_error_shows_file_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: x\n trainer: [\n")
    with pytest.raises(UserError, match=r"bad.yaml:\d+:\d+: YAML syntax error"):
        load_config(bad)


def test_all_problems_reported_at_once(write_job, small_job):
    job = with_keys(small_job, trainer__micro_batch_size="two",
                    actor_rollout_ref__actor__megatron__pipeline_model_parallel_size=5)
    probs = problems_of(write_job(job))
    assert any(p.startswith("trainer.micro_batch_size:") for p in probs)
    assert any(p.startswith(f"{ACTOR}.pipeline_model_parallel_size: 24 layers") for p in probs)


CASES = [
    # (overrides, expected key path prefix, a fragment of the message)
    ({f"{ACTOR}.tensor_model_parallel_size": 3}, f"{ACTOR}.tensor_model_parallel_size: world size 8", "TP x PP x CP"),
    ({f"{ACTOR}.tensor_model_parallel_size": 4}, f"{ACTOR}.tensor_model_parallel_size: 14 attention heads", "TP=4"),
    ({f"{ACTOR}.pipeline_model_parallel_size": 5}, f"{ACTOR}.pipeline_model_parallel_size: 24 layers", "PP=5"),
    # the layer split is blamed on VPP when it is set, as `trinity convert --vpp` does (one rule for both)
    ({f"{ACTOR}.pipeline_model_parallel_size": 2, f"{ACTOR}.virtual_pipeline_model_parallel_size": 8},
     f"{ACTOR}.virtual_pipeline_model_parallel_size: 24 layers", "PP x VPP"),
    ({f"{ACTOR}.virtual_pipeline_model_parallel_size": 2}, f"{ACTOR}.virtual_pipeline_model_parallel_size:", "pipeline_model_parallel_size > 1"),
    ({f"{ACTOR}.expert_model_parallel_size": 2}, f"{ACTOR}.expert_model_parallel_size: EP=2 needs an MoE model", "dense"),
    ({f"{ACTOR}.override_transformer_config.recompute_method": "uniform"},
     f"{ACTOR}.override_transformer_config.recompute_method:", "granularity full"),
    ({f"{ACTOR}.override_transformer_config.recompute_granularity": "full"},
     f"{ACTOR}.override_transformer_config.recompute_method: required", "uniform or block"),
    ({f"{ACTOR}.override_transformer_config.recompute_granularity": "full",
      f"{ACTOR}.override_transformer_config.recompute_method": "block",
      f"{ACTOR}.override_transformer_config.recompute_num_layers": 30},
     f"{ACTOR}.override_transformer_config.recompute_num_layers: 30", "24 layers per pipeline stage"),
    ({f"{ACTOR}.override_transformer_config.recompute_granularity": "selective",
      f"{ACTOR}.override_transformer_config.recompute_modules": ["core_attn", "atention"]},
     f"{ACTOR}.override_transformer_config.recompute_modules.1:", "core_attn"),
    ({f"{ACTOR}.override_transformer_config.recompute_granularity": "selective",
      f"{ACTOR}.override_transformer_config.recompute_modules": ["moe"]},
     f"{ACTOR}.override_transformer_config.recompute_modules:", "MoE model"),
    ({f"{ACTOR}.override_transformer_config.recompute_granularity": "selective",
      f"{ACTOR}.override_transformer_config.recompute_modules": ["mla_up_proj"]},
     f"{ACTOR}.override_transformer_config.recompute_modules: mla_up_proj", "Qwen2ForCausalLM does not have"),
    ({f"{ACTOR}.override_transformer_config.apply_rope_fuson": False},
     f"{ACTOR}.override_transformer_config.apply_rope_fuson: not a TransformerConfig field", "apply_rope_fusion"),
    ({f"{ACTOR}.use_dist_checkpointing": True, f"{ACTOR}.dist_checkpointing_path": "/nonexistent/ckpt"},
     f"{ACTOR}.dist_checkpointing_path: /nonexistent/ckpt does not exist", "trinity convert hf-to-mcore"),
    ({f"{ACTOR}.use_dist_checkpointing": True}, f"{ACTOR}.dist_checkpointing_path: required", ""),
    ({f"{ACTOR}.use_mbridge": True, f"{ACTOR}.use_dist_checkpointing": True, f"{ACTOR}.dist_checkpointing_path": "/tmp"},
     f"{ACTOR}.use_mbridge: cannot be combined", ""),
    ({f"{ACTOR}.context_parallel_size": 2, "data.seq_length": 510},
     "data.seq_length: 510 is not a multiple of 2 x context_parallel_size = 4", "set it to 512"),
    ({"trainer.global_batch_size": 12}, "trainer.global_batch_size: 12 is not divisible", "micro_batch_size x DP = 1 x 8"),
    ({"actor_rollout_ref.ref.megatron.param_offload": True}, "actor_rollout_ref.ref.megatron.param_offload: the ref role does not exist", "sft"),
    ({"critic": {}}, "critic: only ppo uses a critic", "remove"),
    ({"algorithm.name": "grpo", "critic": {}}, "critic: only ppo uses a critic, but algorithm.name is grpo",
     "remove the critic block"),
    ({"model.path": str(HF_CONFIGS / "qwen3_30b_a3b"), f"{ACTOR}.tensor_model_parallel_size": 8},
     f"{ACTOR}.tensor_model_parallel_size: 4 key/value heads are not divisible by TP=8", "use a TP that divides 4"),
    ({f"{ACTOR}.override_transformer_config.recompute_num_layers": 2},
     f"{ACTOR}.override_transformer_config.recompute_num_layers: only applies with recompute_granularity: full",
     "remove it or set granularity full"),
    ({"algorithm.name": "ppo"}, "critic: ppo needs a critic", ""),
    ({"model.path": "/nonexistent/model"}, "model.path: /nonexistent/model: model folder does not exist", ""),
    ({"data.train_files": ["/nonexistent/a.jsonl"]}, "data.train_files.0: /nonexistent/a.jsonl does not exist", ""),
    ({"data.train_files": []}, "data.train_files: no training files", ""),
    ({"trainer.total_steps": 5, "trainer.profile_step": 6},
     "trainer.profile_step: step 6 comes after the last step (trainer.total_steps = 5)", "from 2 to 5"),
    ({"trainer.profile_step": 0}, "trainer.profile_step:", "greater than or equal to 1"),
    ({"cluster.device": "tpu"}, "cluster.device:", "'cuda' or 'cpu'"),
    ({f"{ACTOR}.torch_compile": "everything"}, f"{ACTOR}.torch_compile:", "'layers'"),
    ({f"{ACTOR}.context_parallel_size": 2, f"{ACTOR}.torch_compile": "layers"},
     f"{ACTOR}.torch_compile: must be none with context_parallel_size > 1", "does not compile"),
    ({f"{ACTOR}.context_parallel_size": 2, f"{ACTOR}.override_transformer_config.attention_dropout": 0.1},
     f"{ACTOR}.override_transformer_config.attention_dropout: ring attention", "has no attention dropout"),
    ({f"{ACTOR}.context_parallel_size": 2, f"{ACTOR}.tensor_model_parallel_size": 2, f"{ACTOR}.sequence_parallel": True,
      "data.seq_length": 516}, "data.seq_length: 516 is not a multiple of 2 x context_parallel_size x TP", "set it to 520"),
]


@pytest.mark.parametrize("overrides,key,fragment", CASES, ids=[c[1].split(":")[0] + f"-{i}" for i, c in enumerate(CASES)])
def test_each_rule_names_its_key(write_job, small_job, overrides, key, fragment):
    path = write_job(small_job)
    import yaml

    args = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    probs = problems_of(path, args)
    hits = [p for p in probs if p.startswith(key)]
    assert hits, f"no problem starting with {key!r} in {probs}"
    assert fragment in hits[0]


MIGRATING = REPO / "docs" / "migrating.md"


def _migrating_same_names() -> set[str]:
    """Megatron-block keys that docs/migrating.md says keep their verl / Trinity-RFT name ("same")."""
    text = MIGRATING.read_text(encoding="utf-8")
    table = text.split("## The megatron block", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for row in table.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) < 2 or cells[1] != "same":
            continue
        for name in re.findall(r"`([^`]+)`", cells[0]):
            first, *more = (n.strip() for n in name.split("/"))
            if "<" in name:
                continue  # override_transformer_config.<any TransformerConfig field>
            names.add(first)
            head = first.rpartition(".")[0]
            names.update(f"{head}.{n}" if head else n for n in more)
    return names


def _flat_keys(block: dict) -> set[str]:
    keys = {k for k in block if k != "override_transformer_config"}
    return keys | {f"override_transformer_config.{k}" for k in block.get("override_transformer_config", {})}


def test_verl_megatron_blocks_validate_unchanged(write_job):
    """docs/migrating.md: verl's / Trinity-RFT's megatron blocks paste in unchanged where names match."""
    common = {
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": None, "context_parallel_size": 1,
        "expert_model_parallel_size": 1, "expert_tensor_parallel_size": None, "sequence_parallel": False,
        "use_distributed_optimizer": True, "use_mbridge": False,
        "use_dist_checkpointing": False, "dist_checkpointing_path": None, "seed": 42,
        "overlap_grad_reduce": True, "moe_token_dispatcher_type": "alltoall", "moe_grouped_gemm": False,
        "moe_layer_recompute": False,
    }
    actor = {**common, "param_offload": True, "grad_offload": True, "optimizer_offload": True,
             "override_transformer_config": {"recompute_granularity": "full", "recompute_method": "uniform",
                                             "recompute_num_layers": 1}}
    ref = {**common, "param_offload": True}
    critic = {**common, "param_offload": True, "grad_offload": True, "optimizer_offload": True,
              "override_transformer_config": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}}
    documented = _migrating_same_names()
    assert "tensor_model_parallel_size" in documented and "override_transformer_config.recompute_modules" in documented
    assert _flat_keys(actor) | _flat_keys(ref) | _flat_keys(critic) == documented
    job = {
        "algorithm": {"name": "ppo", "gamma": 1.0, "lam": 0.95},
        "model": {"path": str(HF_CONFIGS / "qwen2_5_0_5b")},
        "data": {"train_files": [str(FIXTURES / "data" / "prompts.jsonl")], "train_batch_size": 8, "max_prompt_length": 64},
        "cluster": {"device": "cuda", "nproc_per_node": 8},
        "trainer": {"micro_batch_size": 1},
        "actor_rollout_ref": {
            "actor": {"ppo_mini_batch_size": 8, "use_kl_loss": True, "megatron": actor},
            "ref": {"megatron": ref},
            "rollout": {"n": 1, "response_length": 64},
        },
        "critic": {"cliprange_value": 0.5, "megatron": critic},
    }
    cfg = load_config(write_job(job)).config
    assert list(cfg.roles()) == ["actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"]
    for path, block in (("actor_rollout_ref.actor", actor), ("actor_rollout_ref.ref", ref), ("critic", critic)):
        m = cfg.roles()[path]
        dumped = m.model_dump(mode="json")
        for key, value in block.items():
            if key == "override_transformer_config":
                assert {k: dumped[key][k] for k in value} == value, path
            else:
                assert dumped[key] == value, (path, key)


def test_blocks_of_roles_the_job_does_not_have_are_refused_alone(write_job, small_job):
    """A ref block in a job without KL and a critic block in a grpo job, each with a TP at odds with the
    actor's: refused as blocks of absent roles, without the layout problems of roles that do not run."""
    prompts = str(FIXTURES / "data" / "prompts.jsonl")
    job = with_keys(small_job, algorithm__name="grpo", data__train_files=[prompts],
                    actor_rollout_ref__ref__megatron__tensor_model_parallel_size=4,
                    actor_rollout_ref__ref__log_prob_max_token_len_per_gpu=4096,
                    critic__megatron__tensor_model_parallel_size=2)
    why = "no KL is used: actor_rollout_ref.actor.use_kl_loss and algorithm.use_kl_in_reward are false, set one to use a ref"
    assert problems_of(write_job(job)) == [
        "critic: only ppo uses a critic, but algorithm.name is grpo; remove the critic block",
        f"actor_rollout_ref.ref.megatron.tensor_model_parallel_size: the ref role does not exist in this job ({why}); "
        "remove the key",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu: the ref role does not exist in this job ({why}); "
        "remove the key",
    ]
    # sft: no reference model at all
    sft = with_keys(small_job, actor_rollout_ref__ref__strategy="megatron")
    assert problems_of(write_job(sft)) == [
        "actor_rollout_ref.ref.strategy: the ref role does not exist in this job (sft has no reference model); "
        "remove the key"]
    # a ref block at the defaults (what a resolved config spells out) is no block at all
    quiet = with_keys(small_job, actor_rollout_ref__ref__megatron__tensor_model_parallel_size=1)
    assert list(load_config(write_job(quiet)).config.roles()) == ["actor_rollout_ref.actor"]


def test_unsupported_architecture_lists_supported(write_job, small_job, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    probs = problems_of(write_job(with_keys(small_job, model__path=str(tmp_path / "m"))))
    assert probs[0].startswith("model.path:")
    assert "GPT2LMHeadModel" in probs[0] and "Qwen2ForCausalLM" in probs[0]


def test_sequence_parallel_at_tp1_warns_and_disables(write_job, small_job):
    loaded = load_config(write_job(small_job), [f"{ACTOR}.sequence_parallel=true"])
    assert loaded.config.actor_rollout_ref.actor.megatron.sequence_parallel is False
    assert any(w.startswith(f"{ACTOR}.sequence_parallel:") for w in loaded.warnings)


def test_warmups_longer_than_the_run(write_job, small_job):
    """A critic warm-up covering every step (the actor would never train) is refused; an lr warm-up as long as
    the run is stated: the schedule cuts it to total_steps - 1."""
    ppo = with_keys(small_job, algorithm__name="ppo", data__train_batch_size=8, cluster__nproc_per_node=1,
                    data__train_files=[str(FIXTURES / "data" / "prompts.jsonl")],
                    actor_rollout_ref__actor__ppo_mini_batch_size=8, critic={"warmup_steps": 3})
    probs = problems_of(write_job(ppo), ["trainer.total_steps=3"])
    assert "critic.warmup_steps: 3 warm-up steps cover all 3 steps of the run (trainer.total_steps), so the actor " \
           "would never train; set it below 3 or raise trainer.total_steps" in probs
    loaded = load_config(write_job(ppo), ["trainer.total_steps=4", "critic.optim.lr_warmup_steps=6"])
    assert loaded.warnings == [
        "critic.optim.lr_warmup_steps: 6 warm-up steps are not fewer than the 4 steps of the run (trainer.total_steps); "
        "the schedule cuts the warm-up to total_steps - 1 = 3, so the lr peaks at step 3"]
    short = load_config(write_job(small_job), ["trainer.total_steps=2", "actor_rollout_ref.actor.optim.lr_warmup_steps=2"])
    assert [w.split(":")[0] for w in short.warnings] == ["actor_rollout_ref.actor.optim.lr_warmup_steps"]
    assert not load_config(write_job(small_job), ["trainer.total_steps=3", "actor_rollout_ref.actor.optim.lr_warmup_steps=2"]).warnings


def test_moe_rules(write_job, small_job):
    job = with_keys(small_job, model__path=str(HF_CONFIGS / "qwen3_30b_a3b"))
    path = write_job(job)
    probs = problems_of(path, [f"{ACTOR}.expert_model_parallel_size=3"])
    assert any(p.startswith(f"{ACTOR}.expert_model_parallel_size: EP x ETP = 3 x 1 must divide world/PP = 8") for p in probs)
    assert any(p.startswith(f"{ACTOR}.expert_model_parallel_size: 128 experts are not divisible by EP=3") for p in probs)
    probs = problems_of(path, [f"{ACTOR}.expert_model_parallel_size=4", f"{ACTOR}.tensor_model_parallel_size=2"])
    assert any(p.startswith(f"{ACTOR}.sequence_parallel: megatron-core needs sequence_parallel") for p in probs)
    probs = problems_of(path, [f"{ACTOR}.moe_grouped_gemm=true"])
    assert any(p.startswith(f"{ACTOR}.moe_grouped_gemm: needs the grouped_gemm package") for p in probs)
    cfg = load_config(path, [f"{ACTOR}.expert_model_parallel_size=8"]).config
    assert cfg.actor_rollout_ref.actor.megatron.layout().expert_dp(8) == 1


def test_rl_batch_rules_and_roles(write_job, small_job):
    job = with_keys(small_job, algorithm__name="grpo", data__train_batch_size=8,
                    actor_rollout_ref__actor__ppo_mini_batch_size=3, actor_rollout_ref__actor__use_kl_loss=True,
                    actor_rollout_ref__rollout__n=1)
    probs = problems_of(write_job(job))
    assert any(p.startswith("actor_rollout_ref.actor.ppo_mini_batch_size: 3 must divide data.train_batch_size 8") for p in probs)
    assert any(p.startswith("actor_rollout_ref.rollout.n: GRPO") for p in probs)
    ok = with_keys(job, actor_rollout_ref__actor__ppo_mini_batch_size=4, actor_rollout_ref__rollout__n=4)
    cfg = load_config(write_job(ok)).config
    assert list(cfg.roles()) == ["actor_rollout_ref.actor", "actor_rollout_ref.ref"]


@pytest.mark.parametrize("family,what", [("gemma2", "caps attention scores"), ("mistral", "sliding window")])
def test_cp_refuses_what_ring_attention_cannot_do(write_job, small_job, tmp_path, family, what):
    from trinity.testing.tiny_models import tiny_hf_config

    config = tiny_hf_config(family)
    config.architectures = [{"gemma2": "Gemma2ForCausalLM", "mistral": "MistralForCausalLM"}[family]]
    config.save_pretrained(tmp_path / family)
    job = with_keys(small_job, model__path=str(tmp_path / family), cluster__nproc_per_node=2,
                    model__tokenizer_path=small_job["model"]["path"])
    probs = problems_of(write_job(job), [f"{ACTOR}.context_parallel_size=2"])
    assert any(p.startswith(f"{ACTOR}.context_parallel_size: ") and what in p and p.endswith("set it to 1")
               for p in probs), probs


def test_cp_with_transformer_engine_refuses_packed_rows(write_job, small_job, monkeypatch):
    """With TE importable, megatron-core's CP attention runs (whole causal rows only): packed SFT rows and RL
    are refused naming the key, unpacked SFT rows validate."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "transformer_engine" else real(n, *a))
    probs = problems_of(write_job(small_job), [f"{ACTOR}.context_parallel_size=2"])
    assert any(p.startswith(f"{ACTOR}.context_parallel_size: with TransformerEngine installed") and
               "packed rows (data.packing: true)" in p for p in probs), probs
    load_config(write_job(with_keys(small_job, data__packing=False)), [f"{ACTOR}.context_parallel_size=2"])


def test_cp_layouts_validate_and_ring_attention_limits_are_named(write_job, small_job, monkeypatch):
    """CP > 1 validates with TP, PP and DP on any device (world = TP x PP x CP x DP); for RL the rows are
    padded on the fly (no seq_length rule). What ring attention lacks is refused naming the key. (Without
    TransformerEngine, as the Docker image's tests would not be: its rule is the test above.)"""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "transformer_engine" else real(n, *a))
    for device in ("cuda", "cpu"):
        for sizes in ({"context_parallel_size": 2}, {"context_parallel_size": 2, "tensor_model_parallel_size": 2,
                                                     "sequence_parallel": True},
                      {"context_parallel_size": 2, "pipeline_model_parallel_size": 2}):
            job = with_keys(small_job, cluster__device=device)
            cfg = load_config(write_job(job), [f"{ACTOR}.{k}={v}" for k, v in sizes.items()]).config
            assert cfg.actor_rollout_ref.actor.megatron.context_parallel_size == 2
    grpo = with_keys(small_job, algorithm__name="grpo", data__seq_length=510,
                     data__train_files=[str(FIXTURES / "data" / "prompts.jsonl")], cluster__device="cpu")
    load_config(write_job(grpo), [f"{ACTOR}.context_parallel_size=2"])
    # world 8 = TP 2 x CP 2 x PP 4 x DP 1; CP 3 does not divide it
    probs = problems_of(write_job(small_job), [f"{ACTOR}.context_parallel_size=3"])
    assert any("is not divisible by TP x PP x CP = 1 x 1 x 3" in p for p in probs), probs


def test_rl_layout_rules(write_job, small_job):
    job = with_keys(small_job, algorithm__name="ppo", data__train_batch_size=8,
                    actor_rollout_ref__actor__ppo_mini_batch_size=8, actor_rollout_ref__actor__use_kl_loss=True,
                    critic={"megatron": {"tensor_model_parallel_size": 2, "use_mbridge": True}})
    job["actor_rollout_ref"]["actor"]["megatron"] = {"pipeline_model_parallel_size": 2}
    probs = problems_of(write_job(job), ["cluster.nproc_per_node=8"])
    assert not any(p.startswith(f"{ACTOR}.pipeline_model_parallel_size") for p in probs)  # PP rollout is supported
    assert any(p.startswith("actor_rollout_ref.ref.megatron.pipeline_model_parallel_size: 1 differs from the actor's 2") for p in probs)
    assert any(p.startswith("critic.megatron.tensor_model_parallel_size: 2 differs from the actor's 1") for p in probs)
    assert any(p.startswith("critic.megatron.use_mbridge: the critic's value head") for p in probs)
    job["actor_rollout_ref"]["actor"]["megatron"] = {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}
    probs = problems_of(write_job(job), ["cluster.nproc_per_node=8"])
    assert not any(p.startswith(f"{ACTOR}.virtual_pipeline_model_parallel_size") for p in probs), probs  # VPP rollout too
    job["actor_rollout_ref"]["actor"]["megatron"] = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
    probs = problems_of(write_job(job))
    assert not any(p.startswith(f"{ACTOR}.sequence_parallel") for p in probs), probs  # RL runs with sequence parallel
