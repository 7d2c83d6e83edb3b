"""DeepSeek-V2 / V3 over two gloo processes: TP=2 (with and without sequence parallel: MLA's split down
projections and their gathers), PP=2 (a dense stage and an MoE stage) and EP=2 (each rank half of the
routed experts) give transformers' fp32 logits, as TP=PP=EP=1 does (tests/unit/test_deepseek.py); the
export at each layout is the HF checkpoint bit for bit; at TP=2 and PP=2 the static and continuous rollout engines'
greedy tokens are HF generate's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.conftest import run_two_ranks
from trinity.testing.tiny_models import make_tiny_hf_model

TOKENS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
PROMPTS = [[5, 9, 17, 3, 44, 2], [7, 1], [100, 12, 8, 60]]
NEW = 5


def _logits(model_dir: Path, block, rollout: bool, export: bool) -> tuple[torch.Tensor | None, list | None]:
    """fp32 logits [b, s, vocab] on the last pipeline stage (None elsewhere), HF weights loaded; with
    `rollout`, the greedy responses of the static and the continuous engine (every rank)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from trinity.convert.builtin import export_hf_weights, load_hf_weights
    from trinity.models.build import build_model, causal_mask
    from trinity.models.facts import ModelFacts

    facts = ModelFacts.from_hf_dir(model_dir)
    chunks = build_model(facts, block, device="cpu", dtype=torch.float32)
    load_hf_weights(chunks, model_dir, facts)
    for c in chunks:
        c.eval()  # megatron refuses MoE + TP without sequence parallel in training mode
    b, s = TOKENS.shape
    pos = torch.arange(s).expand(b, s)
    out: list[torch.Tensor] = []

    def forward_step(data_iterator, model):
        logits = model(next(data_iterator), pos, causal_mask(s), runtime_gather_output=True)
        return logits, lambda o: (out.append(o.detach()) or o.sum() * 0, {})

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([TOKENS]), model=chunks,
                                num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=True)
    if export:  # every rank iterates the export (collectives) and gets the whole HF checkpoint, bit for bit
        from safetensors.torch import load_file

        exported = dict(export_hf_weights(chunks, facts))
        source = load_file(str(model_dir / "model.safetensors"))
        assert set(exported) == set(source)
        assert all(torch.equal(exported[n], t) for n, t in source.items())
    responses = None
    if rollout:  # MLA's decode path at TP=2 (the latents' gathers) and PP=2
        from trinity.rollout.continuous import KVBudget, generate_continuous
        from trinity.rollout.reference import reference_generate
        from trinity.rollout.types import SamplingParams

        params = SamplingParams(temperature=0.0, max_new_tokens=NEW)
        kw = dict(vocab_size=facts.vocab_size, pad_id=0)
        runs = (reference_generate(chunks[0], PROMPTS, params, **kw),
                generate_continuous(chunks[0], PROMPTS, params, budget=KVBudget(max_num_seqs=2), **kw))
        responses = [[r.responses[i][r.response_mask[i].bool()].tolist() for i in range(len(PROMPTS))] for r in runs]
    return (out[0][..., : facts.vocab_size] if out else None), responses


def _worker(rank: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    from trinity.config.megatron import MegatronConfig
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel

    layouts = {
        "tp2": (ParallelLayout(tp=2), dict(tensor_model_parallel_size=2)),
        "tp2_sp": (ParallelLayout(tp=2), dict(tensor_model_parallel_size=2, sequence_parallel=True)),
        "pp2": (ParallelLayout(pp=2), dict(pipeline_model_parallel_size=2)),
        "ep2": (ParallelLayout(ep=2), dict(expert_model_parallel_size=2)),
    }
    results: dict[str, dict[str, torch.Tensor]] = {}
    for family in ("deepseek_v2", "deepseek_v3"):
        for name, (layout, fields) in layouts.items():
            init_parallel(device="cpu", layout=layout, seed=0, timeout_s=120)
            got, responses = _logits(Path(root) / family, MegatronConfig(**fields), rollout=name in ("tp2", "pp2"),
                                     export=name != "tp2_sp")  # SP changes no weight layout
            if got is not None:
                results.setdefault(family, {})[name] = got
            if responses is not None:
                results.setdefault(family, {})[f"{name}_rollout"] = responses
    destroy()
    torch.save(results, Path(root) / f"rank{rank}.pt")


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp2_pp2_ep2_logits_equal_hf(tmp_path):
    from trinity.convert.verify import hf_logits

    for family in ("deepseek_v2", "deepseek_v3"):
        make_tiny_hf_model(family, tmp_path / family)
    run_two_ranks(_worker, str(tmp_path), timeout=280)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    from transformers import AutoModelForCausalLM

    for family in ("deepseek_v2", "deepseek_v3"):
        want = hf_logits(tmp_path / family, TOKENS)
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / family, dtype=torch.float32).eval()
        greedy = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
        seen = set()
        for r, res in enumerate(ranks):
            for name, got in res.get(family, {}).items():
                if name.endswith("_rollout"):  # static and continuous engine: HF generate's tokens
                    assert got == [greedy, greedy], (family, name, r)
                else:
                    assert (got - want).abs().max() <= 1e-5, (family, name, r)
                seen.add(name)
        assert seen == {"tp2", "tp2_sp", "pp2", "ep2", "tp2_rollout", "pp2_rollout"}, family
