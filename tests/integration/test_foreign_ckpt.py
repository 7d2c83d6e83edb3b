"""Foreign megatron-core dist checkpoints (#20): a checkpoint written by another tool (verl's
converter_hf_to_mcore.py saves `GPTModel.sharded_state_dict()` with megatron-core's
`dist_checkpointing.save`, and no trinity_meta.json) loads through `use_dist_checkpointing` +
`dist_checkpointing_path`. The contract is megatron-core's sharded-state-dict keys and shapes.

The foreign checkpoint here is made as such a tool makes it: a GPTModel from megatron-core's own local
layer spec and TransformerConfig (no trinity model code), filled from the HF tensors by hand, saved with
`dist_checkpointing.save`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trinity.convert.options import megatron_config
from trinity.convert.builtin import load_hf_weights
from trinity.convert.dist_ckpt import load_model_checkpoint
from trinity.convert.hf_io import HFCheckpoint
from trinity.convert.jobs import _build
from trinity.errors import UserError
from trinity.models.facts import ModelFacts
from trinity.testing.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.timeout(300)


def plain_gpt(hf_dir: Path, *, num_layers: int | None = None) -> torch.nn.Module:
    """A megatron-core GPTModel (local spec) of the HF Qwen2/Llama in `hf_dir`, with its weights."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    hf = json.loads((hf_dir / "config.json").read_text())
    layers = num_layers or hf["num_hidden_layers"]
    heads, groups, hidden = hf["num_attention_heads"], hf["num_key_value_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or hidden // heads
    bias = hf["model_type"] == "qwen2" or hf.get("attention_bias", False)
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        kv_channels=head_dim, ffn_hidden_size=hf["intermediate_size"], normalization="RMSNorm",
        layernorm_epsilon=hf["rms_norm_eps"], gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=bias, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, perform_initialization=False, params_dtype=torch.float32,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    vocab = -(-hf["vocab_size"] // 128) * 128  # Megatron-LM's make-vocab-size-divisible-by 128
    tied = hf.get("tie_word_embeddings", False)
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
        max_sequence_length=hf["max_position_embeddings"], position_embedding_type="rope",
        rotary_base=hf.get("rope_theta") or hf.get("rope_parameters", {}).get("rope_theta", 10000.0),
        share_embeddings_and_output_weights=tied,
    )
    ck = HFCheckpoint(hf_dir)
    get = ck.get

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(vocab - t.shape[0], t.shape[1])])

    def qkv(kind: str, i: int) -> torch.Tensor:
        # megatron-core keeps each key/value group's query heads, key and value next to each other.
        q, k, v = (get(f"model.layers.{i}.self_attn.{n}_proj.{kind}") for n in "qkv")
        per = heads // groups
        q = q.reshape(groups, per * head_dim, *q.shape[1:])
        k = k.reshape(groups, head_dim, *k.shape[1:])
        v = v.reshape(groups, head_dim, *v.shape[1:])
        return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])

    sd = {"embedding.word_embeddings.weight": pad(get("model.embed_tokens.weight")),
          "decoder.final_layernorm.weight": get("model.norm.weight")}
    if not tied:
        sd["output_layer.weight"] = pad(get("lm_head.weight"))
    for i in range(layers):
        pre, hf_pre = f"decoder.layers.{i}.", f"model.layers.{i}."
        sd[pre + "input_layernorm.weight"] = get(hf_pre + "input_layernorm.weight")
        sd[pre + "self_attention.linear_qkv.weight"] = qkv("weight", i)
        if bias:
            sd[pre + "self_attention.linear_qkv.bias"] = qkv("bias", i)
        sd[pre + "self_attention.linear_proj.weight"] = get(hf_pre + "self_attn.o_proj.weight")
        sd[pre + "pre_mlp_layernorm.weight"] = get(hf_pre + "post_attention_layernorm.weight")
        sd[pre + "mlp.linear_fc1.weight"] = torch.cat([get(hf_pre + "mlp.gate_proj.weight"), get(hf_pre + "mlp.up_proj.weight")])
        sd[pre + "mlp.linear_fc2.weight"] = get(hf_pre + "mlp.down_proj.weight")
    result = model.load_state_dict(sd, strict=False)
    assert not [k for k in result.missing_keys if not k.endswith("_extra_state")], result.missing_keys
    assert not result.unexpected_keys
    return model


def save_foreign(model: torch.nn.Module, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """What verl's converter does: the model's sharded state dict, saved by megatron-core, nothing else."""
    from megatron.core import dist_checkpointing

    model.to(dtype)
    out.mkdir()
    dist_checkpointing.save(model.sharded_state_dict(), str(out))
    assert not (out / "trinity_meta.json").exists()
    return out


@pytest.fixture(scope="module")
def session():
    from trinity.distributed.parallel import destroy, init_parallel

    megatron = megatron_config()
    init_parallel(device="cpu", layout=megatron.layout(), seed=1)
    yield megatron
    destroy()


@pytest.mark.parametrize("tied", [False, True])
def test_foreign_checkpoint_loads_the_same_weights_as_the_hf_folder(session, tmp_path, tied):
    hf = make_tiny_hf_model("qwen2", tmp_path / "hf", tie_word_embeddings=tied)
    facts = ModelFacts.from_hf_dir(hf)
    ckpt = save_foreign(plain_gpt(hf), tmp_path / "foreign")
    ours = _build(facts, session, "cpu", torch.float32)
    reference = _build(facts, session, "cpu", torch.float32)
    with torch.no_grad():
        for p in ours[0].parameters():
            p.fill_(7.0)  # anything not loaded stays visibly wrong
    assert load_model_checkpoint(ours, ckpt) == {}
    load_hf_weights(reference, hf, facts)
    got, want = dict(ours[0].named_parameters()), dict(reference[0].named_parameters())
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_bf16_foreign_checkpoint_loads_into_fp32_parameters(session, tmp_path):
    hf = make_tiny_hf_model("qwen2", tmp_path / "hf")
    facts = ModelFacts.from_hf_dir(hf)
    ckpt = save_foreign(plain_gpt(hf), tmp_path / "foreign", torch.bfloat16)
    ours = _build(facts, session, "cpu", torch.float32)
    load_model_checkpoint(ours, ckpt)
    reference = _build(facts, session, "cpu", torch.float32)
    load_hf_weights(reference, hf, facts)
    for (name, p), q in zip(ours[0].named_parameters(), reference[0].parameters()):
        assert p.dtype == torch.float32 and torch.equal(p, q.to(torch.bfloat16).float()), name


def test_checkpoint_of_another_model_is_refused_naming_keys_and_shapes(session, tmp_path):
    hf = make_tiny_hf_model("qwen2", tmp_path / "hf")
    facts = ModelFacts.from_hf_dir(hf)
    ours = _build(facts, session, "cpu", torch.float32)
    # One layer instead of two: every per-layer key has a different stacked shape.
    fewer = save_foreign(plain_gpt(hf, num_layers=1), tmp_path / "fewer")
    with pytest.raises(UserError) as exc:
        load_model_checkpoint(ours, fewer)
    text = str(exc.value)
    assert text.startswith(f"{fewer}: the dist checkpoint does not match the model (")
    assert "shape differs: decoder.layers." in text and "[1, " in text and "vs model [2, " in text
    assert "(7 shape differs: " in text and "and 4 more);" in text and text.endswith("it was written for another model or model config")
    # A Llama (no q/k/v bias) checkpoint for the Qwen2 model: the bias keys are missing.
    llama = make_tiny_hf_model("llama", tmp_path / "llama")
    other = save_foreign(plain_gpt(llama), tmp_path / "llama_ckpt")
    with pytest.raises(UserError, match=r"1 missing from the checkpoint: decoder\.layers\.self_attention\.linear_qkv\.bias\)"):
        load_model_checkpoint(ours, other)
    # ... and the reverse: the Qwen2 checkpoint has a tensor the Llama model lacks.
    qwen = save_foreign(plain_gpt(hf), tmp_path / "qwen_ckpt")
    llama_model = _build(ModelFacts.from_hf_dir(llama), session, "cpu", torch.float32)
    with pytest.raises(UserError, match=r"1 not in the model: decoder\.layers\.self_attention\.linear_qkv\.bias\)"):
        load_model_checkpoint(llama_model, qwen)


@pytest.mark.slow
def test_sft_job_trains_from_a_foreign_checkpoint(session, tmp_path):
    """`use_dist_checkpointing` + `dist_checkpointing_path` at a foreign checkpoint of `model.path`: the
    job validates, loads it (no trinity_meta.json, no conversion) and trains with the losses of the same
    job loading the HF folder."""
    from tests.integration.test_sft_cpu import job, losses, run_job
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer, write_sft_dataset

    tok = make_tiny_tokenizer(tmp_path / "tokenizer")
    model = make_tiny_qwen2(tmp_path / "model", tok, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    assets = {"model": model, "data": write_sft_dataset(tmp_path / "sft.jsonl", 200, seed=0)}
    ckpt = save_foreign(plain_gpt(model), tmp_path / "foreign")
    steps = {"total_steps": 2}
    assert run_job(job(assets, tmp_path / "hf_run", trainer=steps), tmp_path / "hf.yaml") == 0
    cfg = job(assets, tmp_path / "run", trainer=steps,
              megatron={"use_dist_checkpointing": True, "dist_checkpointing_path": str(ckpt)})
    assert run_job(cfg, tmp_path / "job.yaml") == 0
    assert not (tmp_path / "run" / "mcore_cache").exists()  # the checkpoint was used, not a conversion
    got, want = losses(tmp_path / "run"), losses(tmp_path / "hf_run")
    assert sorted(got) == [1, 2]
    for step in (1, 2):
        assert got[step] == pytest.approx(want[step], rel=1e-5), (got, want)


def test_validate_refuses_a_folder_that_is_no_dist_checkpoint(tmp_path, write_job):
    from trinity.config.loader import load_config
    from trinity.errors import ConfigError

    hf = make_tiny_hf_model("qwen2", tmp_path / "hf")
    (tmp_path / "not_a_ckpt").mkdir()
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    path = write_job({
        "model": {"path": str(hf)}, "data": {"train_files": [str(data)], "seq_length": 32},
        "cluster": {"device": "cpu", "nproc_per_node": 1},
        "actor_rollout_ref": {"actor": {"megatron": {
            "use_dist_checkpointing": True, "dist_checkpointing_path": str(tmp_path / "not_a_ckpt")}}},
    })
    with pytest.raises(ConfigError) as exc:
        load_config(path, check_paths=True)
    assert (
        f"actor_rollout_ref.actor.megatron.dist_checkpointing_path: {tmp_path / 'not_a_ckpt'} is not a "
        "megatron-core dist checkpoint (no .metadata in it)"
    ) in str(exc.value)


def test_critic_backbone_from_a_foreign_lm_checkpoint(session, tmp_path):
    """A critic (value head [1, hidden] as output layer) takes every tensor but the LM's output layer:
    `exclude=("output_layer.weight",)` skips it in the key check and in the load."""
    from trinity.models.build import build_model

    hf = make_tiny_hf_model("qwen2", tmp_path / "hf")
    facts = ModelFacts.from_hf_dir(hf)
    ckpt = save_foreign(plain_gpt(hf), tmp_path / "foreign")
    critic = build_model(facts, session, device="cpu", dtype=torch.float32, value_head=True)
    head = critic[0].output_layer.weight.detach().clone()
    with pytest.raises(UserError, match=r"1 shape differs: output_layer\.weight \[128, 64\] vs model \[1, 64\]"):
        load_model_checkpoint(critic, ckpt)
    load_model_checkpoint(critic, ckpt, exclude=("output_layer.weight",))
    reference = _build(facts, session, "cpu", torch.float32)
    load_hf_weights(reference, hf, facts)
    want = dict(reference[0].named_parameters())
    for name, p in critic[0].named_parameters():
        if name == "output_layer.weight":
            assert torch.equal(p, head)
        else:
            assert torch.equal(p, want[name]), name
