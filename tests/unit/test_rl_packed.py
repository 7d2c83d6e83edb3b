"""Padding-free RL training phases (rollout_forward.Batching / pack_rollout): packed rows give the same
log-probs, values, losses and updated weights as padded rows (fp32, CPU); on-policy old log-probs come
from the update's own forward; the rollout-vs-training log-prob gap; the config keys."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from trinity.config.megatron import MegatronConfig
from trinity.config.schema import ActorConfig, CriticConfig, OptimConfig
from trinity.data.packing import first_fit_decreasing

PROMPTS = [[5, 9, 17, 3, 44, 2], [7, 1], [100, 12, 8, 60], [33, 34], [21, 22, 23], [70]]
TOL = 1e-5


# ---------------------------------------------------------------- first-fit decreasing (pure logic)


@pytest.mark.parametrize("seed", range(5))
def test_first_fit_decreasing_respects_budget_and_places_every_item_once(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 50, (200,), generator=g).tolist()
    bins = first_fit_decreasing(lengths, 64)
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(200))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert all(b == sorted(b) for b in bins)  # original order inside a bin
    # first fit: no later bin's items would have fit in an earlier bin when they were placed; at least
    # it packs within the classic FFD bound of 11/9 OPT + 1 (OPT >= total / budget)
    assert len(bins) <= 11 / 9 * (sum(lengths) / 64) + 1 + 1


def test_first_fit_decreasing_examples():
    assert first_fit_decreasing([5, 3, 4, 2], 7) == [[0, 3], [1, 2]]
    assert first_fit_decreasing([7, 7], 7) == [[0], [1]]
    assert first_fit_decreasing([], 7) == []
    with pytest.raises(ValueError, match="exceed"):
        first_fit_decreasing([8], 7)


# ---------------------------------------------------------------- shared helpers (also run by the 2-rank worker)


def _rollout(model, facts, seed: int = 1):
    """Sampled responses of varied lengths (many EOS ids), prompts of varied lengths."""
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams

    hot = SamplingParams(temperature=1.0, max_new_tokens=9, eos_token_ids=tuple(range(1, 60)))
    return reference_generate(model, PROMPTS * 2, hot, vocab_size=facts.vocab_size, pad_id=0,
                    generator=torch.Generator().manual_seed(seed))


def _engine(facts, path, m: MegatronConfig, role: str = "actor", like=None):
    """A trained RoleEngine on CPU fp32; the critic's value head is initialised from `like`'s (same weights)."""
    from trinity.config.roles import Role
    from trinity.convert.builtin import load_hf_weights
    from trinity.models.build import build_model
    from trinity.trainer.engine import RoleEngine

    critic = role == "critic"
    chunks = build_model(facts, m, device="cpu", dtype=torch.float32, value_head=critic)
    if critic:
        if like is not None:
            chunks[0].load_state_dict(like.modules[0].state_dict())
    else:
        load_hf_weights(chunks, path, facts)
    # adam_eps 1: the first Adam step is ~ lr * grad, so the weights after it compare the gradients (with
    # the default eps a near-zero gradient's rounding would decide a whole +-lr step)
    optim = OptimConfig(lr=1.0, adam_eps=1.0, weight_decay=0.0)
    return RoleEngine(Role.critic if critic else Role.actor, chunks, m, optim, dtype=torch.float32, total_steps=10)


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.modules[0].parameters()]


def _max_diff(a, b) -> float:
    if isinstance(a, list):
        return max(_max_diff(x, y) for x, y in zip(a, b))
    return float((a - b).abs().max())


def compare_packed_padded(facts, path, m: MegatronConfig, *, loss_agg_mode: str = "token-mean", critic: bool = True,
                          seed: int = 1, budget: int = 24) -> dict:
    """Every difference packed - padded: forward-only log-probs and values, one actor (and critic) update's
    losses and weights, and on-policy old log-probs against the separate pass. At PP>1 the packed rows
    have one length, as the RL recipe makes them (one schedule call for all of them)."""
    from trinity.trainer.recipes.rl import _from_last_stage as last
    from trinity.trainer.recipes.rl_update import Experience, actor_update, critic_update
    from trinity.trainer.recipes.rollout_forward import Batching, infer_logprobs, infer_values

    res: dict = {}
    padded, packed = Batching(3), Batching(3, budget=budget, same_length=m.pipeline_model_parallel_size > 1)
    a_pad, a_pack = _engine(facts, path, m), _engine(facts, path, m)
    ro = _rollout(a_pad.modules[0], facts, seed)
    lengths = ro.response_mask.sum(-1)
    res["varied_lengths"] = int(lengths.min()) < int(lengths.max())
    lp_pad = infer_logprobs(a_pad, ro, facts.vocab_size, padded.reset())
    res["padding_padded"] = 1 - padded.real / padded.computed
    lp_pack = infer_logprobs(a_pack, ro, facts.vocab_size, packed.reset())
    res["padding_packed"] = 1 - packed.real / packed.computed
    res["packed_micro_batches"] = len(packed.split(ro))
    res["logp"] = _max_diff(lp_pad, lp_pack)
    res["logp_vs_rollout"] = _max_diff(lp_pack, ro.logprobs)
    adv = torch.linspace(-1, 1, ro.tokens.shape[0]).unsqueeze(1) * ro.response_mask
    cfg = ActorConfig(ppo_mini_batch_size=2, loss_agg_mode=loss_agg_mode, entropy_coeff=0.01)
    n = ro.tokens.shape[0]
    m_pad = last(actor_update(a_pad, Experience(ro, lp_pad, adv, adv), cfg, facts.vocab_size, seqs_per_update=n // 2,
                              micro=padded).metrics)
    m_pack = last(actor_update(a_pack, Experience(ro, lp_pad, adv, adv), cfg, facts.vocab_size, seqs_per_update=n // 2,
                               micro=packed).metrics)
    res["pg_loss"] = abs(m_pad["actor/pg_loss"] - m_pack["actor/pg_loss"])
    res["loss"] = abs(m_pad["actor/loss"] - m_pack["actor/loss"])
    res["params"] = _max_diff(_params(a_pad), _params(a_pack))
    res["params_moved"] = _max_diff(_params(a_pad), _params(_engine(facts, path, m)))

    # on-policy: old log-probs from the update's own forward vs the separate pass (same weights)
    a_sep, a_fused = _engine(facts, path, m), _engine(facts, path, m)
    sep = infer_logprobs(a_sep, ro, facts.vocab_size, packed.reset())
    actor_update(a_sep, Experience(ro, sep, adv, adv), cfg, facts.vocab_size, seqs_per_update=n, micro=packed)
    fused = actor_update(a_fused, Experience(ro, None, adv, adv), cfg, facts.vocab_size, seqs_per_update=n, micro=packed)
    res["on_policy_old_logp"] = _max_diff(fused.old_logp, sep)
    res["on_policy_params"] = _max_diff(_params(a_sep), _params(a_fused))

    if critic:
        c_pad = _engine(facts, path, m, "critic")
        c_pack = _engine(facts, path, m, "critic", like=c_pad)
        v_pad = infer_values(c_pad, ro, padded.reset())
        v_pack = infer_values(c_pack, ro, packed.reset())
        res["values"] = _max_diff(v_pad, v_pack)
        ret = adv + 0.5
        ccfg = CriticConfig()
        c_m_pad = last(critic_update(c_pad, Experience(ro, lp_pad, adv, ret, values=v_pad), ccfg, loss_agg_mode,
                                seqs_per_update=n // 2, micro=padded))
        c_m_pack = last(critic_update(c_pack, Experience(ro, lp_pad, adv, ret, values=v_pad), ccfg, loss_agg_mode,
                                 seqs_per_update=n // 2, micro=packed))
        res["vf_loss"] = abs(c_m_pad["critic/vf_loss"] - c_m_pack["critic/vf_loss"])
        res["critic_params"] = _max_diff(_params(c_pad), _params(c_pack))
    return res


def check(res: dict, tol: float = TOL) -> None:
    assert res["varied_lengths"], res
    assert res["padding_packed"] < res["padding_padded"], res
    for key in ("logp", "pg_loss", "loss", "params", "on_policy_old_logp", "on_policy_params", "values", "vf_loss",
                "critic_params"):
        if key in res:
            assert res[key] <= tol, (key, res)
    assert res["params_moved"] > 1e-4, res  # the update did something the comparison could miss
    assert res["logp_vs_rollout"] <= tol, res


# ---------------------------------------------------------------- TP=1


@pytest.fixture(scope="module")
def facts_path(tiny_qwen2_tp1):
    return tiny_qwen2_tp1


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_packed_matches_padded(facts_path, mode):
    facts, path = facts_path
    check(compare_packed_padded(facts, path, MegatronConfig(), loss_agg_mode=mode, critic=mode == "token-mean"))


def test_pack_rollout_layout(facts_path):
    """Each row holds real tokens only (prompt without padding, response up to EOS), every sequence once,
    within the budget; rows are rounded up to `multiple`; results come back in the rollout's order."""
    from trinity.rollout.reference import reference_generate  # noqa: F401 (the model's rollout)
    from trinity.trainer.recipes.rollout_forward import pack_rollout, sequence_lengths

    facts, path = facts_path
    model = _engine(facts, path, MegatronConfig()).modules[0]
    ro = _rollout(model, facts)
    p, r = sequence_lengths(ro)
    rows = pack_rollout(ro, 20, multiple=4)
    assert sorted(i for m in rows for i in m.index.tolist()) == list(range(ro.tokens.shape[0]))
    for m in rows:
        assert m.real_tokens <= 20 and m.tokens.shape[1] % 4 == 0 and m.tokens.shape[1] - m.real_tokens < 4
        got, offset = m.tokens[0].tolist(), 0
        for j, i in enumerate(m.index.tolist()):
            n = int(p[i] + r[i])
            want = ro.tokens[i, ro.prompt_len - int(p[i]): ro.prompt_len + int(r[i])].tolist()
            assert got[offset: offset + n] == want and (m.doc_ids[0, offset: offset + n] == j).all()
            offset += n
        assert (m.doc_ids[0, offset:] == -1).all()
    same = pack_rollout(ro, 20, same_length=True)
    assert len({m.tokens.shape[1] for m in same}) == 1


def test_gap_metric_is_small_and_positive(facts_path):
    from trinity.trainer.recipes.rl import _logprob_gap
    from trinity.trainer.recipes.rollout_forward import Batching, infer_logprobs

    facts, path = facts_path
    engine = _engine(facts, path, MegatronConfig())
    ro = _rollout(engine.modules[0], facts)
    gap = _logprob_gap(ro.logprobs, infer_logprobs(engine, ro, facts.vocab_size, Batching(2, 24)), ro.response_mask)
    # KV-cache decoding vs one packed pass in fp32: rounding only
    assert 0 < gap["rollout/logprob_diff_mean"] <= gap["rollout/logprob_diff_max"] < 1e-5, gap


# ---------------------------------------------------------------- config


def _rl_job(small_job, **actor) -> dict:
    job = dict(small_job)
    job["algorithm"] = {"name": "grpo"}
    job["data"] = {"train_files": small_job["data"]["train_files"], "max_prompt_length": 64, "train_batch_size": 8}
    job["trainer"] = {"micro_batch_size": 1}
    job["actor_rollout_ref"] = {"actor": {"ppo_mini_batch_size": 8, **actor}, "rollout": {"n": 2, "response_length": 64}}
    return job


def test_config_budget_too_small_is_refused_naming_the_key(small_job, write_job):
    from trinity.config.loader import load_config
    from trinity.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(write_job(_rl_job(small_job, ppo_max_token_len_per_gpu=100)))
    text = str(err.value)
    assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu: 100 tokens cannot hold the longest sequence" in text
    assert "= 128" in text
    with pytest.raises(ConfigError, match="ppo_max_token_len_per_gpu: a token budget applies to packed micro batches only"):
        load_config(write_job(_rl_job(small_job, use_dynamic_bsz=False, ppo_max_token_len_per_gpu=4096)))
    job = _rl_job(small_job, ppo_max_token_len_per_gpu=128, recompute_old_log_prob=True, use_kl_loss=True)
    job["actor_rollout_ref"]["ref"] = {"log_prob_max_token_len_per_gpu": 4096}
    cfg = load_config(write_job(job)).config
    assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 128 and cfg.actor_rollout_ref.actor.use_dynamic_bsz
    assert cfg.actor_rollout_ref.ref.log_prob_max_token_len_per_gpu == 4096
    job["actor_rollout_ref"]["ref"] = {"log_prob_max_token_len_per_gpu": 127}
    with pytest.raises(ConfigError, match="actor_rollout_ref.ref.log_prob_max_token_len_per_gpu: 127 tokens"):
        load_config(write_job(job))


def test_unset_budgets_one_padded_micro_batch_and_four_for_the_ref_on_cuda(small_job, write_job):
    """Unset budgets: the actor's (and the critic's) packed micro batch holds one padded micro batch's
    tokens; on CUDA the ref's forward-only pass four times that (on CPU, where packed rows attend through
    a dense mask, one); a set budget is taken as it is."""
    from trinity.config.loader import load_config
    from trinity.config.plan import rl_token_budget
    from trinity.config.roles import Role

    cfg = load_config(write_job(_rl_job(small_job))).config
    one = 1 * (64 + 64)  # micro_batch_size x (max_prompt_length + response_length)
    assert cfg.cluster.device == "cuda"
    assert (rl_token_budget(cfg, Role.actor), rl_token_budget(cfg, Role.ref)) == (one, 4 * one)
    on_cpu = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"device": "cpu"})})
    assert (rl_token_budget(on_cpu, Role.actor), rl_token_budget(on_cpu, Role.ref)) == (one, one)
    job = _rl_job(small_job, ppo_max_token_len_per_gpu=300, use_kl_loss=True)  # a ref block needs a ref
    job["actor_rollout_ref"]["ref"] = {"log_prob_max_token_len_per_gpu": 200}
    cfg = load_config(write_job(job)).config
    assert (rl_token_budget(cfg, Role.actor), rl_token_budget(cfg, Role.ref)) == (300, 200)


# ---------------------------------------------------------------- TP=2 / PP=2 (2 ranks, gloo)


def _worker(rank: int, port: int, model_dir: str, out: str, layout: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.facts import ModelFacts

    m = {"tp2": MegatronConfig(tensor_model_parallel_size=2), "pp2": MegatronConfig(pipeline_model_parallel_size=2),
         "dp2": MegatronConfig()}[layout]
    init_parallel(device="cpu", layout=m.layout(), seed=3)
    try:
        # DP=2: each rank its own rollout and budget, so the ranks run different numbers of micro batches
        dp2 = layout == "dp2"
        res = compare_packed_padded(ModelFacts.from_hf_dir(model_dir), model_dir, m, seed=1 + rank * dp2,
                                    budget=16 if dp2 and rank else 24)
        Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    finally:
        destroy()


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_packed_matches_padded_two_ranks(tmp_path, layout):
    from tests.conftest import run_two_ranks
    from trinity.testing.tiny_models import make_tiny_hf_model

    model_dir = make_tiny_hf_model("qwen2", tmp_path / "qwen2", num_hidden_layers=4)
    run_two_ranks(_worker, str(model_dir), str(tmp_path), layout)
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        if layout == "pp2" and rank == 0:
            res.pop("values", None)  # the first stage's values / losses come from the last stage
        check(res)
    if layout == "dp2":
        counts = {json.loads((tmp_path / f"rank{r}.json").read_text())["packed_micro_batches"] for r in range(2)}
        assert len(counts) == 2, counts  # the case where each rank's loss scale must cancel its own count


# ---------------------------------------------------------------- a tiny GRPO job (trinity run)


@pytest.mark.slow
def test_grpo_job_on_policy_old_logprobs_and_gap_metric(tmp_path):
    """One mini-batch per step: no old_logp phase, the same step as with the separate pass (within 1e-5);
    the log-prob gap and the phases' padding fractions are in metrics.jsonl."""
    from tests.integration.test_rl_cpu import job, rows, run_job
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer, write_prompt_dataset

    tok = make_tiny_tokenizer(tmp_path / "tokenizer")
    model = make_tiny_qwen2(tmp_path / "model", tok, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    assets = {"model": model, "data": write_prompt_dataset(tmp_path / "prompts.jsonl", 64, seed=0)}
    got = {}
    for recompute in (False, True):
        out = tmp_path / f"recompute_{recompute}"
        cfg = job(assets, out, "grpo", 2)
        cfg["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] = 4  # = data.train_batch_size: on-policy
        cfg["actor_rollout_ref"]["actor"]["recompute_old_log_prob"] = recompute
        run_job(cfg, tmp_path / f"recompute_{recompute}.yaml")
        got[recompute] = rows(out)
    for fused, separate in zip(got[False], got[True]):
        assert "time/old_logp_s" not in fused and "time/old_logp_s" in separate
        assert 0 < fused["rollout/logprob_diff_mean"] <= fused["rollout/logprob_diff_max"] < 1e-4, fused
        for key in ("padding_fraction/ref", "padding_fraction/update_actor"):
            assert 0 <= fused[key] < 0.2, (key, fused[key])  # packed rows: only the last row's tail
        for key in ("reward/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/ref_kl",
                    "rollout/logprob_diff_mean", "rollout/logprob_diff_max"):
            assert fused[key] == pytest.approx(separate[key], rel=1e-5, abs=1e-6), (key, fused[key], separate[key])
        assert fused["actor/ppo_kl"] == 0.0 and fused["actor/pg_clipfrac"] == 0.0  # ratio 1 exactly


def test_on_policy_decision(small_job, write_job):
    """The update's own forward gives the old log-probs only when nothing needs them before it and the
    update starts from the rollout's weights."""
    from trinity.config.loader import load_config
    from trinity.rollout.types import Rollout
    from trinity.trainer.recipes.rl import RLRecipe

    ro = Rollout(torch.zeros(16, 4, dtype=torch.long), torch.ones(16, 2), torch.ones(16, 2), torch.zeros(16, 2))

    def decide(warmup: bool = False, algorithm: dict | None = None, **actor) -> bool:
        job = _rl_job(small_job, **actor)
        job["algorithm"].update(algorithm or {})
        recipe = object.__new__(RLRecipe)
        recipe.cfg = load_config(write_job(job)).config
        a = recipe.cfg.actor_rollout_ref.actor
        recipe.seqs_per_update = a.ppo_mini_batch_size * recipe.cfg.actor_rollout_ref.rollout.n
        return recipe.on_policy(ro, warmup)

    assert decide()  # 8 prompts x 2 = the 16 sequences in one update
    assert not decide(recompute_old_log_prob=True)
    assert not decide(ppo_epochs=2)
    assert not decide(ppo_mini_batch_size=4)
    assert not decide(warmup=True)  # critic-only step: no actor update to take them from
    assert not decide(algorithm={"use_kl_in_reward": True})  # the KL penalty shapes rewards before the update
