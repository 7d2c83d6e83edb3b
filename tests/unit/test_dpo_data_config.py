"""DPO's preference data (trinity.data.preference) and its config rules."""

from __future__ import annotations

import json

import pytest

from tests.unit.test_config import problems_of, with_keys
from trinity.config.loader import load_config
from trinity.errors import UserError


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from trinity.data.loader import load_tokenizer
    from trinity.testing.tiny_assets import make_tiny_tokenizer

    return load_tokenizer(make_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def write(tmp_path, rows):
    p = tmp_path / "pairs.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def answers(tok, samples):
    """The text under each sample's loss mask."""
    return [tok.decode([t for t, m in zip(s.input_ids, s.loss_mask) if m]) for s in samples]


def test_the_three_pair_forms_train_on_the_answers_only(tmp_path, tok):
    from trinity.data.preference import tokenize_pairs
    from trinity.data.readers import read_records

    user, good, bad = [{"role": "user", "content": "1+1="}], {"role": "assistant", "content": "2"}, {"role": "assistant", "content": "3"}
    path = write(tmp_path, [
        {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
        {"prompt": user, "chosen": [good], "rejected": [bad]},
        {"chosen": user + [good], "rejected": user + [bad]},
    ])
    samples, stats = tokenize_pairs(read_records([path]), tok, max_seq_len=64)
    assert stats.samples == 3 and len(samples) == 6
    assert answers(tok, samples) == ["2<|endoftext|>", "3<|endoftext|>"] + ["2<|im_end|>\n", "3<|im_end|>\n"] * 2
    prompt = "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    assert all(tok.decode(s.input_ids).startswith(prompt) for s in samples)


def test_rows_put_a_pair_in_one_micro_batch(tmp_path, tok):
    from trinity.data.preference import build_preference_data

    path = write(tmp_path, [{"prompt": f"{i}+0=", "chosen": str(i), "rejected": "x" * (i + 1)} for i in range(8)])
    data = build_preference_data([path], tok, seq_len=32, global_batch_size=4, micro_batch_size=2, seed=0, shuffle=False)
    micro = data.next_global_batch()
    assert len(micro) == 2 and micro[0]["tokens"].shape == (4, 32)
    trained = micro[0]["loss_mask"].sum(1).tolist()  # chosen 0, chosen 1, rejected 0, rejected 1
    assert trained == [2.0, 2.0, 2.0, 3.0]  # "i" + EOS, then "x" * (i + 1) + EOS; the first token is no label
    state = data.state_dict()
    assert state["position"] == 4 and data.steps_per_epoch == 2


def test_pair_problems_name_the_record(tmp_path, tok):
    from trinity.data.preference import tokenize_pairs
    from trinity.data.readers import read_records

    cases = [
        ({"prompt": "a", "chosen": "b"}, "missing key 'rejected'"),
        ({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
          "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "b"}]},
         "must be conversations that share every message but the last"),
        ({"prompt": "q", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
         "the last message must be the assistant's answer"),
    ]
    for row, text in cases:
        path = write(tmp_path, [row])
        with pytest.raises(UserError, match=text) as err:
            tokenize_pairs(read_records([path]), tok, max_seq_len=64)
        assert str(err.value).startswith(f"{path}:1: ")


def dpo(small_job, **keys):
    return with_keys(small_job, algorithm__name="dpo", **keys)


def test_dpo_builds_a_ref_and_validates_its_options(write_job, small_job):
    cfg = load_config(write_job(dpo(small_job, algorithm__dpo={"beta": 0.5, "loss_type": "ipo"}))).config
    assert list(cfg.roles()) == ["actor_rollout_ref.actor", "actor_rollout_ref.ref"]
    assert (cfg.algorithm.dpo.beta, cfg.algorithm.dpo.loss_type.value, cfg.data.packing) == (0.5, "ipo", False)
    probs = problems_of(write_job(dpo(small_job, algorithm__dpo={"beta": 0, "loss_type": "hinge", "label_smoothing": 0.5})))
    for key in ("beta", "loss_type", "label_smoothing"):
        assert any(p.startswith(f"algorithm.dpo.{key}:") for p in probs), probs


def test_dpo_refuses_rl_options_and_packing(write_job, small_job):
    job = dpo(small_job, actor_rollout_ref__rollout__n=8, actor_rollout_ref__actor__use_kl_loss=True,
              algorithm__kl_coef=0.1, data__packing=True)
    probs = problems_of(write_job(job))
    tail = "not used by dpo (it trains on fixed chosen/rejected pairs: no rollout, reward, RL loss or packing); remove the key (docs/rl.md, DPO)"
    for key in ("actor_rollout_ref.rollout.n", "actor_rollout_ref.actor.use_kl_loss", "algorithm.kl_coef"):
        assert f"{key}: {tail}" in probs
    assert any(p.startswith("data.packing: dpo runs each sequence of a pair in its own row") for p in probs), probs
    # the ref shares the actor's layout, like an RL ref
    job = dpo(small_job, actor_rollout_ref__ref__megatron={"tensor_model_parallel_size": 2})
    assert any(p.startswith("actor_rollout_ref.ref.megatron.tensor_model_parallel_size: 2 differs from the actor's 1")
               for p in problems_of(write_job(job)))


def test_dpo_options_only_with_dpo(write_job, small_job):
    probs = problems_of(write_job(with_keys(small_job, algorithm__dpo={"beta": 0.2})))
    assert "algorithm.dpo: DPO settings apply to algorithm.name dpo, not sft; set algorithm.name: dpo or remove the block" in probs


def test_dpo_refuses_val_files_before_any_process(write_job, small_job, tmp_path):
    """The evaluator reads prompt/response records, not pairs: refused at validate (its spec has no
    evaluation), not at the workers' start."""
    val = tmp_path / "val.jsonl"
    val.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n')
    probs = problems_of(write_job(dpo(small_job, data__val_files=[str(val)])))
    assert "data.val_files: evaluation during training is not available for dpo jobs yet (sft and the RL " \
           "algorithms have it); remove data.val_files" in probs


def test_ipo_refuses_label_smoothing(write_job, small_job):
    probs = problems_of(write_job(dpo(small_job, algorithm__dpo={"loss_type": "ipo", "label_smoothing": 0.1})))
    assert "algorithm.dpo.label_smoothing: 0.1 has no effect with loss_type ipo; remove it, or use sigmoid (conservative DPO) or robust" in probs
