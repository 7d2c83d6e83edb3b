"""The continuous-batching engine on CUDA: CUDA-graph replay per (batch, length) bucket against eager
steps and against the static batch (fp32 exact tokens; bf16 on the tokens' common prefix).

Run on a GPU machine: `python -m pytest tests/gpu/test_rollout_continuous_gpu.py -q`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts
    from trinity.testing.tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("q"), hidden_size=256, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=512)
    facts = ModelFacts.from_hf_dir(path)
    init_parallel(device="cuda", layout=ParallelLayout(), seed=1)
    models = {}
    for dtype in (torch.float32, torch.bfloat16):
        (gpt,) = build_model(facts, MegatronConfig(), device="cuda", dtype=dtype)
        load_hf_weights([gpt], path, facts)
        models[dtype] = gpt
    yield models, facts
    destroy()


def _prompts(facts, rows: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, facts.vocab_size, (int(n),), generator=g).tolist()
            for n in torch.randint(3, 40, (rows,), generator=g)]


def test_graphs_match_eager_and_static_fp32(built):
    from trinity.rollout.continuous import KVBudget, RolloutStats, generate_continuous
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams

    models, facts = built
    gpt = models[torch.float32]
    prompts = [p for p in _prompts(facts, 12) for _ in range(2)]
    kw = dict(vocab_size=facts.vocab_size, pad_id=0)
    free = reference_generate(gpt, prompts, SamplingParams(temperature=0.0, max_new_tokens=40), **kw)
    eos = tuple(sorted({int(free.responses[r, 3 + (r * 7) % 30]) for r in range(0, len(prompts), 2)}))
    params = SamplingParams(temperature=0.0, max_new_tokens=40, eos_token_ids=eos)
    want = reference_generate(gpt, prompts, params, **kw)
    graphed_stats, eager_stats = RolloutStats(), RolloutStats()
    # 7 slots: waves, retirements, compaction and several batch buckets
    graphed = generate_continuous(gpt, prompts, params, budget=KVBudget(max_num_seqs=7), stats=graphed_stats, **kw)
    eager = generate_continuous(gpt, prompts, params, budget=KVBudget(max_num_seqs=7), cuda_graphs=False,
                                stats=eager_stats, **kw)
    assert torch.equal(graphed.tokens, eager.tokens) and torch.equal(graphed.tokens, want.tokens)
    assert torch.equal(graphed.response_mask, want.response_mask)
    assert (graphed.logprobs - eager.logprobs).abs().max().item() == 0.0
    assert (graphed.logprobs - want.logprobs).abs().max().item() <= 1e-4
    # each (batch bucket, length bucket) captured once, then replayed
    assert 0 < graphed_stats.graph_captures < graphed_stats.decode_steps / 2, graphed_stats
    assert eager_stats.graph_captures == 0
    assert graphed_stats.attention.startswith("triton split-KV"), graphed_stats  # per-row context reads
    # a prompt's two samples read one copy of its keys, through waves, retirements and compaction
    assert graphed_stats.attention.endswith(", shared prompt keys"), graphed_stats.attention
    assert graphed_stats.read_kv_tokens < graphed_stats.live_kv_tokens, graphed_stats
    # the SDPA decode attention (masked reads up to the longest live row) gives the same tokens
    from trinity.rollout.kernels import DecodeKernels

    sdpa_stats = RolloutStats()
    sdpa = generate_continuous(gpt, prompts, params, budget=KVBudget(max_num_seqs=7), stats=sdpa_stats,
                               kernels=DecodeKernels(split_kv=False), **kw)
    assert sdpa_stats.attention.startswith("sdpa"), sdpa_stats.attention  # "sdpa + fused RoPE/SwiGLU"
    assert torch.equal(sdpa.tokens, want.tokens) and (sdpa.logprobs - want.logprobs).abs().max().item() <= 1e-4


def test_step_timing_per_bucket_accounts_for_every_step(built):
    """RolloutStats.time_buckets (benchmarks/generate.py --buckets): events around each decode step change
    no token, and the buckets' steps, rows and KV add up to the call's."""
    from trinity.rollout.buckets import plain_bucket
    from trinity.rollout.continuous import KVBudget, RolloutStats, generate_continuous
    from trinity.rollout.types import SamplingParams

    models, facts = built
    gpt = models[torch.float32]
    prompts = [p for p in _prompts(facts, 12) for _ in range(2)]
    kw = dict(vocab_size=facts.vocab_size, pad_id=0, budget=KVBudget(max_num_seqs=7),
              response_lengths=[1 + (7 * r) % 33 for r in range(len(prompts))])
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    plain, timed = RolloutStats(), RolloutStats(time_buckets=True)
    a = generate_continuous(gpt, prompts, params, stats=plain, **kw)
    b = generate_continuous(gpt, prompts, params, stats=timed, **kw)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert not plain.buckets
    assert set(timed.buckets) <= {plain_bucket(n, 7) for n in range(1, 8)} and len(timed.buckets) >= 3, timed.buckets
    assert sum(t.steps for t in timed.buckets.values()) == timed.decode_steps == plain.decode_steps
    assert sum(t.live_kv_tokens for t in timed.buckets.values()) == timed.live_kv_tokens
    assert sum(t.read_kv_tokens for t in timed.buckets.values()) == timed.read_kv_tokens
    for bucket, t in timed.buckets.items():
        assert t.ms > 0 and t.live_rows <= bucket * t.steps, (bucket, t)


def test_decode_buckets_are_timed_once_and_cover_every_row_count(built, monkeypatch):
    """trinity.rollout.buckets on CUDA: the tuned ladder is a subset of the plain one that ends at the slot
    count, names what it left out, is measured once per process; tuned=False (DecodeKernels.tuned_buckets)
    keeps the plain ladder."""
    from trinity.rollout.buckets import Buckets, decode_buckets, gemm_ms, step_gemms

    models, _ = built
    cuda = torch.device("cuda")
    plain = Buckets.plain(512)
    for gpt in models.values():
        tuned = decode_buckets([gpt], 512, cuda)
        assert set(tuned.sizes) <= set(plain.sizes) and tuned.sizes[-1] == 512, tuned
        assert {b for b, _, _ in tuned.dropped} == set(plain.sizes) - set(tuned.sizes)
        assert all(n <= tuned(n) for n in range(1, 513))
        assert decode_buckets([gpt], 512, cuda) is tuned
    gemms = step_gemms([models[torch.bfloat16]], cuda)
    assert len(gemms) == 4 * len(models[torch.bfloat16].decoder.layers) + 1
    assert 0 < gemm_ms(gemms, 64) and 0 < gemm_ms(gemms, 512)
    assert decode_buckets([models[torch.float32]], 512, cuda, tuned=False) == plain


def test_a_later_rollout_captures_warmed_shapes_without_a_warm_up(built, monkeypatch):
    """Every RL step's rollout captures its own graphs. A decode shape this process has run once is
    captured without the warm-up run (one `_step` per capture, not two), and decodes what the first
    rollout decoded: sampled tokens and log-probs bit for bit (fp32, same seed)."""
    from trinity.rollout import slots
    from trinity.rollout.continuous import KVBudget, RolloutStats, generate_continuous
    from trinity.rollout.types import SamplingParams

    models, facts = built
    gpt = models[torch.float32]
    prompts = [p for p in _prompts(facts, 6) for _ in range(3)]
    params = SamplingParams(temperature=1.0, max_new_tokens=24, eos_token_ids=tuple(range(1, 60)))

    def rollout(stats):
        return generate_continuous(gpt, prompts, params, vocab_size=facts.vocab_size, pad_id=0, budget=KVBudget(max_num_seqs=7),
                                   generator=torch.Generator(device="cuda").manual_seed(3), stats=stats)

    first_stats, second_stats = RolloutStats(), RolloutStats()
    first = rollout(first_stats)
    assert first_stats.graph_tail and first_stats.graph_captures > 1, first_stats
    calls = []
    real_step = slots.SlotDecoder._step
    monkeypatch.setattr(slots.SlotDecoder, "_step", lambda self, b, L: calls.append(b) or real_step(self, b, L))
    second = rollout(second_stats)
    assert len(calls) == second_stats.graph_captures == first_stats.graph_captures, (calls, second_stats)
    assert torch.equal(second.tokens, first.tokens) and torch.equal(second.response_mask, first.response_mask)
    assert torch.equal(second.logprobs, first.logprobs)
    assert 0 < second.response_mask.sum(1).min() < 24  # rows ended at sampled EOS ids, in several buckets


def test_bf16_prefix_matches_static(built):
    from trinity.rollout.continuous import KVBudget, generate_continuous
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams

    models, facts = built
    gpt = models[torch.bfloat16]
    prompts = _prompts(facts, 16)
    params = SamplingParams(temperature=0.0, max_new_tokens=32)
    kw = dict(vocab_size=facts.vocab_size, pad_id=0)
    want = reference_generate(gpt, prompts, params, **kw)
    got = generate_continuous(gpt, prompts, params, budget=KVBudget(max_num_seqs=5), **kw)
    # bf16 rounds differently in a batch of other rows and positions: greedy paths may part after a
    # near-tie; up to there tokens and log-probs agree
    same = (got.responses == want.responses).long().cumprod(1)
    # a random tiny model has near-ties (seen on an H100: 1 row of 16 parted at its first token)
    assert same[:, :4].all(1).sum() >= 12, same.sum(1)
    common = same.bool()
    assert (got.logprobs[common] - want.logprobs[common]).abs().max().item() <= 5e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_kernel_modes_match_sdpa(dtype):
    """The decode attention kernel, one split per row (many rows) and several splits (a rollout's tail),
    against SDPA over each row's own keys."""
    import torch.nn.functional as F

    from trinity.rollout.decode_attention import decode_attention

    g = torch.Generator().manual_seed(0)
    b, groups, per, d, cache = 300, 2, 7, 128, 1280
    q = torch.randn(b, groups, per, d, generator=g).to("cuda", dtype)
    k = torch.randn(b, groups, cache, d, generator=g).to("cuda", dtype)
    v = torch.randn(b, groups, cache, d, generator=g).to("cuda", dtype)
    lengths = torch.randint(1, cache + 1, (b,), generator=g).cuda()
    ref = torch.cat([F.scaled_dot_product_attention(q[i:i + 1].float(), k[i:i + 1, :, :n].float(), v[i:i + 1, :, :n].float(),
                                                    scale=d**-0.5) for i, n in enumerate(lengths.tolist())])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for splits in (None, 1, 5):
        out = decode_attention(q, k, v, lengths, cache, d**-0.5, splits=splits).float()
        assert ((out - ref).norm() / ref.norm()).item() <= tol, splits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per", [7, 6, 1])
def test_fused_kernels_equal_the_torch_ops(dtype, per):
    """RoPE + cache store bit-identical to the eager ops (each product and sum rounded as they round),
    SwiGLU within rounding; and the engine uses them on CUDA."""
    from trinity.rollout import decode_fused, rope_triton

    decode_fused._CHECKED.clear()
    assert decode_fused.available(torch.device("cuda"), 128, per, 128, dtype)
    # the RoPE part is exact (same roundings as the eager ops, no fused multiply-add): measured 0 difference
    # on an H100 in fp32 and bf16
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(9, 4, per + 2, 128, generator=g).to("cuda", dtype)
    cos, sin = (t.to("cuda", dtype) for t in rope_triton.random_rope_table(64, 128, g))
    pos = torch.randint(0, 64, (9,), generator=g).cuda()
    caches = [torch.zeros(9, 4, 64, 128, dtype=dtype, device="cuda") for _ in range(4)]
    a = decode_fused.rope_store(qkv, cos, sin, pos, caches[0], caches[1])
    b = rope_triton.reference_rope_store(qkv, cos, sin, pos, caches[2], caches[3])
    assert torch.equal(a, b) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]), (
        f"rope_store {dtype} per={per}: q max |diff| {(a.float() - b.float()).abs().max().item():.3e}, "
        f"k cache max |diff| {(caches[0].float() - caches[2].float()).abs().max().item():.3e}")


def test_engine_uses_fused_kernels(built):
    from trinity.rollout.continuous import RolloutStats, generate_continuous
    from trinity.rollout.types import SamplingParams

    models, facts = built
    stats = RolloutStats()
    prompts = [p for p in _prompts(facts, 4) for _ in range(2)]
    generate_continuous(models[torch.bfloat16], prompts, SamplingParams(temperature=0.0, max_new_tokens=4),
                        vocab_size=facts.vocab_size, pad_id=0, stats=stats)
    # the split-KV kernel (with RoPE and the cache store in it, the prompt's keys read from one of its
    # samples' slots) and the fused SwiGLU: a failed first-use check falls back to SDPA with a warning
    # only, which this catches
    assert stats.attention == "triton split-KV + fused RoPE/SwiGLU, shared prompt keys", stats.attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prompt_keys_read_one_copy(dtype):
    """decode_attention(prefix=(src, plen)): 40 rows, 5 prompts of 8 samples, prompts of 300 keys (past the
    first split's 256), each sample's own copy of its prompt's keys garbage: the output equals the kernel's
    over caches where every sample holds the prompt's keys, with RoPE and the cache store in the kernel,
    for one split per row, several, and the engine's choice; without prefix= the garbage shows."""
    from trinity.rollout.decode_attention import decode_attention
    from trinity.rollout.rope_triton import random_rope_table

    g = torch.Generator().manual_seed(2)
    b, groups, per, d, cache, plen_ = 40, 2, 7, 128, 1280, 300
    qkv = torch.randn(b, groups, per + 2, d, generator=g).to("cuda", dtype)
    cos, sin = (t.to("cuda", dtype) for t in random_rope_table(cache, d, g))
    pos = plen_ + torch.randint(0, cache - plen_, (b,), generator=g)
    pos[:3] = torch.tensor([plen_, plen_ + 1, cache - 1])
    pos = pos.cuda()
    src = (torch.arange(b) // 8 * 8 + 3).cuda()  # a prompt's fourth sample holds the copy read
    plen = torch.full((b,), plen_, device="cuda")
    for splits in (None, 1, 5):
        kv = [torch.randn(b, groups, cache, d, generator=g).to("cuda", dtype) for _ in range(2)]
        fixed = [c.clone() for c in kv]
        for f in fixed:
            f[:, :, :plen_] = f.index_select(0, src)[:, :, :plen_]
        garbage = [c.clone() for c in kv]
        got = decode_attention(qkv, *kv, pos + 1, cache, d**-0.5, splits=splits, rope=(cos, sin, pos), prefix=(src, plen))
        want = decode_attention(qkv, *fixed, pos + 1, cache, d**-0.5, splits=splits, rope=(cos, sin, pos))
        unshared = decode_attention(qkv, *garbage, pos + 1, cache, d**-0.5, splits=splits, rope=(cos, sin, pos))
        rows = torch.arange(b, device="cuda")
        for c, f in zip(kv, fixed):  # this step's key and value, stored at pos in the row's own slot
            assert torch.equal(c[rows, :, pos], f[rows, :, pos]), splits
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err <= (1e-6 if dtype == torch.float32 else 1e-2), (splits, err, torch.equal(got, want))
        assert ((unshared.float() - want.float()).norm() / want.float().norm()).item() > 0.05, splits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per", [7, 1])
def test_rope_in_the_attention_kernel_equals_the_separate_kernels(dtype, per):
    """decode_attention(rope=...) against rope_store then decode_attention: the same cache bit for bit and
    the same output up to the attention's fused multiply-adds (on in the separate kernel only), with one
    split per row, several, and the engine's choice, rows at every position of a split."""
    from trinity.rollout.decode_attention import decode_attention
    from trinity.rollout.decode_fused import rope_store
    from trinity.rollout.rope_triton import random_rope_table

    g = torch.Generator().manual_seed(per)
    b, groups, d, cache = 40, 2, 128, 1280
    qkv = torch.randn(b, groups, per + 2, d, generator=g).to("cuda", dtype)
    cos, sin = (t.to("cuda", dtype) for t in random_rope_table(cache, d, g))
    pos = torch.randint(0, cache, (b,), generator=g)
    pos[:4] = torch.tensor([0, 255, 256, cache - 1])  # a split's first and last key, the cache's last
    pos = pos.cuda()
    for splits in (None, 1, 5):
        caches = [torch.randn(b + 1, groups, cache, d, generator=g).to("cuda", dtype) for _ in range(2)]
        mine = [c.clone() for c in caches]
        want = decode_attention(rope_store(qkv, cos, sin, pos, *caches), *caches, pos + 1, cache, d**-0.5, splits=splits)
        got = decode_attention(qkv, *mine, pos + 1, cache, d**-0.5, splits=splits, rope=(cos, sin, pos))
        assert torch.equal(mine[0], caches[0]) and torch.equal(mine[1], caches[1]), splits
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err <= (1e-6 if dtype == torch.float32 else 1e-2), (splits, err)


def test_fused_sampler_against_torch_at_a_real_vocabulary():
    """The fused sampler on a 152k vocabulary (bf16 logits, vocabulary padding ignored): greedy tokens equal
    argmax's, log-probs equal log_softmax's, and sampled tokens follow softmax: the mean log p of 4096 draws
    of one row is minus its entropy; one row split over many programs and 512 rows of one program each."""
    from trinity.rollout import sampler as S

    S._CHECKED.clear()
    assert S.available(torch.device("cuda"), S.SamplingParams(temperature=1.0))
    vocab = 151936
    g = torch.Generator().manual_seed(3)
    for rows in (1, 7, 512):
        logits = (torch.randn(rows, vocab + 128, generator=g) * 3).to("cuda", torch.bfloat16)
        logits[:, vocab:] = 100.0  # padding columns: never picked, not in the softmax
        ref = torch.log_softmax(logits[:, :vocab].float(), -1)
        keys = torch.arange(rows, device="cuda")
        seed = torch.tensor([11], device="cuda")
        tok, logp = S.fused_sample(logits, vocab, 0.0, seed, keys)
        assert torch.equal(tok, ref.argmax(-1)), rows
        assert (logp - ref.gather(-1, tok[:, None])[:, 0]).abs().max().item() <= 1e-4, rows
        hot, hlogp = S.fused_sample(logits, vocab, 1.0, seed, keys)
        assert int(hot.max()) < vocab
        assert (hlogp - ref.gather(-1, hot[:, None])[:, 0]).abs().max().item() <= 1e-4, rows
    row = (torch.randn(1, vocab, generator=g) * 2).to("cuda", torch.bfloat16)
    n = 4096
    tok, logp = S.fused_sample(row.expand(n, vocab), vocab, 1.0, torch.tensor([5], device="cuda"),
                               torch.arange(n, device="cuda"))
    ref = torch.log_softmax(row.float(), -1)[0]
    entropy = float(-(ref.exp() * ref).sum())
    spread = float((ref.exp() * (ref + entropy) ** 2).sum()) ** 0.5 / n**0.5
    assert abs(float(logp.mean()) + entropy) < 5 * spread, (float(logp.mean()), entropy, spread)
    assert tok.unique().numel() > n // 4  # a high-entropy row: draws differ


def test_sampling_same_draws_in_any_slot_wave_or_engine(built):
    """At temperature 1 the fused sampler names a row's draws by (row, token index): the decode step's
    CUDA graph (with the sampling and bookkeeping in it) or eager steps, 24 slots or 5 (waves), and the
    static batch give the same tokens from the same generator seed (fp32)."""
    from trinity.rollout.continuous import KVBudget, RolloutStats, generate_continuous
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams

    models, facts = built
    gpt = models[torch.float32]
    prompts = [p for p in _prompts(facts, 8) for _ in range(3)]
    params = SamplingParams(temperature=1.0, max_new_tokens=24, eos_token_ids=(7, 19, 101))
    kw = dict(vocab_size=facts.vocab_size, pad_id=0)
    gen = lambda: torch.Generator(device="cuda").manual_seed(5)  # noqa: E731
    runs, stats = {}, {}
    for name, slots, graphs in (("graph24", 24, True), ("graph5", 5, True), ("eager5", 5, False)):
        stats[name] = RolloutStats()
        runs[name] = generate_continuous(gpt, prompts, params, budget=KVBudget(max_num_seqs=slots), cuda_graphs=graphs,
                                         generator=gen(), stats=stats[name], **kw)
    runs["static"] = reference_generate(gpt, prompts, params, generator=gen(), **kw)
    assert stats["graph24"].sampler == "fused" and stats["graph24"].graph_tail and not stats["eager5"].graph_tail
    assert stats["graph5"].waves > 1
    for name, ro in runs.items():
        assert torch.equal(ro.tokens, runs["graph24"].tokens), name
        assert torch.equal(ro.response_mask, runs["graph24"].response_mask), name
        assert (ro.logprobs - runs["graph24"].logprobs).abs().max().item() <= 1e-4, name
    responses = runs["graph24"].responses
    assert not torch.equal(responses[0], responses[1]), "a prompt's samples should differ at temperature 1"
