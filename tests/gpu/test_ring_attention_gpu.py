"""Ring attention (trinity.models.ring_attention) on two GPUs over NCCL at CP=2, bf16: each rank's output and
q/k/v gradients match its share of one GPU's full attention within bf16 tolerance, unpacked (torch's flash
kernel per block) and packed (the document mask, explicit fp32 scores per block), GQA; fp32 on CUDA within
1e-4. Skipped with fewer than 2 GPUs.

Run on a 2-GPU machine: `python -m pytest tests/gpu/test_ring_attention_gpu.py -q -s -n 0`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_two_ranks

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiproc,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

B, S, HEADS, GROUPS, D = 2, 2048, 8, 2, 64
CASES = {"unpacked_bf16": (torch.bfloat16, False), "packed_bf16": (torch.bfloat16, True),
         "unpacked_fp32": (torch.float32, False), "packed_fp32": (torch.float32, True)}


def _doc_ids(device) -> "torch.Tensor":
    # documents of random lengths that cross the chunk borders (chunks of S / 4); the row ends in padding (-1)
    g = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(B):
        cuts = torch.randint(1, S - 64, (6,), generator=g).sort().values.tolist()
        ids = torch.zeros(S, dtype=torch.long)
        for i, c in enumerate(cuts):
            ids[c:] = i + 1
        ids[S - 64:] = -1
        rows.append(ids)
    return torch.stack(rows).to(device)


def _full(q, k, v, doc_ids, scale):
    from trinity.models.attention import packed_causal_mask

    kwargs = {"attn_mask": ~packed_causal_mask(doc_ids)} if doc_ids is not None else {"is_causal": True}
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, enable_gqa=True, **kwargs)
    return out.transpose(1, 2)


def _worker(rank: int, port: int, out: str) -> None:
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from megatron.core import parallel_state as ps

    from trinity.distributed.context_parallel import split_for_rank
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.ring_attention import flash_supported, ring_attention

    init_parallel(device="cuda", layout=ParallelLayout(cp=2), seed=1)
    try:
        group, cp_rank, dev = ps.get_context_parallel_group(), ps.get_context_parallel_rank(), torch.device("cuda")
        res: dict = {}
        for name, (dtype, packed) in CASES.items():
            torch.manual_seed(3)
            full = [torch.randn(B, S, h, D, device=dev).to(dtype) for h in (HEADS, GROUPS, GROUPS)]
            dout = torch.randn(B, S, HEADS, D, device=dev).to(dtype)
            doc_ids = _doc_ids(dev) if packed else None
            scale = D ** -0.5
            # the reference: fp32 attention of the same (rounded) inputs; and the one-GPU kernel in `dtype`
            grads = {}
            for ref, cast in (("fp32", torch.float32), ("one_gpu", dtype)):
                leaves = [t.detach().to(cast).requires_grad_() for t in full]
                o = _full(*leaves, doc_ids, scale)
                o.backward(dout.to(cast))
                grads[ref] = [o.detach().float()] + [t.grad.float() for t in leaves]
            local = [split_for_rank(t, 2, cp_rank).detach().requires_grad_() for t in full]
            o = ring_attention(*local, group, scale=scale, doc_ids=doc_ids)
            o.backward(split_for_rank(dout, 2, cp_rank))
            mine = [o.detach().float()] + [t.grad.float() for t in local]
            res[name] = {"flash": flash_supported(local[0], local[2]) and not packed}
            for i, what in enumerate(("out", "dq", "dk", "dv")):
                want = split_for_rank(grads["fp32"][i], 2, cp_rank)
                res[name][what] = {"ring": float((mine[i] - want).abs().max()),
                                   "one_gpu": float((split_for_rank(grads["one_gpu"][i], 2, cp_rank) - want).abs().max()),
                                   "scale": float(want.abs().max())}
        Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    finally:
        destroy()


def test_ring_attention_cp2_matches_one_gpu(tmp_path):
    run_two_ranks(_worker, str(tmp_path))
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        print(rank, json.dumps(res))
        assert res["unpacked_bf16"]["flash"] and not res["packed_bf16"]["flash"]
        for name, (dtype, _) in CASES.items():
            for what in ("out", "dq", "dk", "dv"):
                e = res[name][what]
                assert e["scale"] > 1e-3, (name, what, e)  # gradients that are there to compare
                if dtype == torch.float32:
                    assert e["ring"] < 1e-4, (rank, name, what, e)
                else:  # bf16: no further from the fp32 result than the one-GPU bf16 kernel, give or take rounding
                    assert e["ring"] <= 2 * e["one_gpu"] + 2e-2 * e["scale"], (rank, name, what, e)
