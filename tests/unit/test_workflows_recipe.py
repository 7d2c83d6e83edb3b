"""A workflow job's config rules, and how the RL recipe turns episodes into rows (trinity.trainer.recipes.
workflow): layout, masks, scores and groups, the outcome reward on the last assistant token of a mask with
holes; the example config and the YAML of docs/workflows.md validate."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import FIXTURES, HF_CONFIGS, REPO
from tests.unit.test_config import problems_of, with_keys
from trinity.config.loader import load_config
from trinity.config.schema.workflow import Limits
from trinity.testing.chat_templates import QWEN2_5
from trinity.trainer.recipes.rl import last_token_rewards
from trinity.trainer.recipes.workflow import episode_rows
from trinity.workflows.backends import ScriptedBackend
from trinity.workflows.calculator import calculator_workflow
from trinity.workflows.guess_number import guess_number_workflow
from trinity.workflows.runner import run_workflow


def rl_job(**workflow) -> dict:
    return {
        "algorithm": {"name": "grpo"},
        "model": {"path": str(HF_CONFIGS / "qwen2_5_0_5b")},
        "data": {"train_files": [str(FIXTURES / "data" / "prompts.jsonl")], "train_batch_size": 8,
                 "max_prompt_length": 64},
        "cluster": {"device": "cuda", "nproc_per_node": 8},
        "trainer": {"micro_batch_size": 1},
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 8}, "rollout": {"n": 2, "response_length": 64}},
        "workflow": {"function": "calculator", **workflow},
    }


def test_a_workflow_job_validates_and_its_context_defaults_to_the_rl_sequence(write_job):
    cfg = load_config(write_job(rl_job(args={"tools_in_prompt": True}, max_turns=3))).config
    assert cfg.workflow.function == "calculator" and cfg.workflow.args == {"tools_in_prompt": True}
    assert cfg.workflow_context_tokens == 128  # max_prompt_length 64 + response_length 64
    assert cfg.workflow.limits(cfg.workflow_context_tokens) == Limits(max_turns=3, context_tokens=128)
    assert load_config(write_job(rl_job(context_tokens=100))).config.workflow_context_tokens == 100


def test_settings_that_cannot_take_effect_are_refused_all_at_once(write_job):
    job = with_keys(rl_job(context_tokens=129), reward={"function": "math_verify"}, data__val_files=[
        str(FIXTURES / "data" / "prompts.jsonl")], actor_rollout_ref__actor__megatron={"tensor_model_parallel_size": 2})
    probs = problems_of(write_job(job))
    assert ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size: workflows generate on one rank per model "
            "replica (the ranks of a model-parallel group would have to batch the same turns into the same engine "
            "calls); set it to 1 or remove the workflow block") in probs
    assert ("reward: a workflow scores its own episodes, so the reward block would not take effect; remove it "
            "(the workflow returns session.finish(reward=...))") in probs
    assert any(p.startswith("data.val_files: evaluation scores single responses") for p in probs), probs
    assert ("workflow.context_tokens: 129 tokens is more than data.max_prompt_length + actor_rollout_ref.rollout."
            "response_length = 128, the sequence length the token budgets, the KV cache and the model's positions "
            "are checked against; raise data.max_prompt_length or lower workflow.context_tokens (unset, it is 128)"
            ) in probs
    probs = problems_of(write_job(with_keys(rl_job(), algorithm__name="dapo")))
    assert ("workflow: dapo samples with its own recipe (dynamic sampling) and cannot run a workflow; use grpo, rloo, "
            "ppo, reinforce_plus_plus or cispo, or remove the block") in probs
    sft = {"model": {"path": str(HF_CONFIGS / "qwen2_5_0_5b")},
           "data": {"train_files": [str(FIXTURES / "data" / "sft.jsonl")], "seq_length": 512},
           "cluster": {"device": "cuda", "nproc_per_node": 8}, "trainer": {"global_batch_size": 16, "micro_batch_size": 1},
           "workflow": {"function": "guess_number"}}
    assert ("workflow: sft does not generate, so a workflow cannot run; remove the block or use an RL algorithm "
            "(grpo, rloo, ppo, reinforce_plus_plus, cispo)") in problems_of(write_job(sft))


def test_a_users_workflow_is_found_without_running_it(write_job, tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    (tmp_path / "my_flows.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "async def play(task, session):\n    return session.finish(reward=1.0)\n"
        "def plain(task, session):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    assert load_config(write_job(rl_job(function="my_flows:play"))).config.workflow.function == "my_flows:play"
    probs = problems_of(write_job(rl_job(function="my_flows:plain")))
    assert any(re.fullmatch(r"workflow\.function: .*my_flows\.py defines plain with `def`; a workflow is a coroutine: "
                            r"write `async def plain\(task, session, \*\*args\)`", p) for p in probs), probs
    probs = problems_of(write_job(rl_job(function="my_flows:missing")))
    assert any(re.fullmatch(r"workflow\.function: .*my_flows\.py does not define 'missing' at top level \(its "
                            r"top-level async functions: play\)", p) for p in probs), probs
    probs = problems_of(write_job(rl_job(function="no_such_flows:play")))
    assert f"workflow.function: module no_such_flows not found in {tmp_path} or on the Python path; install it or run trinity from its folder" in probs
    assert not marker.exists()  # validation parsed the file, never ran it


@pytest.mark.parametrize("path", ["configs/grpo_calculator_tiny_cpu.yaml", "configs/smollm2_guess_number_cpu.yaml",
                                  "docs/workflows.md"])
def test_the_example_configs_validate(path, tmp_path):
    text = (REPO / path).read_text()
    if path.endswith(".md"):  # the YAML block of docs/workflows.md's `trinity run` section
        (text,) = re.findall(r"```yaml\n(# trinity run.*?)```", text, flags=re.DOTALL)
    job = yaml.safe_load(text)
    job["model"]["path"] = str(HF_CONFIGS / "qwen2_5_0_5b")  # a config-only model folder; the data files unchecked
    cfg = load_config(_write(tmp_path, job), check_paths=False).config
    assert cfg.workflow is not None and cfg.is_rl


def _write(tmp_path: Path, job: dict) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(job))
    return p


def test_the_outcome_reward_sits_on_the_last_assistant_token_of_a_mask_with_holes():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    rewards = last_token_rewards(torch.tensor([2.0, 3.0, 5.0]), mask)
    expected = torch.zeros(3, 7)
    expected[0, 4], expected[1, 2] = 2.0, 3.0  # row 2 has no counted token: no reward
    assert torch.equal(rewards, expected)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from trinity.testing.tiny_assets import make_tiny_tokenizer

    tok = AutoTokenizer.from_pretrained(str(make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))))
    tok.chat_template = QWEN2_5
    return tok


def test_episodes_become_rows_prompt_then_masked_response(tokenizer):
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+7"}}\n</tool_call>'
    tasks = [{"prompt": "12+7=", "answer": "19"}, {"secret": 5, "low": 1, "high": 9}]
    # task 0 twice (a tool call then the answer; a wrong answer), task 1 twice (two guesses; the workflow
    # raises before its first turn under on_error zero: no sequence, so its group has one row)
    a, b = run_workflow(calculator_workflow, tasks[:1], ScriptedBackend(tokenizer, [call, "20", "19"], logprob=-0.25),
                        tokenizer, n=2)
    (c,) = run_workflow(guess_number_workflow, tasks[1:], ScriptedBackend(tokenizer, ["3", "5"], logprob=-0.5), tokenizer)
    d = run_workflow(_raises, tasks[1:], ScriptedBackend(tokenizer, []), tokenizer, limits=Limits(on_error="zero"))[0]
    assert [len(e.turns) for e in (a, b, c, d)] == [2, 1, 2, 0] and d.end == "error" and d.sequences == ()
    assert (a.reward, b.reward, c.reward, d.reward) == (1.0, 0.0, 1.0 - 1 / 8, 0.0)
    built = episode_rows([a, b, c, d], [0, 0, 1, 1], pad_id=tokenizer.pad_token_id)
    ro = built.rollout
    # d gives an empty row, a group of its own (outside task 1's baseline) that trains nothing
    assert built.groups == [0, 0, 1, -4] and built.episode == [0, 1, 2, 3]
    assert built.scores.tolist() == [1.0, 0.0, 0.875, 0.0]
    P = ro.prompt_len
    assert ro.prompt_mask[3].tolist() == [0] * (P - 1) + [1] and ro.response_mask[3].sum() == 0
    # padded to 6 rows (another data-parallel rank has more): two more empty rows scored 0
    padded = episode_rows([a, b, c, d], [0, 0, 1, 1], pad_id=tokenizer.pad_token_id, rows=6)
    assert padded.groups == [0, 0, 1, -4, -5, -6] and padded.episode == [0, 1, 2, 3, -1, -1]
    assert padded.scores.tolist() == [1.0, 0.0, 0.875, 0.0, 0.0, 0.0]
    assert torch.equal(padded.rollout.tokens[:4], ro.tokens) and padded.rollout.response_mask[3:].sum() == 0
    for row, ep in enumerate((a, b, c)):
        (seq,) = ep.sequences
        first = seq.loss_mask.index(1)
        assert first == len(ep.turns[0].prompt_ids)  # the prompt is the first turn's prompt
        n = len(seq.tokens) - first
        assert ro.prompt_mask[row].tolist() == [0] * (P - first) + [1] * first
        assert ro.tokens[row, :P - first].eq(tokenizer.pad_token_id).all()
        assert ro.tokens[row, P - first: P + n].tolist() == list(seq.tokens)
        assert ro.response_mask[row].tolist() == list(seq.loss_mask[first:]) + [0] * (ro.response_len - n)
        assert ro.logprobs[row, :n].tolist() == list(seq.logprobs[first:])
    # the two-turn rows have a hole (the tool's / the user's tokens) between their assistant turns
    for row, ep in ((0, a), (2, c)):
        seq = ep.sequences[0]
        region = ro.response_mask[row, : len(seq.tokens) - seq.loss_mask.index(1)].tolist()
        assert region[0] == 1 and 0 in region and region[-1] == 1
    rewards = last_token_rewards(built.scores, ro.response_mask)
    assert rewards[0].nonzero().flatten().tolist() == [int(ro.response_mask[0].nonzero().max())]


async def _raises(task, session):
    raise RuntimeError("environment down")


def test_grpo_rloo_and_gae_on_conversation_rows(tokenizer):
    """The group baseline is over a task's conversations; every assistant token of a conversation (both
    turns, across the hole between them) gets its advantage, the tool's and user's tokens none."""
    from trinity.algorithms.advantages import gae_advantages, grpo_outcome_advantages, rloo_outcome_advantages

    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+7"}}\n</tool_call>'
    a, b = run_workflow(calculator_workflow, [{"prompt": "12+7=", "answer": "19"}],
                        ScriptedBackend(tokenizer, [call, "20", "19"]), tokenizer, n=2)
    (c,) = run_workflow(guess_number_workflow, [{"secret": 5, "low": 1, "high": 9}],
                        ScriptedBackend(tokenizer, ["3", "5"]), tokenizer)
    built = episode_rows([a, b, c], [0, 0, 1], pad_id=tokenizer.pad_token_id)
    mask = built.rollout.response_mask.float()
    rewards = last_token_rewards(built.scores, built.rollout.response_mask)
    per_row = {
        "grpo": torch.tensor([2 ** -0.5, -(2 ** -0.5), 0.875]),  # (score - mean) / std; a group of one keeps its score
        "rloo": torch.tensor([1.0, -1.0, 0.875]),  # score - the mean of the others
    }
    grpo, _ = grpo_outcome_advantages(rewards.sum(-1), built.groups, mask)
    rloo, _ = rloo_outcome_advantages(rewards.sum(-1), built.groups, mask)
    for name, adv in (("grpo", grpo), ("rloo", rloo)):
        assert torch.allclose(adv, per_row[name].unsqueeze(-1) * mask, atol=1e-5), name
    # PPO's GAE (gamma = lam = 1, values 0): the outcome reaches every assistant token before it, across holes
    gae, _ = gae_advantages(rewards, torch.zeros_like(mask), mask, whiten=False)
    assert torch.equal(gae, built.scores.unsqueeze(-1) * mask)
