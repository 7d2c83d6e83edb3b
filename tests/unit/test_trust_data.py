"""Issue 19 items 1, 10, 12: no training on garbage, and bad inputs refused at validate time.

- A model folder without tokenizer files is refused by `trinity validate` / `trinity run` (transformers
  would load a tokenizer that encodes everything to nothing and the job would train at loss 0).
- The data layer refuses a tokenizer that encodes text to nothing, a sample or prompt that tokenises to
  nothing, data whose samples are all dropped as too long, and a batch without a trained token.
- `reward.function`, `data.seq_length` against the model's context, and dataset folders are checked by
  `trinity validate` with precise wording; the plan says which file of user code a reward runs.

Validation tests need no weights: the config.json fixtures stand in for model folders (they carry the tiny
byte-level tokenizer's files so that they pass the tokenizer check).
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, HF_CONFIGS, REPO
from trinity.config.loader import load_config
from trinity.errors import ConfigError, UserError

QWEN = HF_CONFIGS / "qwen2_5_0_5b"


def problems_of(path, overrides=()) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config(path, list(overrides))
    return err.value.problems


def _starting(problems: list[str], prefix: str) -> str:
    found = [p for p in problems if p.startswith(prefix)]
    assert found, f"no problem starting with {prefix!r} in {problems}"
    return found[0]


@pytest.fixture
def rl_job(small_job):
    job = copy.deepcopy(small_job)
    job["algorithm"] = {"name": "grpo"}
    job["data"] = {"train_files": [str(FIXTURES / "data" / "prompts.jsonl")], "train_batch_size": 8,
                   "max_prompt_length": 64}
    job["actor_rollout_ref"] = {"actor": {"ppo_mini_batch_size": 8}, "rollout": {"n": 2, "response_length": 32}}
    return job


def config_only_model(tmp_path: Path) -> Path:
    """A model folder as a user might copy it by hand: config.json but no tokenizer files."""
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(QWEN / "config.json", folder / "config.json")
    return folder


# --- item 1: tokenizer files ------------------------------------------------------------------------


def test_validate_refuses_model_folder_without_tokenizer_files(write_job, small_job, tmp_path):
    folder = config_only_model(tmp_path)
    job = copy.deepcopy(small_job)
    job["model"]["path"] = str(folder)
    p = _starting(problems_of(write_job(job)), "model.path: ")
    assert p == (
        f"model.path: {folder} has no tokenizer files (tokenizer.json, tokenizer.model, or vocab.json + merges.txt); "
        "copy them from the original model folder, or set model.tokenizer_path to a folder that has them"
    )
    # A separate tokenizer folder is named by its own key; half a BPE vocabulary names the missing half.
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "vocab.json").write_text("{}")
    job["model"]["tokenizer_path"] = str(tok)
    p = _starting(problems_of(write_job(job)), "model.tokenizer_path: ")
    assert p.startswith(f"model.tokenizer_path: {tok} has no merges.txt (vocab.json is there")
    (tok / "merges.txt").write_text("#version: 0.2\n")
    assert load_config(write_job(job)).config.model.tokenizer_path == str(tok)
    # A tokenizer_path that is a file says so.
    job["model"]["tokenizer_path"] = str(tok / "vocab.json")
    assert _starting(problems_of(write_job(job)), "model.tokenizer_path: ").endswith(
        "vocab.json is a file, not a folder; point it at the folder holding tokenizer.json"
    )


def test_run_refuses_model_without_tokenizer_before_any_process(write_job, small_job, tmp_path):
    """`trinity run` as the issue reproduced it: exit 2, one block naming the folder, nothing started."""
    folder = config_only_model(tmp_path)
    job = copy.deepcopy(small_job)
    job["model"]["path"] = str(folder)
    job["cluster"] = {"device": "cpu", "nproc_per_node": 1}
    job["trainer"].update(total_steps=2, output_dir=str(tmp_path / "run"))
    out = subprocess.run([sys.executable, "-m", "trinity.cli.main", "run", "--config", str(write_job(job))],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"model.path: {folder} has no tokenizer files" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "logs").exists()


def test_load_tokenizer_refuses_folder_without_tokenizer_files(tmp_path):
    from trinity.data.loader import load_tokenizer

    folder = config_only_model(tmp_path)
    with pytest.raises(UserError, match=rf"^{folder}: the tokenizer folder has no tokenizer files \(tokenizer.json"):
        load_tokenizer(folder)
    with pytest.raises(UserError, match=r"tokenizer folder does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_empty_tokenizer_is_refused_before_any_sample(tmp_path):
    """What transformers returns for a qwen2 folder without tokenizer files: it encodes text to []."""
    from transformers import AutoTokenizer

    from trinity.data.loader import build_sft_data
    from trinity.data.prompts import build_prompt_data

    empty = AutoTokenizer.from_pretrained(str(config_only_model(tmp_path)))
    assert empty("Hello world", add_special_tokens=False)["input_ids"] == []  # the silent failure
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "response": "2"}) + "\n")
    with pytest.raises(UserError, match=r"the tokenizer encodes text to no tokens \('Hello world 123' -> \[\]\)"):
        build_sft_data([data], empty, seq_len=32, packing=True, global_batch_size=1, micro_batch_size=1, seed=0)
    with pytest.raises(UserError, match=r"the tokenizer encodes text to no tokens"):
        build_prompt_data([FIXTURES / "data" / "prompts.jsonl"], empty, batch_size=1, max_prompt_length=32, seed=0)


def test_damaged_tokenizer_file_is_one_line(tmp_path):
    from trinity.data.loader import load_tokenizer

    folder = config_only_model(tmp_path)
    (folder / "tokenizer.json").write_text("{")  # a download cut short
    with pytest.raises(UserError, match=rf"^{folder}: cannot load the tokenizer \(JSONDecodeError: .*\); its files are "
                                        "damaged or from another model"):
        load_tokenizer(folder)


@pytest.fixture(scope="module")
def lossy_tokenizer():
    """A real BPE tokenizer over a few ASCII characters and no unknown token: other characters vanish,
    as with a tokenizer that is not the data's (the probe text still encodes)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set("Helo wrd123+=") | set("abcdefghijklmnopqrstuvwxyz0123456789 "))
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["</s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="</s>")


def test_sample_that_tokenises_to_nothing_names_its_line(tmp_path, lossy_tokenizer):
    from trinity.data.loader import build_sft_data

    assert lossy_tokenizer("ÄÖ", add_special_tokens=False)["input_ids"] == []
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "response": "2"}) + "\n"
                    + json.dumps({"prompt": "ÄÖ", "response": "ÜÜ"}) + "\n")
    with pytest.raises(UserError, match=rf"^{data}:2: nothing to train on: the sample tokenises to 1 token\(s\)"):
        build_sft_data([data], lossy_tokenizer, seq_len=32, packing=True, global_batch_size=1, micro_batch_size=1,
                       seed=0)


def test_prompt_that_tokenises_to_nothing_names_its_line(tmp_path, lossy_tokenizer):
    from trinity.data.prompts import build_prompt_data

    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"prompt": "ÄÖ", "answer": 1}) + "\n")
    with pytest.raises(UserError, match=rf"^{data}:2: the prompt tokenises to no tokens \('ÄÖ'\)"):
        build_prompt_data([data], lossy_tokenizer, batch_size=1, max_prompt_length=16, seed=0)


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from trinity.testing.tiny_assets import make_tiny_tokenizer

    return AutoTokenizer.from_pretrained(str(make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))))


def test_all_samples_truncated_away_and_empty_files(tmp_path, tiny_tokenizer):
    from trinity.data.loader import build_sft_data

    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"prompt": "x" * 100, "response": "y"}) + "\n" for _ in range(3)))
    kw = dict(seq_len=16, packing=True, global_batch_size=1, micro_batch_size=1, seed=0)
    with pytest.raises(UserError, match=r"all 3 samples were dropped as too long: none has a response token within "
                                        r"data.seq_length = 16 tokens"):
        build_sft_data([data], tiny_tokenizer, **kw)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(UserError, match=rf"^{empty}: no samples; the training files hold no records"):
        build_sft_data([empty], tiny_tokenizer, **kw)


def test_batch_without_trained_token_is_an_error_not_a_step():
    from trinity.data.loader import RowSampler, SFTData
    from trinity.data.packing import pack
    from trinity.data.sft import Sample, SFTStats

    rows = pack([Sample([5, 6, 7], [0, 0, 0]), Sample([5, 6], [0, 1])], 8, pad_id=0)
    assert rows.row_loss_tokens.tolist() == [1]  # both documents share one row: the step trains one token
    data = SFTData(rows, RowSampler(rows.num_rows, global_batch_size=1, micro_batch_size=1, shuffle=False), SFTStats(),
                   source="mem.jsonl")
    data.next_global_batch()
    assert data.last_step_loss_tokens == 1
    rows = pack([Sample([5, 6, 7], [0, 0, 1]), Sample([1, 2], [1, 0])], 3, pad_id=0)
    data = SFTData(rows, RowSampler(rows.num_rows, global_batch_size=1, micro_batch_size=1, shuffle=False), SFTStats(),
                   source="mem.jsonl")
    data.next_global_batch()  # row 0: [5, 6, 7] trains on 7
    with pytest.raises(UserError, match=r"^mem.jsonl: a global batch has no token to train on \(epoch 0, rows 1\)"):
        data.next_global_batch()  # row 1: [1, 2]; its only loss token is the first, which is never a label


# --- item 10: validate-time checks --------------------------------------------------------------------


def test_seq_length_beyond_the_models_context(write_job, small_job, rl_job):
    job = copy.deepcopy(small_job)
    job["data"]["seq_length"] = 40000
    assert _starting(problems_of(write_job(job)), "data.seq_length: ") == (
        f"data.seq_length: 40000 tokens is more than the model's max_position_embeddings 32768 "
        f"({QWEN / 'config.json'}); use at most 32768"
    )
    job["data"]["seq_length"] = 32768
    load_config(write_job(job))
    rl_job["data"]["max_prompt_length"] = 32000
    rl_job["actor_rollout_ref"]["rollout"]["response_length"] = 1000
    assert _starting(problems_of(write_job(rl_job)), "data.max_prompt_length: ").startswith(
        "data.max_prompt_length: 32000 + actor_rollout_ref.rollout.response_length 1000 = 33000 tokens is more than "
        "the model's max_position_embeddings 32768"
    )


def test_dataset_path_that_is_a_directory(write_job, small_job, tmp_path):
    folder = tmp_path / "train.parquet"  # e.g. Spark's output: a folder of part files
    folder.mkdir()
    job = copy.deepcopy(small_job)
    job["data"]["train_files"] = [str(folder)]
    p = _starting(problems_of(write_job(job)), "data.train_files.0: ")
    assert p.startswith(f"data.train_files.0: {folder} is a directory")
    assert "list the .jsonl" in p and "does not exist" not in p


def _rl_with_reward(write_job, rl_job, function: str, **reward):
    job = copy.deepcopy(rl_job)
    job["reward"] = {"function": function, **reward}
    return write_job(job)


def test_reward_function_file_and_name_checked_without_running_it(write_job, rl_job, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths start where trinity runs
    marker = tmp_path / "imported"
    (tmp_path / "my_reward.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).write_text('ran')  # must not run at validate time\n"
        "def helper(x):\n    return x\n\n"
        "def score(prompts, responses, answers):\n    return [0.0 for _ in responses]\n"
    )
    cfg = load_config(_rl_with_reward(write_job, rl_job, "my_reward.py:score")).config
    assert cfg.reward.function == "my_reward.py:score"
    assert not marker.exists()

    probs = problems_of(_rl_with_reward(write_job, rl_job, "my_reward.py:scor"))
    assert _starting(probs, "reward.function: ") == (
        f"reward.function: {tmp_path / 'my_reward.py'} does not define 'scor' at top level "
        "(its top-level functions: helper, score)"
    )
    assert _starting(problems_of(_rl_with_reward(write_job, rl_job, "missing.py:score")), "reward.function: ") == (
        f"reward.function: file missing.py does not exist (relative paths start at {tmp_path}, where trinity runs); "
        "fix the path in 'file.py:function'"
    )
    (tmp_path / "pkg.py").mkdir()
    assert _starting(problems_of(_rl_with_reward(write_job, rl_job, "pkg.py:score")), "reward.function: ") == (
        "reward.function: pkg.py is a directory; name the .py file that defines score"
    )
    (tmp_path / "broken.py").write_text("def score(:\n")
    assert _starting(problems_of(_rl_with_reward(write_job, rl_job, "broken.py:score")), "reward.function: ").startswith(
        f"reward.function: {tmp_path / 'broken.py'}:1: syntax error in the reward module: "
    )
    assert not marker.exists()


def test_reward_module_found_on_the_path_without_import(write_job, rl_job, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards_pkg").mkdir()
    (tmp_path / "rewards_pkg" / "__init__.py").write_text("raise RuntimeError('package code ran at validate time')\n")
    (tmp_path / "rewards_pkg" / "math_r.py").write_text("try:\n    import fancy\nexcept ImportError:\n"
                                                         "    def score(p, r, a):\n        return [1.0] * len(r)\n")
    load_config(_rl_with_reward(write_job, rl_job, "rewards_pkg.math_r:score"))
    assert "rewards_pkg" not in sys.modules
    probs = problems_of(_rl_with_reward(write_job, rl_job, "rewards_pkg.math_r:nope"))
    assert _starting(probs, "reward.function: ").endswith("does not define 'nope' at top level (it defines no top-level function)")
    probs = problems_of(_rl_with_reward(write_job, rl_job, "rewards_pkg.absent:score"))
    assert _starting(probs, "reward.function: ") == (
        f"reward.function: module rewards_pkg.absent not found in {tmp_path} or on the Python path; install it, "
        "run trinity from its folder, or write 'path/to/file.py:function'"
    )
    # The shipped example and the built-ins validate; a built-in's own settings are checked too.
    load_config(_rl_with_reward(write_job, rl_job, "trinity.rewards.arithmetic_reward:closeness"))
    assert _starting(problems_of(_rl_with_reward(write_job, rl_job, "format")), "reward.") == (
        "reward.format_pattern: must be set when reward.function is 'format'"
    )


# --- item 12: the plan says which user code a reward runs -----------------------------------------------


def test_plan_names_the_reward_code(write_job, rl_job, tmp_path, monkeypatch):
    from trinity.config.plan import build_plan, render_plan

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_reward.py").write_text("def score(p, r, a):\n    return [0.0] * len(r)\n")

    def plan_lines(function: str) -> list[str]:
        loaded = load_config(_rl_with_reward(write_job, rl_job, function))
        plan = build_plan(loaded.config, loaded.facts, loaded.warnings)
        assert json.loads(json.dumps(plan.to_dict()))["reward"] == plan.reward
        return [line for line in render_plan(plan).splitlines() if line.startswith("reward:")]

    assert plan_lines("my_reward.py:score") == [
        "reward: runs code from my_reward.py (function score) with this job's rights; "
        "read it before running a config you did not write"
    ]
    assert plan_lines("math_exact_match") == ["reward: built-in math_exact_match, extractor last_number"]
    assert plan_lines("trinity.rewards.arithmetic_reward:closeness") == [
        "reward: trinity.rewards.arithmetic_reward:closeness (shipped with trinity: trinity/rewards/arithmetic_reward.py)"
    ]


def test_rl_doc_says_reward_code_runs_with_the_jobs_rights():
    text = (REPO / "docs" / "rl.md").read_text()
    assert "A user reward function is code that runs with the job's rights." in text
