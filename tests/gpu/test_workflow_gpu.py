"""A multi-turn workflow job on 2 GPUs (DP=2, NCCL, bf16) through `trinity run`: GRPO on the guess-number game
with the tiny Qwen2 of tests/gpu/jobs.py. Every phase runs on both ranks, conversations of several turns are
trained, and the engine's log-probs of the assistant tokens match one training forward over the whole
conversation within bf16 noise.

Run on a 2-GPU machine: `python -m pytest tests/gpu/test_workflow_gpu.py -q -s`.
"""

from __future__ import annotations

import pytest

from tests.gpu.jobs import make_assets, note, rl_job, run_job

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.multiproc,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def test_guess_number_grpo_at_dp2(tmp_path):
    from trinity.workflows.guess_number import write_tasks

    assets = make_assets(tmp_path / "assets")
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(str(tasks), 64, seed=0, high=9)
    out = tmp_path / "wf_dp2"
    cfg = rl_job(assets, "grpo", out, 2, steps=3)
    del cfg["reward"]
    cfg["data"].update(train_files=[str(tasks)], max_prompt_length=256)
    cfg["actor_rollout_ref"]["rollout"].update(n=4, response_length=8)
    cfg["workflow"] = {"function": "guess_number", "max_turns": 3}
    rows = run_job(cfg, tmp_path / "wf_dp2.yaml")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for phase in ("rollout", "ref", "update_actor"):
            assert r[f"time/{phase}_s"] > 0, phase
        assert 1.0 < r["workflow/turns_mean"] <= 3.0, r
        assert r["workflow/end_error"] == 0.0 and 0.0 <= r["reward/mean"] <= 1.0
        assert r["rollout/logprob_diff_mean"] < 0.05, r
    note(f"  workflow dp2: turns {[round(r['workflow/turns_mean'], 2) for r in rows]}; reward "
         f"{[round(r['reward/mean'], 3) for r in rows]}; logprob gap {[round(r['rollout/logprob_diff_mean'], 4) for r in rows]}")


def test_a_short_turn_returns_while_a_long_one_decodes_on_cuda(qwen2_small_cuda):
    """The running batch on CUDA (one GPU, bf16, CUDA graphs): a 4-token turn sent 0.5 s after a 1024-token
    one joins the running batch and comes back while the long one still decodes; the long one then gets all
    its tokens, and close() leaves no engine thread."""
    import asyncio
    import threading

    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.models.build import build_model
    from trinity.rollout.types import SamplingParams
    from trinity.workflows.backends import RolloutBackend
    from trinity.workflows.batcher import RunningBatcher
    from trinity.workflows.types import TokenRequest

    facts, path = qwen2_small_cuda
    chunks = build_model(facts, MegatronConfig(), device="cuda", dtype=torch.bfloat16)
    load_hf_weights(chunks, path, facts)
    backend = RolloutBackend(chunks[0], vocab_size=facts.vocab_size, pad_id=0, context_tokens=1536,
                             generator=torch.Generator(device="cuda").manual_seed(0))
    never = (-1,)  # no stop id: each turn runs to its limit

    async def main():
        batcher = RunningBatcher(backend, episodes=2)
        try:
            long = asyncio.ensure_future(batcher.generate(
                TokenRequest(tuple(range(10, 74)), SamplingParams(temperature=1.0, max_new_tokens=1024,
                                                                  eos_token_ids=never), 0, 0)))
            await asyncio.sleep(0.5)
            short = await batcher.generate(
                TokenRequest(tuple(range(100, 120)), SamplingParams(temperature=1.0, max_new_tokens=4,
                                                                    eos_token_ids=never), 1, 0))
            long_pending = not long.done()
            return short, long_pending, await long, batcher
        finally:
            batcher.close()

    short, long_pending, long, batcher = asyncio.run(main())
    assert len(short.token_ids) == 4 and len(long.token_ids) == 1024
    assert long_pending
    assert batcher.stats.joined == 1 and batcher.stats.engines == 1
    assert not [t for t in threading.enumerate() if t.name == "trinity-engine"]


def test_later_turns_reuse_their_parked_kv_slot_on_cuda(qwen2_small_cuda):
    """Multi-turn conversations on CUDA (bf16, CUDA graphs, the split-KV decode kernel reading the
    prompts' shared keys): each later turn takes its conversation's parked slot and prefills only the new
    tokens. Its tokens and log-probs match those of prefilling every turn whole within bf16 noise, and the
    prompt tokens computed fall by the tokens reused."""
    import asyncio

    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.models.build import build_model
    from trinity.rollout.types import SamplingParams
    from trinity.workflows.backends import RolloutBackend
    from trinity.workflows.batcher import RunningBatcher
    from trinity.workflows.types import TokenRequest

    facts, path = qwen2_small_cuda
    chunks = build_model(facts, MegatronConfig(), device="cuda", dtype=torch.bfloat16)
    load_hf_weights(chunks, path, facts)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=48, eos_token_ids=(-1,))

    def run(reuse: bool):
        backend = RolloutBackend(chunks[0], vocab_size=facts.vocab_size, pad_id=0, context_tokens=512, seed=7,
                                 reuse=reuse)

        async def episode(batcher, e):
            prompt, turns = tuple(range(10, 60)), []  # 8 conversations share their first prompt
            for t in range(3):
                res = await batcher.generate(TokenRequest(prompt, sampling, e, t))
                turns.append(res)
                prompt = prompt + res.token_ids + tuple(range(200 + 10 * t, 207 + 10 * t))  # "the user's reply"
            return turns

        async def main():
            batcher = RunningBatcher(backend, episodes=8)
            try:
                return await asyncio.gather(*(episode(batcher, e) for e in range(8)))
            finally:
                batcher.close()

        return asyncio.run(main()), backend.stats

    (on, on_stats), (off, off_stats) = run(True), run(False)
    same = diffs = 0
    gaps = []
    for a, b in zip(on, off):
        for ta, tb in zip(a, b):
            for x, y, lx, ly in zip(ta.token_ids, tb.token_ids, ta.logprobs, tb.logprobs):
                if x != y:  # a bf16 near-tie drew another token: the rest of the conversation differs
                    diffs += 1
                    break
                same += 1
                gaps.append(abs(lx - ly))
            if diffs:
                break
    assert same >= 0.5 * 8 * 3 * 48, (same, diffs)
    assert max(gaps) < 0.1 and sum(gaps) / len(gaps) < 0.01, (max(gaps), sum(gaps) / len(gaps))
    # turn 2 reuses the first prompt and 47 of its answer's 48 tokens, turn 3 that and turn 2's 7 + 47
    assert off_stats.reused_tokens == 0 and on_stats.reused_tokens == 8 * ((50 + 47) + (50 + 48 + 7 + 47))
    extra = off_stats.prefilled_tokens - on_stats.prefilled_tokens - on_stats.reused_tokens
    assert extra % 50 == 0 and abs(extra) <= 7 * 50, extra  # the first prompt's prefills: the batch's timing
