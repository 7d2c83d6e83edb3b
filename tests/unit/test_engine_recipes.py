"""The training engine's pieces that need no training run: checkpoint RNG as tensors, resume with a
changed config, the config's optimizer hyper-parameters over a checkpoint's, the one metrics logger
(elapsed / ETA, the RL console line and its progress bar on a pseudo-terminal), the layout rules
shared by validate and convert, the megatron-core patch checks, and the recipe registry."""

from __future__ import annotations

import json
import os
import pty
import random
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from trinity.errors import UserError


# --- RNG state: tensors, loaded with weights_only=True ---------------------------------------------


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    from trinity.trainer.checkpoint import load_rng, save_rng

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = tmp_path / "rank_0.pt"
    save_rng(path)
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    torch.load(path, weights_only=True)  # no pickled objects beyond tensors and plain values
    load_rng(path)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


def test_an_earlier_versions_rng_file_still_loads_weights_only(tmp_path):
    """Checkpoints written before: random.getstate() / np.random.get_state() tuples, which torch's
    weights-only loader accepts; anything else pickled is refused (one line naming the file), never unpickled."""
    import megatron.core.tensor_parallel as tp

    from trinity.trainer.checkpoint import load_rng

    random.seed(4), np.random.seed(4), torch.manual_seed(4)
    path = tmp_path / "rank_0.pt"
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                "tracker": tp.get_cuda_rng_tracker().get_states()}, path)
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    load_rng(path)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({"python": Evil()}, path)
    with pytest.raises(UserError, match=r"rank_0\.pt: refused to load: it holds Python objects other than tensors"):
        load_rng(path)


# --- resume with a changed config ------------------------------------------------------------------


class _Cfg:
    def __init__(self, tree: dict):
        self.tree = tree

    def model_dump(self, mode: str = "json") -> dict:
        return self.tree


def _tree(**over) -> dict:
    tree = {
        "model": {"path": "/m", "dtype": "auto"}, "algorithm": {"name": "sft"},
        "data": {"train_files": ["a.jsonl"], "seq_length": 64},
        "trainer": {"total_steps": 10, "log_interval": 1, "resume": "auto", "output_dir": "/o", "seed": 1},
        "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-5}, "megatron": {"tensor_model_parallel_size": 1,
                                                                            "dist_checkpointing_path": "/o/a"}}},
    }
    for key, value in over.items():
        node = tree
        *parents, leaf = key.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return tree


def _write_saved(tmp_path: Path) -> Path:
    import yaml

    ckpt = tmp_path / "step_4"
    ckpt.mkdir()
    (ckpt / "resolved_config.yaml").write_text(yaml.safe_dump(_tree()))
    return ckpt


def test_resume_applies_changed_lr_steps_layout_and_names_them(tmp_path):
    from trinity.trainer.resume import check_resume_config

    ckpt = _write_saved(tmp_path)
    lines = check_resume_config(ckpt, _Cfg(_tree(
        actor_rollout_ref__actor__optim__lr=2e-5, trainer__total_steps=20, trainer__resume=str(ckpt),
        actor_rollout_ref__actor__megatron__tensor_model_parallel_size=2,
        actor_rollout_ref__actor__megatron__dist_checkpointing_path="/elsewhere")))
    assert lines == [
        "resume: actor_rollout_ref.actor.megatron.tensor_model_parallel_size is 2 (the checkpoint had 1): applied",
        "resume: actor_rollout_ref.actor.optim.lr is 2e-05 (the checkpoint had 1e-05): applied",
        "resume: trainer.total_steps is 20 (the checkpoint had 10): applied",
    ]
    assert check_resume_config(ckpt, _Cfg(_tree())) == []
    # a field another trinity version's schema added (at its default) is not a change the user made
    assert check_resume_config(ckpt, _Cfg(_tree(trainer__new_field=None))) == []


@pytest.mark.parametrize("key, value", [("model__path", "/other"), ("algorithm__name", "grpo"),
                                        ("data__seq_length", 128), ("trainer__seed", 2), ("critic", {"optim": {}})])
def test_resume_refuses_a_change_that_makes_it_another_job(tmp_path, key, value):
    from trinity.trainer.resume import check_resume_config

    ckpt = _write_saved(tmp_path)
    with pytest.raises(UserError) as err:
        check_resume_config(ckpt, _Cfg(_tree(**{key: value})))
    dotted = key.replace("__", ".")
    assert str(err.value).startswith(f"{dotted}: {value!r} differs from ")
    assert str(ckpt) in str(err.value) and "trainer.resume=disable" in str(err.value)


def test_a_checkpoint_without_a_stored_config_resumes_silently(tmp_path):
    from trinity.trainer.resume import check_resume_config

    assert check_resume_config(tmp_path, _Cfg(_tree())) == []


def test_the_configs_optimizer_hyperparameters_win_over_the_checkpoints():
    """A megatron optimizer holds a torch optimizer whose param groups carry max_lr / min_lr; loading a
    checkpoint restores the saved ones, which would keep the old LR schedule's peak."""
    from trinity.trainer.engine.optimizer_state import keep_config_hyperparams

    class Wrapper:  # megatron-core's MegatronOptimizer keeps its torch optimizer as `.optimizer`
        def __init__(self):
            self.optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=2e-5, betas=(0.9, 0.95))
            self.optimizer.param_groups[0].update(max_lr=2e-5, min_lr=0.0)

    opt = Wrapper()
    saved = {"max_lr": 1e-5, "min_lr": 1e-6, "betas": (0.9, 0.999), "lr": 1e-5}

    def load():
        opt.optimizer.param_groups[0].update(saved)
        return "extra"

    assert keep_config_hyperparams(opt, load) == "extra"
    group = opt.optimizer.param_groups[0]
    assert (group["max_lr"], group["min_lr"], group["betas"]) == (2e-5, 0.0, (0.9, 0.95))


# --- the one metrics logger: elapsed / ETA, the RL line, the bar on a pseudo-terminal ---------------


def test_console_line_ends_with_elapsed_and_eta(tmp_path, monkeypatch, capsys):
    from trinity.trainer import metrics as M

    monkeypatch.setenv(M.TTY_ENV, "0")
    clock = iter([100.0, 110.0, 130.0])  # logger start, after step 3 (first of this run), after step 4
    monkeypatch.setattr(M.time, "perf_counter", lambda: next(clock))
    logger = M.MetricsLogger(tmp_path, enabled=True, total_steps=12, start_step=2, log_interval=1, tensorboard=False,
                             line=lambda m: [f"x {m['x']}"])
    logger.log({"step": 3, "x": 1})
    logger.log({"step": 4, "x": 2})
    logger.close()
    out = capsys.readouterr().out.splitlines()
    # 10 s for 1 step, 9 to go -> 90 s; then 30 s for 2 steps, 8 to go -> 120 s
    assert out == ["step 3/12 | x 1 | elapsed 0:00:10 | eta 0:01:30", "step 4/12 | x 2 | elapsed 0:00:30 | eta 0:02:00"]


def _rl_row(step: int) -> dict:
    return {"step": step, "reward/mean": 0.25 * step, "response_length/mean": 7.0, "actor/pg_loss": -0.01,
            "step_time_s": 0.5, "odd": float("nan")}


def test_rl_progress_bar_advances_on_a_pseudo_terminal(tmp_path, monkeypatch):
    """Rank 0 of an RL job on a terminal: rich's bar moves with every step (the RL logger used to
    override `log` and never advance it), the RL console line is printed, and TensorBoard would get
    only finite numbers (the same `log` for every recipe)."""
    from trinity.trainer import metrics as M
    from trinity.trainer.recipes.rl import RLRecipe

    monkeypatch.delenv(M.TTY_ENV, raising=False)
    monkeypatch.delenv("CI", raising=False)  # a terminal under CI gets no bar
    monkeypatch.setenv("COLUMNS", "120")
    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    stream = open(slave, "w", closefd=False)
    monkeypatch.setattr(sys, "stdout", stream)
    assert M.console_is_terminal()
    logger = M.MetricsLogger(tmp_path, enabled=True, total_steps=3, start_step=0, log_interval=1, tensorboard=False,
                             line=RLRecipe.line.__get__(object()))
    seen = []
    for step in (1, 2, 3):
        logger.log(_rl_row(step))
        seen.append(logger._progress.tasks[0].completed)
    logger.close()
    stream.flush()
    os.close(slave)
    reader.join(timeout=5)
    os.close(master)
    text = b"".join(chunks).decode(errors="replace")
    assert seen == [1, 2, 3]
    assert "step 2/3 | reward 0.500 | len 7.0 | pg_loss -0.0100 | 0.50 s/step | elapsed" in text, text
    assert "━" in text and "reward 0.750" in text
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


# --- layout rules: one function, two renderings -----------------------------------------------------


def test_validate_and_convert_render_the_same_layout_rule():
    from types import SimpleNamespace

    from trinity.convert.api import check_layout
    from trinity.distributed.layout import ParallelLayout, layout_problems

    facts = SimpleNamespace(num_attention_heads=4, num_query_groups=2, num_layers=6, is_moe=False,
                            num_experts=0, architecture="Qwen2ForCausalLM")
    problems = layout_problems(ParallelLayout(tp=1, pp=2, vpp=2), facts)
    assert problems == [("virtual_pipeline_model_parallel_size", "6 layers are not divisible by PP x VPP = 2 x 2")]
    with pytest.raises(UserError, match=r"^--vpp: 6 layers are not divisible by PP x VPP = 2 x 2$"):
        check_layout(facts, tp=1, pp=2, vpp=2, ep=1, backend="builtin", device="cpu")
    # a rule that names another field spells it as each caller does
    (field, text), = layout_problems(ParallelLayout(pp=1, vpp=2))
    assert "needs pipeline_model_parallel_size > 1" in text
    with pytest.raises(UserError, match=r"^--vpp: needs --pp > 1"):
        check_layout(facts, tp=1, pp=1, vpp=2, ep=1, backend="builtin", device="cpu")


# --- megatron-core patches check what they replace ---------------------------------------------------


def test_a_patch_whose_target_moved_fails_at_enable_naming_it(monkeypatch):
    import megatron.core.optimizer.clip_grads as clip_grads

    from trinity.compat import fused_optimizer

    fused_optimizer.uninstall()
    monkeypatch.delattr(clip_grads, "l2_norm_impl")
    with pytest.raises(UserError, match=r"megatron-core [\d.]+: megatron.core.optimizer.clip_grads has no l2_norm_impl, "
                                        r"which trinity's fused_optimizer patch replaces"):
        fused_optimizer.install()


def test_rope_patch_checks_its_target(monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    from trinity.models import rope

    monkeypatch.delattr(rope_utils, "fused_apply_rotary_pos_emb_thd")
    with pytest.raises(UserError, match="fused_apply_rotary_pos_emb_thd, which trinity's rope patch replaces"):
        rope.install()


# --- recipes, roles, weight sources -----------------------------------------------------------------


def test_every_algorithm_has_a_recipe():
    from trinity.config.schema import AlgorithmName
    from trinity.trainer.recipes import RECIPES, Recipe, get_recipe

    assert set(RECIPES) == {a.value for a in AlgorithmName}
    for name in RECIPES:
        assert issubclass(get_recipe(name), Recipe)
    with pytest.raises(UserError, match="algorithm.name: no recipe is registered for 'kto'"):
        get_recipe("kto")


def test_every_spec_names_code_and_keys_that_exist():
    """Each AlgorithmSpec's strings resolve: its recipe, rules, policy loss, advantage estimator, and the
    config keys of its defaults and of what it owns (a typo would fail only when that algorithm runs)."""
    from trinity.algorithms.advantages import ESTIMATORS
    from trinity.algorithms.registry import ALGORITHMS, load
    from trinity.config.schema import JobConfig
    from trinity.trainer.recipes.rl import RLRecipe

    for spec in ALGORITHMS.values():
        cfg = JobConfig.model_validate({"model": {"path": "unused"}, "algorithm": {"name": spec.name}})
        assert cfg.spec is spec and cfg.is_rl == spec.rollout
        assert issubclass(spec.load_recipe(), RLRecipe) == spec.rollout, spec.name
        assert (spec.advantages in ESTIMATORS) == spec.rollout, spec.name
        assert all(callable(load(rule)) for rule in spec.rules)
        assert spec.policy_loss is None or callable(spec.load_policy_loss())
        for key, value in spec.defaults:
            block = cfg
            for part in key.split("."):
                block = getattr(block, part)
            assert block == value, (spec.name, key)
        for owned in (*spec.owns, *spec.ignores):
            block = cfg
            for part in owned.key.split("."):
                block = getattr(block, part)


def test_weight_source_is_decided_once_per_role(tmp_path):
    from trinity.config.megatron import MegatronConfig
    from trinity.config.roles import Role
    from trinity.config.weights import WeightKind, weight_source

    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "trinity_meta.json").write_text("{}")
    foreign = tmp_path / "foreign"
    foreign.mkdir()

    def cfg(actor: dict, ref: dict | None = None, critic: dict | None = None):
        from types import SimpleNamespace

        return SimpleNamespace(
            model=SimpleNamespace(path="/hf"),
            actor_rollout_ref=SimpleNamespace(actor=SimpleNamespace(megatron=MegatronConfig(**actor)),
                                              ref=SimpleNamespace(megatron=MegatronConfig(**(ref or {})))),
            critic=SimpleNamespace(megatron=MegatronConfig(**(critic or {}))),
        )

    dist = {"use_dist_checkpointing": True, "dist_checkpointing_path": str(ours)}
    assert weight_source(cfg({}), Role.actor).kind is WeightKind.hf
    assert weight_source(cfg({"use_mbridge": True}), Role.actor).kind is WeightKind.mbridge
    assert weight_source(cfg(dist), Role.actor).kind is WeightKind.dist
    # the ref starts from the actor's source unless its own block names one
    assert weight_source(cfg(dist), Role.ref).path == str(ours)
    assert weight_source(cfg({}, ref={"use_dist_checkpointing": True, "dist_checkpointing_path": str(foreign)}),
                         Role.ref).kind is WeightKind.foreign_dist
    # a critic never loads through mbridge: its backbone comes from the HF folder
    assert weight_source(cfg({}, critic={"use_mbridge": True}), Role.critic).kind is WeightKind.hf
    assert Role.from_path("actor_rollout_ref.ref") is Role.ref and not Role.ref.trained and Role.critic.value_head
