"""Sequence parallel and VPP in RL (#20): the layout rules serve both for the rollout, the padding of
rows for SP, the switch that runs the rollout without SP, and ROLL's strategy_config as an RL actor."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_seeds import GROUPED_GEMM_LIMIT, HAVE_GROUPED_GEMM, _base, _roll, _validate, _with_te


def test_pad_to_multiple_appends_masked_positions():
    from trinity.distributed.sequence_parallel import pad_to_multiple

    tokens, mask = torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    t, m = pad_to_multiple(tokens, mask, 2, pad_id=3)
    assert t.tolist() == [[0, 5, 6, 3], [7, 8, 9, 3]] and m.tolist() == [[0, 1, 1, 0], [1, 1, 1, 0]]
    assert pad_to_multiple(tokens, mask, 3)[0] is tokens  # already a multiple: unchanged
    assert pad_to_multiple(tokens, mask, 1)[0] is tokens


def _roll_rl_job(block: dict) -> dict:
    """ROLL's actor_train strategy_config (TP=2, PP=2, VPP=8, EP=4, SP) as the actor (and ref: one layout)
    of a GRPO job on its 32 GPUs."""
    job = _base("grpo", model="qwen3_30b_a3b", nnodes=4)
    job["data"]["train_batch_size"] = 32
    job["actor_rollout_ref"]["actor"].update(megatron=block, ppo_mini_batch_size=32)
    job["actor_rollout_ref"]["ref"] = {"megatron": dict(block)}
    return job


def test_roll_train_strategy_config_validates_in_grpo(tmp_path, monkeypatch):
    block = _roll("roll_megatron_train.yaml", "actor_train")
    code, answer = _validate(_roll_rl_job(block), tmp_path)
    gemm = [] if HAVE_GROUPED_GEMM else [f"{r}.megatron{GROUPED_GEMM_LIMIT}" for r in ("actor_rollout_ref.actor", "actor_rollout_ref.ref")]
    assert sorted(answer["problems"]) == sorted(gemm), answer
    # with grouped GEMM the whole layout (TP=2 x EP=4 with sequence parallel, PP=2 x VPP=8) validates for RL
    _with_te(monkeypatch)
    code, answer = _validate(_roll_rl_job(block), tmp_path)
    assert code == 0, answer
    assert [r["layout"] for r in answer["roles"]] == ["TP=2 PP=2 VPP=8 CP=1 EP=4 ETP=2 DP=8"] * 2, answer["roles"]


def test_vpp_needs_micro_batches_in_groups_of_pp(tmp_path):
    job = _base("sft")
    job["trainer"].update(global_batch_size=24, micro_batch_size=1)
    job["actor_rollout_ref"] = {"actor": {"megatron": {"pipeline_model_parallel_size": 2,
                                                       "virtual_pipeline_model_parallel_size": 2}}}
    code, answer = _validate(job, tmp_path)
    assert code == 0, answer  # 24 / (1 x DP 4) = 6 micro batches, a multiple of PP 2
    job["trainer"]["global_batch_size"] = 12
    code, answer = _validate(job, tmp_path)
    assert answer["problems"] == [
        "trainer.global_batch_size: with virtual pipeline stages each step's micro batches per DP rank (3) must be a "
        "multiple of PP = 2 (megatron's interleaved schedule); use a multiple of trainer.micro_batch_size x DP x PP = 8"
    ], answer


# --- the switch the rollout runs under -----------------------------------------------------------------


@pytest.fixture
def gpt():
    """A tiny GPTModel chunk of megatron-core (one process, TP=1) with every SP flag raised by hand, as a
    TP>1 build with sequence_parallel has them."""
    import tempfile
    from pathlib import Path

    from trinity.convert.options import megatron_config
    from trinity.convert.jobs import _build, parallel_session
    from trinity.models.facts import ModelFacts
    from trinity.testing.tiny_models import make_tiny_hf_model

    with tempfile.TemporaryDirectory() as d, parallel_session("cpu", megatron_config()):
        facts = ModelFacts.from_hf_dir(make_tiny_hf_model("qwen2", Path(d) / "hf"))
        (model,) = _build(facts, megatron_config(), "cpu", torch.float32)
        model.config.sequence_parallel = True
        for m in model.modules():
            for attr in ("sequence_parallel", "reduce_scatter_embeddings", "scatter_to_sequence_parallel"):
                if isinstance(getattr(m, attr, None), bool):
                    setattr(m, attr, True)
        yield model


def _flags(model) -> dict[str, bool]:
    out = {"config": model.config.sequence_parallel}
    for name, m in model.named_modules():
        for attr in ("sequence_parallel", "reduce_scatter_embeddings", "scatter_to_sequence_parallel"):
            if isinstance(getattr(m, attr, None), bool):
                out[f"{name}.{attr}"] = getattr(m, attr)
    return out


def test_sequence_parallel_disabled_flips_every_flag_and_restores_them(gpt):
    from trinity.distributed.sequence_parallel import sequence_parallel_disabled

    before = _flags(gpt)
    assert all(before.values())
    for key in ("embedding.reduce_scatter_embeddings", "embedding.word_embeddings.reduce_scatter_embeddings",
                "embedding.scatter_to_sequence_parallel", "output_layer.sequence_parallel",
                "decoder.layers.0.self_attention.linear_qkv.sequence_parallel",
                "decoder.layers.0.self_attention.linear_proj.sequence_parallel",
                "decoder.layers.1.mlp.linear_fc2.sequence_parallel"):
        assert key in before, key
    with sequence_parallel_disabled([gpt]):
        assert not any(_flags(gpt).values()), _flags(gpt)
    assert _flags(gpt) == before
    with pytest.raises(ValueError), sequence_parallel_disabled(gpt):  # restored on an error too
        raise ValueError
    assert _flags(gpt) == before


def test_sequence_parallel_disabled_fails_loudly_when_megatron_renames_a_flag(gpt):
    from trinity.distributed.sequence_parallel import sequence_parallel_disabled

    del gpt.embedding.word_embeddings.reduce_scatter_embeddings
    with pytest.raises(RuntimeError, match=r"VocabParallelEmbedding has no \['reduce_scatter_embeddings'\]"):
        with sequence_parallel_disabled(gpt):
            pass
    assert gpt.config.sequence_parallel  # nothing was flipped
