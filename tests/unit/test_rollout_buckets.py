"""The decode steps' batch buckets (trinity.rollout.buckets): the plain ladder, which buckets the timing
leaves out, that the engine runs the buckets it is given, and the GEMM list the timing replays (CPU; the
timing itself: tests/gpu/test_rollout_continuous_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from trinity.rollout.buckets import Buckets, choose, decode_buckets, plain_bucket, step_gemms


def test_plain_ladder():
    assert Buckets.plain(512).sizes == (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512)
    assert Buckets.plain(100).sizes == (1, 2, 4, 8, 16, 32, 64, 100)  # the slot count closes the ladder
    assert Buckets.plain(5).sizes == (1, 2, 4, 5)
    ladder = Buckets.plain(300)
    for n in range(1, 301):
        assert ladder(n) == plain_bucket(n, 300) >= n


def test_a_bucket_slower_than_a_larger_one_is_left_out():
    cands = [128, 192, 256, 320, 384, 448, 512]
    # a 7B decode step's GEMMs on an H100, us: 28 x (QKV + output + gate/up + down) + the LM head, from
    # `benchmarks/decode_gemv_probe.py --sweep-blas --shape 7b --rows 128 192 256 320 384 448 512` (a probe
    # removed from benchmarks/, in git at f15ad23; docs/performance.md, "Per batch bucket").
    # 448 rows took 1.36x the time of 512; 192 rows 1.01x that of 256
    times = [5932.0, 6750.0, 6653.0, 7710.0, 8311.0, 14833.0, 10932.0]
    keep, dropped = choose(cands, times)
    assert keep == [128, 192, 256, 320, 384, 512]
    assert [(b, to) for b, to, _ in dropped] == [(448, 512)] and dropped[0][2] == pytest.approx(10932 / 14833)
    # within the margin nothing moves (timing noise must not change the ladder)
    keep, dropped = choose(cands, [100.0] * 7 + [86.0])
    assert keep == cands and not dropped
    # two slow buckets in a row both go to the next kept one; the largest is always kept
    keep, dropped = choose([64, 128, 192, 256], [50.0, 90.0, 95.0, 60.0])
    assert keep == [64, 256] and [(b, to) for b, to, _ in dropped] == [(128, 256), (192, 256)]
    assert choose([64, 128], [10.0, 100.0])[0] == [64, 128]
    tuned = Buckets((1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384, 512), ((448, 512, 0.74),))
    assert tuned(400) == 512 and tuned(385) == 512 and tuned(384) == 384 and tuned(1) == 1
    assert tuned.note == "448 rows run as 512 (0.74x the GEMM time)" and Buckets.plain(8).note == ""


def test_cpu_keeps_the_plain_ladder_and_lists_the_step_gemms(tiny_qwen2_cpu):
    gpt, facts, _ = tiny_qwen2_cpu
    assert decode_buckets([gpt], 512, torch.device("cpu")) == Buckets.plain(512)
    gemms = step_gemms([gpt], torch.device("cpu"))
    layers = gpt.decoder.layers
    assert len(gemms) == 4 * len(layers) + 1
    first = layers[0]
    assert [k for k, _, _ in gemms[:4]] == ["linear", "addmm", "linear", "addmm"]
    assert gemms[0][1] is first.self_attention.linear_qkv.weight and gemms[0][2] is first.self_attention.linear_qkv.bias
    assert gemms[3][1] is first.mlp.linear_fc2.weight
    assert gemms[-1][1].shape[0] >= facts.vocab_size  # the LM head (vocabulary padded)
    assert step_gemms([gpt], torch.device("meta")) is None  # weights elsewhere: no timing


def test_the_engine_runs_the_buckets_it_is_given(tiny_qwen2_cpu, monkeypatch):
    """A ladder without bucket 2 (as the timing would leave it out): no step runs at 2 rows, and the
    output is the plain ladder's."""
    import trinity.rollout.continuous as engine
    from trinity.rollout.types import SamplingParams

    gpt, facts, _ = tiny_qwen2_cpu
    prompts = [[5, 9, 17, 3], [7, 1], [100, 12, 8, 60], [33, 34]]
    kw = dict(vocab_size=facts.vocab_size, pad_id=0, budget=engine.KVBudget(max_num_seqs=5),
              response_lengths=[1, 9, 4, 12])
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    plain = engine.RolloutStats(time_buckets=True)
    want = engine.generate_continuous(gpt, prompts, params, stats=plain, **kw)
    assert 2 in plain.buckets  # the plain ladder does run a 2-row bucket here
    monkeypatch.setattr(engine, "decode_buckets", lambda gpts, cap, device, tuned=True: Buckets((1, 4), ((2, 4, 0.5),)))
    tuned = engine.RolloutStats(time_buckets=True)
    got = engine.generate_continuous(gpt, prompts, params, stats=tuned, **kw)
    assert set(tuned.buckets) == {1, 4} and tuned.bucket_note == "2 rows run as 4 (0.50x the GEMM time)"
    assert torch.equal(got.tokens, want.tokens) and (got.logprobs - want.logprobs).abs().max().item() <= 1e-5


def _agree_worker(rank: int, port: int, out: str) -> None:
    import json
    import os
    from pathlib import Path

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from trinity.config.megatron import MegatronConfig
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.rollout.buckets import Buckets, agree

    try:
        init_parallel(device="cpu", layout=MegatronConfig(tensor_model_parallel_size=2).layout(), seed=0)
        plain = Buckets.plain(512)
        # halves of times like the 7B ones of test_a_bucket_slower_than_a_larger_one_is_left_out (buckets
        # 64..512), where only rank 1 times its 448-row bucket slow: the sum decides, on both ranks
        base = [5600.0, 5932.0, 6750.0, 6653.0, 7710.0, 8311.0, 9000.0, 10932.0]
        mine = [t / 2 for t in base]
        if rank == 1:
            mine[6] = 14833.0 - base[6] / 2
        both = agree(mine, plain)
        # a rank that cannot time (None) sends zeros: both keep the plain ladder, and nobody waits
        one = agree(None if rank == 1 else mine, plain)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"both": list(both.sizes), "dropped": [list(d[:2]) for d in both.dropped],
                                                             "one": list(one.sizes)}))
    finally:
        destroy()


@pytest.mark.multiproc
def test_model_parallel_ranks_agree_on_one_ladder(tmp_path):
    import json

    from tests.conftest import run_two_ranks

    run_two_ranks(_agree_worker, str(tmp_path), timeout=120)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert res[0] == res[1], res
    assert 448 not in res[0]["both"] and res[0]["dropped"] == [[448, 512]], res
    assert res[0]["one"] == list(Buckets.plain(512).sizes), res
