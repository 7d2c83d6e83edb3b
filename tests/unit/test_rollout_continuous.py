"""The continuous-batching rollout engine (CPU, fp32, a real megatron-core GPTModel) against the static
batch of `trinity.rollout.reference`: same greedy tokens, log-probs within 1e-5, rows ending at different
EOS positions, a KV budget that forces several waves, one prefill per prompt for its n samples, TP=2 and
PP=2 (gloo) against TP=1; the config fields and their refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import run_two_ranks
from trinity.config.megatron import MegatronConfig
from trinity.models.facts import ModelFacts
from trinity.rollout.continuous import KVBudget, RolloutStats, generate_continuous, kv_bytes_per_token
from trinity.rollout.decode import StaticDecoder
from trinity.rollout.reference import reference_generate
from trinity.rollout.types import SamplingParams
from trinity.rollout.slots import SlotDecoder

# varying prompt lengths; each prompt 3 times (a group of n = 3 samples)
PROMPTS = [[5, 9, 17, 3, 44, 2, 8, 11], [7, 1], [100, 12, 8, 60], [33, 34, 35]]
NEW = 12


@pytest.fixture(scope="module")
def model(tiny_qwen2_cpu):
    chunk, facts, _ = tiny_qwen2_cpu
    return chunk, facts


def _eos_params(gpt, facts, prompts) -> tuple[SamplingParams, torch.Tensor]:
    """Greedy params whose EOS ids are tokens the model emits at different steps per row (from a run
    without EOS), and the free run's responses."""
    free = reference_generate(gpt, prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW), vocab_size=facts.vocab_size, pad_id=0)
    # the k-th distinct prompt's row ends near step 2 + 3k (greedy: its n copies are identical)
    firsts = sorted({tuple(p): i for i, p in reversed(list(enumerate(prompts)))}.values())
    eos = {int(free.responses[r, 2 + 3 * k]) for k, r in enumerate(firsts)}
    return SamplingParams(temperature=0.0, max_new_tokens=NEW, eos_token_ids=tuple(sorted(eos))), free.responses


def _same(a, b, tol: float = 1e-5) -> None:
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.prompt_mask, b.prompt_mask) and torch.equal(a.response_mask, b.response_mask)
    assert (a.logprobs - b.logprobs).abs().max().item() <= tol


@pytest.mark.parametrize("max_num_seqs", [256, 5])
def test_greedy_equals_static_batch(model, max_num_seqs):
    """Rows of different prompt lengths end at different EOS steps; with 5 slots rows retire and waiting
    rows take their slots mid-rollout."""
    gpt, facts = model
    prompts = [p for p in PROMPTS for _ in range(3)]
    params, _ = _eos_params(gpt, facts, prompts)
    want = reference_generate(gpt, prompts, params, vocab_size=facts.vocab_size, pad_id=0)
    lengths = want.response_mask.sum(1)
    assert 1 < lengths.min() < lengths.max() <= NEW  # rows really end at different steps
    stats = RolloutStats()
    got = generate_continuous(gpt, prompts, params, vocab_size=facts.vocab_size, pad_id=0,
                              budget=KVBudget(max_num_seqs=max_num_seqs), stats=stats)
    _same(got, want)
    assert stats.slots == min(max_num_seqs, len(prompts))
    assert stats.tokens == int(lengths.sum())
    assert stats.prefilled_prompts == len(PROMPTS)  # groups of 3 fit whole in 5 slots: one prefill each


def test_rollout_over_kv_budget_runs_in_waves(model):
    gpt, facts = model
    prompts = [p for p in PROMPTS for _ in range(3)]
    params, _ = _eos_params(gpt, facts, prompts)
    want = reference_generate(gpt, prompts, params, vocab_size=facts.vocab_size, pad_id=0)
    cache_len = 64  # longest prompt + NEW rounded up to 64
    per_slot = kv_bytes_per_token(gpt) * cache_len
    stats = RolloutStats()
    got = generate_continuous(gpt, prompts, params, vocab_size=facts.vocab_size, pad_id=0,
                              budget=KVBudget(kv_cache_memory_gib=2.5 * per_slot / 2**30), stats=stats)
    _same(got, want)
    assert stats.slots == 2 and stats.cache_len == cache_len
    assert stats.waves >= 6  # 12 rows through 2 slots


def test_step_timing_per_bucket_adds_up(model):
    """RolloutStats.time_buckets (benchmarks/generate.py --buckets): timing changes no token, and the
    buckets' steps, rows and KV reads add up to the call's through waves, retirements and compaction."""
    from trinity.rollout.buckets import plain_bucket

    gpt, facts = model
    prompts = [p for p in PROMPTS for _ in range(3)]
    kw = dict(vocab_size=facts.vocab_size, pad_id=0, budget=KVBudget(max_num_seqs=5),
              response_lengths=[1 + (5 * r) % NEW for r in range(len(prompts))])
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    plain, timed = RolloutStats(), RolloutStats(time_buckets=True)
    _same(generate_continuous(gpt, prompts, params, stats=plain, **kw),
          generate_continuous(gpt, prompts, params, stats=timed, **kw), tol=0.0)
    assert not plain.buckets
    assert set(timed.buckets) <= {plain_bucket(n, 5) for n in range(1, 6)} and len(timed.buckets) >= 2, timed.buckets
    assert sum(t.steps for t in timed.buckets.values()) == timed.decode_steps == plain.decode_steps
    assert sum(t.live_kv_tokens for t in timed.buckets.values()) == timed.live_kv_tokens > 0
    assert sum(t.read_kv_tokens for t in timed.buckets.values()) == timed.read_kv_tokens
    for bucket, t in timed.buckets.items():
        assert t.ms > 0 and 0 < t.live_rows <= bucket * t.steps, (bucket, t)


def test_budget_below_one_sequence_names_the_key(model):
    from trinity.errors import UserError

    gpt, facts = model
    with pytest.raises(UserError, match=r"^actor_rollout_ref\.rollout\.kv_cache_memory_gib: the KV cache budget"):
        generate_continuous(gpt, PROMPTS, SamplingParams(max_new_tokens=4), vocab_size=facts.vocab_size, pad_id=0,
                            budget=KVBudget(kv_cache_memory_gib=1e-9))
    with pytest.raises(UserError, match=r"^actor_rollout_ref\.rollout\.gpu_memory_utilization: the KV cache budget"):
        generate_continuous(gpt, PROMPTS, SamplingParams(max_new_tokens=4), vocab_size=facts.vocab_size, pad_id=0,
                            budget=KVBudget(gpu_memory_utilization=1e-15))


def test_samples_share_one_prefill(model):
    """A prompt's n samples are prefilled once (the count) and give what separate prefills give (one
    slot: every row prefilled on its own)."""
    gpt, facts = model
    prompts = [p for p in PROMPTS for _ in range(4)]
    params, _ = _eos_params(gpt, facts, prompts)
    shared, alone = RolloutStats(), RolloutStats()
    a = generate_continuous(gpt, prompts, params, vocab_size=facts.vocab_size, pad_id=0, stats=shared)
    b = generate_continuous(gpt, prompts, params, vocab_size=facts.vocab_size, pad_id=0,
                            budget=KVBudget(max_num_seqs=1), stats=alone)
    assert shared.prefilled_prompts == len(PROMPTS) and shared.prefill_calls == 1
    assert alone.prefilled_prompts == len(prompts)
    _same(a, b)


def test_a_later_stages_decode_step_leaves_its_received_hidden_state_unchanged(model):
    """The lean layers add residuals in place. A non-first pipeline stage's input is the received hidden
    state, on CUDA a graph's static input buffer: the warm-up before a capture runs the step once, and the
    first replay reads that buffer again, so a step must not change it (PP=2 on 2 GPUs decoded wrong tokens
    when it did)."""
    gpt, _ = model
    hidden = torch.randn(1, 3, gpt.config.hidden_size, generator=torch.Generator().manual_seed(0))
    gpt.pre_process = False  # this chunk as a later stage: its decoders read a received hidden state
    try:
        slot = SlotDecoder(gpt, 4, 64)
        slot.pos[:3] = torch.tensor([2, 5, 7])
        slot.done[:3] = False
        first = slot.step(3, 64, hidden=hidden).clone()
        assert torch.equal(slot.hidden[:, :3], hidden)
        assert torch.equal(slot.step(3, 64, hidden=hidden), first)
        static = StaticDecoder(gpt, 3, 16)
        static.step(torch.tensor([4, 5, 6]), 2, hidden=hidden)
        assert torch.equal(static._hidden, hidden)
    finally:
        gpt.pre_process = True


def test_sampling_top_k_one_is_greedy_and_samples_differ(model):
    gpt, facts = model
    prompts = [p for p in PROMPTS for _ in range(4)]
    greedy = generate_continuous(gpt, prompts, SamplingParams(temperature=0.0, max_new_tokens=6),
                                 vocab_size=facts.vocab_size, pad_id=0)
    top1 = generate_continuous(gpt, prompts, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=6),
                               vocab_size=facts.vocab_size, pad_id=0, generator=torch.Generator().manual_seed(0))
    _same(top1, greedy)
    hot = generate_continuous(gpt, prompts, SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=6),
                              vocab_size=facts.vocab_size, pad_id=0, generator=torch.Generator().manual_seed(0))
    # a group's samples share the prompt's prefill but draw their own tokens
    assert len({tuple(r) for r in hot.responses[:4].tolist()}) > 1
    assert hot.logprobs[hot.response_mask.bool()].lt(0).all()


def _eos_schedule(name: str = "eos_schedule.py"):
    """benchmarks/eos_schedule.py: the benchmarks' EOS schedule (no part of the trinity package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / name
    spec = importlib.util.spec_from_file_location("bench_" + path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_response_lengths():
    schedule = _eos_schedule().schedule
    assert schedule(None) is None and schedule("fixed") is None
    x = torch.tensor(schedule("lognormal")(20000, 1000), dtype=torch.float32)
    assert 1 <= x.min() and x.max() <= 1000
    assert 250 < x.mean() < 310  # mean 30% of the maximum, a little less after clipping at it
    u = torch.tensor(schedule("uniform")(20000, 100), dtype=torch.float32)
    assert 48 < u.mean() < 53


def test_bench_schedule_reaches_the_rl_engine(model, monkeypatch):
    """The benchmarks' hook (benchmarks/eos_hook, in a `trinity run` of benchmarks/rl_step.py) patches the
    engine module: `ActorRollout` rows then end at the drawn lengths; unpatched, at max_new_tokens."""
    from trinity.rollout import continuous

    gpt, facts = model
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    engine = continuous.ActorRollout(gpt, facts.vocab_size, 0)
    assert engine.generate(PROMPTS, params).response_mask.sum(1).tolist() == [NEW] * len(PROMPTS)
    monkeypatch.setattr(continuous, "generate_continuous", continuous.generate_continuous)  # restored after
    _eos_schedule().patch(continuous, "fixed:3")
    assert engine.generate(PROMPTS, params).response_mask.sum(1).tolist() == [3] * len(PROMPTS)


def test_bench_hook_patches_the_engine_module_when_it_is_imported():
    """benchmarks/eos_hook/sitecustomize.py: the finder a job's processes install finds the engine module
    once (then leaves sys.meta_path) and patches it after it runs; here on a second copy of the module."""
    import importlib.util
    import sys

    import trinity.rollout

    finder = _eos_schedule("eos_hook/sitecustomize.py")._PatchOnImport("fixed:3")
    sys.meta_path.insert(0, finder)
    try:
        assert finder.find_spec("trinity.rollout.slots", trinity.rollout.__path__) is None
        spec = finder.find_spec("trinity.rollout.continuous", trinity.rollout.__path__)
        gone = finder not in sys.meta_path
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
    assert gone
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    assert copy.generate_continuous.__name__ == "scheduled" and copy is not sys.modules["trinity.rollout.continuous"]


def test_response_lengths_schedule_ends_rows(model):
    gpt, facts = model
    lengths = [3, 1, 7, 12]
    ro = generate_continuous(gpt, PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=NEW),
                             vocab_size=facts.vocab_size, pad_id=0, response_lengths=lengths)
    assert ro.response_mask.sum(1).tolist() == lengths and ro.response_len == 12


# ---- the config ---------------------------------------------------------------------------------------

def test_config_fields(write_job, small_job):
    from tests.unit.test_config import problems_of, with_keys
    from trinity.config.loader import load_config

    job = with_keys(small_job, algorithm__name="grpo", data__train_batch_size=8,
                    actor_rollout_ref__actor__ppo_mini_batch_size=8, actor_rollout_ref__rollout__n=2,
                    actor_rollout_ref__rollout__max_num_seqs=64, actor_rollout_ref__rollout__kv_cache_memory_gib=4.5)
    ro = load_config(write_job(job)).config.actor_rollout_ref.rollout
    assert (ro.max_num_seqs, ro.kv_cache_memory_gib, ro.gpu_memory_utilization) == (64, 4.5, None)
    assert KVBudget.from_config(ro) == KVBudget(64, None, 4.5)
    key = "actor_rollout_ref.rollout"
    for field, bad in (("max_num_seqs", 0), ("gpu_memory_utilization", 1.5), ("gpu_memory_utilization", 0),
                       ("kv_cache_memory_gib", -1)):
        probs = problems_of(write_job(job), [f"{key}.{field}={bad}"])
        assert any(p.startswith(f"{key}.{field}: ") for p in probs), probs
    # an explicit budget below one sequence (0.5B: 12 KiB of bf16 KV per token) is refused before anything runs
    probs = problems_of(write_job(job), [f"{key}.kv_cache_memory_gib=0.001"])
    assert any(p.startswith(f"{key}.kv_cache_memory_gib: the KV cache budget (0.001 GiB) holds no sequence") for p in probs), probs
    probs = problems_of(write_job(job), [f"{key}.gpu_memory_utilization=0.5"])
    assert any(p.startswith(f"{key}.kv_cache_memory_gib: set either kv_cache_memory_gib or gpu_memory_utilization")
               for p in probs), probs


# ---- TP=2 and PP=2 (2 processes, gloo) ------------------------------------------------------------------

def _build(facts, path, tp: int, pp: int):
    from trinity.convert.builtin import load_hf_weights
    from trinity.distributed.parallel import init_parallel
    from trinity.models.build import build_model

    m = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    init_parallel(device="cpu", layout=m.layout(), seed=3)
    (gpt,) = build_model(facts, m, device="cpu", dtype=torch.float32)
    load_hf_weights([gpt], path, facts)
    return gpt


def _parallel_worker(rank: int, port: int, model_dir: str, out: str, tp: int, pp: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from trinity.distributed.parallel import destroy

    facts = ModelFacts.from_hf_dir(model_dir)
    prompts = [p for p in PROMPTS for _ in range(3)]
    try:
        gpt = _build(facts, model_dir, tp, pp)
        params = SamplingParams(temperature=0.0, max_new_tokens=NEW, eos_token_ids=(11, 57, 90))
        kw = dict(vocab_size=facts.vocab_size, pad_id=0)
        # 4 slots: rows retire and waiting rows are admitted on every rank alike
        got = generate_continuous(gpt, prompts, params, budget=KVBudget(max_num_seqs=4), **kw)
        # sampling with a different seed per rank: the broadcast from TP rank 0 / the last stage decides
        hot = generate_continuous(gpt, prompts, SamplingParams(temperature=1.0, max_new_tokens=NEW, eos_token_ids=(11, 57, 90)),
                                  budget=KVBudget(max_num_seqs=4), generator=torch.Generator().manual_seed(rank), **kw)
        gathered = [None, None]
        torch.distributed.all_gather_object(gathered, (got.tokens.tolist(), hot.tokens.tolist(), hot.logprobs.tolist()))
        # the static engine at this layout too; both decoders take the lean path (at TP=2: this rank's
        # shards, an all-reduce after each row-parallel GEMM), not megatron's modules
        static = reference_generate(gpt, prompts, params, **kw)
        lean = SlotDecoder(gpt, 2, 64).lean and StaticDecoder(gpt, 2, 64).lean
        ref = _build(facts, model_dir, 1, 1)
        want = reference_generate(ref, prompts, params, **kw)
        res = {"ranks_agree": gathered[0] == gathered[1], "tokens_equal": torch.equal(got.tokens, want.tokens),
               "mask_equal": torch.equal(got.response_mask, want.response_mask),
               "logp_diff": (got.logprobs - want.logprobs).abs().max().item(),
               "static_equal": torch.equal(static.tokens, want.tokens),
               "static_logp_diff": (static.logprobs - want.logprobs).abs().max().item(), "lean": lean,
               "lengths": want.response_mask.sum(1).tolist()}
        Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    finally:
        destroy()


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_model_parallel_matches_tp1(tmp_path, tp, pp):
    from trinity.testing.tiny_models import make_tiny_hf_model

    model_dir = make_tiny_hf_model("qwen2", tmp_path / "qwen2", num_hidden_layers=4)
    run_two_ranks(_parallel_worker, str(model_dir), str(tmp_path), tp, pp)
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["ranks_agree"] and res["tokens_equal"] and res["mask_equal"], res
        assert res["logp_diff"] <= 1e-5 and res["static_equal"] and res["static_logp_diff"] <= 1e-5, res
        assert res["lean"], res


# ---- PP=2 x VPP=2 (2 processes, gloo): the chunks in ring order ------------------------------------------

def _vpp_worker(rank: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from trinity.convert.builtin import load_hf_weights
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.build import build_model

    facts = ModelFacts.from_hf_dir(model_dir)
    prompts = [p for p in PROMPTS for _ in range(3)]
    try:
        m = MegatronConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
        init_parallel(device="cpu", layout=m.layout(), seed=3)
        chunks = build_model(facts, m, device="cpu", dtype=torch.float32)
        load_hf_weights(chunks, model_dir, facts)
        # stage 0 holds layers 0 and 2, stage 1 layers 1 and 3: a token goes around the ring twice
        assert len(chunks) == 2 and [c.pre_process for c in chunks] == [rank == 0, False]
        assert [c.post_process for c in chunks] == [False, rank == 1]
        params = SamplingParams(temperature=0.0, max_new_tokens=NEW, eos_token_ids=(11, 57, 90))
        kw = dict(vocab_size=facts.vocab_size, pad_id=0)
        # 4 slots for 12 rows: the rows run in waves, each refilling every chunk's KV cache
        stats = RolloutStats()
        got = generate_continuous(chunks, prompts, params, budget=KVBudget(max_num_seqs=4), stats=stats, **kw)
        static = reference_generate(chunks, prompts, params, **kw)
        nocache = reference_generate(chunks, prompts, params, use_cache=False, **kw)  # megatron's own forward per chunk
        gathered = [None, None]
        torch.distributed.all_gather_object(gathered, got.tokens.tolist())
        ref = _build(facts, model_dir, 1, 1)
        want = reference_generate(ref, prompts, params, **kw)
        res = {"ranks_agree": gathered[0] == gathered[1], "tokens_equal": torch.equal(got.tokens, want.tokens),
               "mask_equal": torch.equal(got.response_mask, want.response_mask),
               "logp_diff": (got.logprobs - want.logprobs).abs().max().item(),
               "static_equal": torch.equal(static.tokens, want.tokens),
               "static_logp_diff": (static.logprobs - want.logprobs).abs().max().item(),
               "nocache_equal": torch.equal(nocache.tokens, want.tokens),
               "nocache_logp_diff": (nocache.logprobs - want.logprobs).abs().max().item(),
               "slots": stats.slots, "waves": stats.waves}
        Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    finally:
        destroy()


@pytest.mark.multiproc
@pytest.mark.slow
def test_virtual_pipeline_matches_pp1(tmp_path):
    from trinity.testing.tiny_models import make_tiny_hf_model

    model_dir = make_tiny_hf_model("qwen2", tmp_path / "qwen2", num_hidden_layers=4)
    run_two_ranks(_vpp_worker, str(model_dir), str(tmp_path))
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["ranks_agree"] and res["tokens_equal"] and res["mask_equal"] and res["static_equal"], res
        assert res["logp_diff"] <= 1e-5 and res["static_logp_diff"] <= 1e-5, res
        assert res["nocache_equal"] and res["nocache_logp_diff"] <= 1e-5, res
        assert res["slots"] == 4 and res["waves"] >= 3, res
