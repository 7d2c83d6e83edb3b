"""Two gloo processes at TP=2 (with and without sequence parallel) against the same model at TP=1.

With use_cpu_initialization megatron draws each weight in full from the default generator and keeps
this rank's slice, so the same seed gives the same model at any TP size: logits must agree.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from trinity.config.megatron import MegatronConfig
from trinity.distributed.layout import ParallelLayout
from trinity.testing.tiny_models import make_tiny_hf_model

SEED = 21
MICRO_BATCHES = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(4)]


def _run(model_dir: Path, tp: int, sequence_parallel: bool) -> dict[str, torch.Tensor]:
    from trinity.models.build import build_model, causal_mask
    from trinity.models.facts import ModelFacts

    facts = ModelFacts.from_hf_dir(model_dir)
    torch.manual_seed(SEED)
    from trinity.compat import cpu_compat

    cpu_compat.model_parallel_seed(SEED)
    block = MegatronConfig(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel)
    (model,) = build_model(facts, block, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16).expand(2, 16)
    logits = model(ids, pos, causal_mask(16), runtime_gather_output=True)
    loss = model(ids, pos, causal_mask(16), labels=ids).mean()
    loss.backward()
    emb_grad = model.embedding.word_embeddings.weight.grad
    return {"logits": logits.detach(), "loss": loss.detach(), "emb_grad_norm_sq": emb_grad.square().sum()}


def _pipeline_chunks(model_dir: Path) -> list[dict]:
    """PP=2 x VPP=2 over a 4-layer model: which chunk has the embedding / output layer / which layers,
    then one interleaved 1F1B forward/backward through megatron's schedule (p2p over gloo)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from trinity.models.build import build_model, causal_mask
    from trinity.models.facts import ModelFacts
    from trinity.models.spec import layer_offset

    from trinity.convert.builtin import load_hf_weights

    facts = ModelFacts.from_hf_dir(model_dir)
    block = MegatronConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    chunks = build_model(facts, block, device="cpu", dtype=torch.float32)
    load_hf_weights(chunks, model_dir, facts)
    summary = [
        {"pre": c.pre_process, "post": c.post_process, "layers": len(c.decoder.layers),
         "offset": layer_offset(c.config, vp_stage=i), "names": sorted(n for n, _ in c.named_parameters())}
        for i, c in enumerate(chunks)
    ]
    pos = torch.arange(16).expand(2, 16)

    def forward_step(data_iterator, model):
        ids = next(data_iterator)
        out = model(ids, pos, causal_mask(16), labels=ids)
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

    # Distinct micro batches: a schedule that hands a chunk another micro batch's activations (or
    # swaps an activation with a gradient in the PP=2 exchange) shows up as a wrong loss.
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=[iter(MICRO_BATCHES), iter(MICRO_BATCHES)], model=chunks,
        num_microbatches=4,
        seq_length=16, micro_batch_size=2, forward_only=False,
    )
    grads = [p.grad for c in chunks for p in c.parameters()]
    summary.append({"losses": [d["loss"].item() for d in losses],
                    "all_grads": all(g is not None and torch.isfinite(g).all() for g in grads)})
    return summary


def _worker(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch.distributed as dist

    from trinity.distributed.parallel import destroy, init_parallel

    init_parallel(device="cpu", layout=ParallelLayout(tp=2), seed=SEED, timeout_s=120)
    results = {}
    for sp in (False, True):
        out = _run(Path(model_dir), tp=2, sequence_parallel=sp)
        # embedding grads are vocab-sharded over TP: sum the squares over ranks
        dist.all_reduce(out["emb_grad_norm_sq"])
        results[f"sp={sp}"] = out
    torch.save(results, Path(out_dir) / f"tp2_rank{rank}.pt")
    init_parallel(device="cpu", layout=ParallelLayout(pp=2, vpp=2), seed=SEED, timeout_s=120)
    torch.save(_pipeline_chunks(Path(out_dir) / "four_layers"), Path(out_dir) / f"pp2_rank{rank}.pt")
    destroy()


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tp2_forward_backward_matches_tp1(tmp_path):
    from trinity.distributed.parallel import destroy, free_port, init_parallel

    # vocab 256 pads to 256 at TP=1 and TP=2 alike, so both draw the same weights
    model_dir = make_tiny_hf_model("qwen2", tmp_path / "qwen2", seed=1, vocab_size=256)
    make_tiny_hf_model("llama", tmp_path / "four_layers", num_hidden_layers=4)
    mp.start_processes(_worker, args=(2, free_port(), str(model_dir), str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    tp2 = torch.load(tmp_path / "tp2_rank0.pt")

    init_parallel(device="cpu", layout=ParallelLayout(), seed=SEED)
    try:
        ref = _run(model_dir, tp=1, sequence_parallel=False)
    finally:
        destroy()
    for name, got in tp2.items():
        torch.testing.assert_close(got["logits"], ref["logits"], atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(got["loss"], ref["loss"], atol=1e-6, rtol=0, msg=name)
        torch.testing.assert_close(got["emb_grad_norm_sq"], ref["emb_grad_norm_sq"], atol=1e-6, rtol=1e-5, msg=name)

    # Interleaved pipeline: layer L lives on rank (L // 1) % 2, chunk L // 2 (one layer per chunk).
    pp = [torch.load(tmp_path / f"pp2_rank{r}.pt") for r in range(2)]
    assert [[(c["pre"], c["post"], c["layers"], c["offset"]) for c in rank[:2]] for rank in pp] == [
        [(True, False, 1, 0), (False, False, 1, 2)],
        [(False, False, 1, 1), (False, True, 1, 3)],
    ]
    assert "embedding.word_embeddings.weight" in pp[0][0]["names"]
    assert {"decoder.final_layernorm.weight", "output_layer.weight"} <= set(pp[1][1]["names"])
    assert not any(n.startswith(("embedding", "output_layer")) for n in pp[0][1]["names"] + pp[1][0]["names"])
    # The schedule ran 4 micro-batches; the last stage reports their losses, every grad is set.
    assert pp[0][2]["losses"] == [] and len(pp[1][2]["losses"]) == 4
    # ...equal to HF's mean token cross-entropy on each micro batch (forward and backward interleaved).
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "four_layers"), dtype=torch.float32)
    with torch.no_grad():
        want = [torch.nn.functional.cross_entropy(hf(ids).logits.flatten(0, 1), ids.flatten()).item() for ids in MICRO_BATCHES]
    assert pp[1][2]["losses"] == pytest.approx(want, abs=1e-5)
    assert pp[0][2]["all_grads"] and pp[1][2]["all_grads"]
