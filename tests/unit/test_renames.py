"""Keys of verl, Trinity-RFT and ROLL named differently here (trinity.config.renames): every row is
answered by `trinity validate` with its key here, every key here exists, and docs/migrating.md's table
is the one generated from the rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import FIXTURES, REPO
from trinity.config import renames
from trinity.config.loader import _model_at, load_config
from trinity.errors import ConfigError

SEEDS = FIXTURES / "seeds"


def _problems(job: dict, tmp_path: Path, overrides: list[str] = ()) -> list[str]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    with pytest.raises(ConfigError) as err:
        load_config(path, list(overrides), check_paths=False)
    return [p.replace(str(path), "job.yaml") for p in err.value.problems]


def _job() -> dict:
    return {"model": {"path": str(FIXTURES / "hf_configs" / "qwen2_5_0_5b")}, "cluster": {"device": "cpu"},
            "data": {"train_files": [str(FIXTURES / "data" / "sft.jsonl")]}}


def _set(job: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        job = job.setdefault(part, {})
    job[last] = value


def test_the_doc_table_is_the_generated_one():
    text = (REPO / "docs" / "migrating.md").read_text(encoding="utf-8")
    assert renames.markdown() in text, "docs/migrating.md is stale: run python -m trinity.config.renames docs/migrating.md"
    assert "| verl | `<role>.optim.lr_decay_style` | `<role>.optim.lr_scheduler` |" in text


def test_every_new_key_exists_and_every_old_key_does_not():
    for hint in renames.HINTS.values():
        assert _model_at(tuple(hint.old.split("."))[:-1]) is None or \
            hint.old.rsplit(".", 1)[1] not in _model_at(tuple(hint.old.split("."))[:-1]).model_fields, hint.old
        for new in filter(None, (k.strip() for k in hint.new.split(","))):
            *parents, last = new.split(".")
            owner = _model_at(tuple(parents))
            assert owner is not None and last in owner.model_fields, f"{hint.old}: {new} is not a key"


def test_every_row_is_answered_with_its_key_here(tmp_path):
    job = _job()
    for old in renames.HINTS:
        _set(job, old, 1)
    problems = _problems(job, tmp_path)
    lines = (tmp_path / "job.yaml").read_text().splitlines()
    for old, hint in renames.HINTS.items():
        (line,) = [p for p in problems if p.startswith(f"{old}: ")]
        leaf = old.rsplit(".", 1)[1]
        assert f"(job.yaml:" in line and f"{leaf}: 1" in lines[int(line.split("(job.yaml:")[1].split(")")[0]) - 1]
        fix = f"; use {hint.new} instead" if hint.new else "; remove it"
        assert f"{hint.row.source}'s key" in line and fix in line, line
    # besides: the sft job's rules on what is left (the critic block, now empty, of a job without a critic)
    assert [p for p in problems if p.split(": ")[0] not in renames.HINTS] == [
        "critic: only ppo uses a critic, but algorithm.name is sft; remove the critic block"]


def test_verl_lr_decay_style_override_gets_the_new_key(tmp_path):
    problems = _problems(_job(), tmp_path, ["actor_rollout_ref.actor.optim.lr_decay_style=cosine"])
    assert problems == [
        "actor_rollout_ref.actor.optim.lr_decay_style: verl's key, named differently here "
        "(<override 1>: actor_rollout_ref.actor.optim.lr_decay_style=cosine); "
        "use actor_rollout_ref.actor.optim.lr_scheduler instead (cosine or constant)"]


def test_rolls_section_pasted_whole_names_every_key(tmp_path):
    job = {**_job(), **yaml.safe_load((SEEDS / "roll_megatron_train.yaml").read_text())}
    problems = _problems(job, tmp_path)
    by_key = {p.split(": ", 1)[0]: p for p in problems}
    assert by_key["actor_train.strategy_args.strategy_config"].endswith(
        "; use actor_rollout_ref.actor.megatron instead (the mapping moves unchanged)")
    assert by_key["actor_train.training_args.learning_rate"].endswith("; use actor_rollout_ref.actor.optim.lr instead")
    line = (tmp_path / "job.yaml").read_text().splitlines().index("  infer_batch_size: 2") + 1
    assert by_key["actor_train.infer_batch_size"] == f"actor_train.infer_batch_size: ROLL's key, no equivalent here (job.yaml:{line}); remove it"
    # nothing of the strategy_config mapping itself is reported: it moves as a whole
    assert not any(k.startswith("actor_train.strategy_args.strategy_config.") for k in by_key)
    assert len(problems) == 13 and all(k.startswith("actor_train.") for k in by_key), problems


def test_a_key_without_a_row_in_a_foreign_section_is_named(tmp_path):
    job = _job()
    job["actor_rollout_ref"] = {"model": {"path": "x", "use_remove_padding": True}}
    problems = _problems(job, tmp_path)
    line = (tmp_path / "job.yaml").read_text().splitlines().index("    path: x") + 1
    assert problems == [
        f"actor_rollout_ref.model.path: verl's key, named differently here (job.yaml:{line}); use model.path instead",
        f"actor_rollout_ref.model.use_remove_padding: unknown key (job.yaml:{line + 1}); remove it (docs/migrating.md "
        "maps the keys of verl, Trinity-RFT and ROLL that have an equivalent)"]
    # a plain typo keeps its did-you-mean
    assert "did you mean 'lr_scheduler'" in _problems(_job(), tmp_path, ["actor_rollout_ref.actor.optim.lr_schedulr=x"])[0]
