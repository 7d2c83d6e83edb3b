"""Context parallelism through the recipes' own forwards and losses (trinity.trainer.recipes): on gloo, a
tiny Qwen2 and a tiny DeepSeek-V3 (multi-latent attention, MoE) built by `build_model` at CP=2 (ring
attention, this rank's RoPE chunks) give the values of the same weights at CP=1 in fp32, and their parameter
gradients summed over the CP group (megatron's DDP sums
over DP x CP) equal CP=1's:
- SFT / PT: `TokenRows` + `SFTLoss` over packed and unpacked rows (each rank's token sum is its share);
- RL: response log-probs and entropies of padded rollout rows (padded on the fly to 2·CP chunks) and of
  packed rows (`pack_rollout`), gathered whole on every CP rank;
- DPO: `sequence_logps`, summed over the CP group.
GRPO at CP=2 through `trinity run` (resumed from a CP=1 checkpoint): tests/integration/test_rl_cpu.py::
test_grpo_runs_checkpoints_and_resumes_exactly; SFT and GRPO on GPUs: tests/gpu/test_context_parallel_gpu.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_ranks

B, S = 2, 32


def _cases(model, vocab: int) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """name: (values, parameter gradients) of each recipe's forward + loss on fixed inputs."""
    from trinity.rollout.types import Rollout
    from trinity.trainer.recipes.dpo import sequence_logps
    from trinity.trainer.recipes.rollout_forward import PaddedRollout, pack_rollout
    from trinity.trainer.recipes.sft import SFTLoss, TokenRows

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (B, S), generator=g)
    labels = torch.cat([tokens[:, 1:], torch.zeros(B, 1, dtype=torch.long)], 1)
    loss_mask = (torch.rand(B, S, generator=g) > 0.3).float()
    packed_docs = torch.tensor([[0] * 7 + [1] * 13 + [2] * 12, [0] * 3 + [1] * 20 + [-1] * 9])
    one_doc = torch.tensor([[0] * S, [0] * 25 + [-1] * 7])
    out = {}

    def run(name, fn):
        model.zero_grad()
        values, loss = fn()
        loss.backward()
        out[name] = ({k: v.detach() for k, v in values.items()},
                     {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    for name, docs in (("sft_packed", packed_docs), ("sft_unpacked", one_doc)):
        # unpacked rows attend causally at CP>1 (no document mask: torch's flash kernel on GPUs); their
        # trailing padding, which then sees the document, is trained by no loss
        pos = torch.arange(S).expand(B, S)
        rows = TokenRows(tokens, pos, docs, labels, loss_mask * (docs >= 0), torch.device("cpu"))

        def sft(rows=rows):
            loss, metrics = SFTLoss(vocab)(rows, rows.forward(model), denom=float(rows.loss_mask.sum()), scale=1.0)
            return {"loss_sum": metrics["loss_sum"]}, loss
        run(name, sft)

        def dpo(rows=rows):
            seq = sequence_logps(rows.forward(model), rows, vocab)
            return {"seq": seq}, (seq * torch.tensor([0.3, -0.7])).sum()
        run(name.replace("sft", "dpo"), dpo)

    # a rollout: left-padded prompts (5) and responses (6): 11 tokens, padded to 12 at CP=2
    P, R = 5, 6
    ro_tokens = torch.randint(1, vocab, (3, P + R), generator=g)
    prompt_mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    response_mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
    rollout = Rollout(ro_tokens, prompt_mask, response_mask, torch.zeros(3, R))
    w = torch.randn(3, R, generator=g)

    def padded():
        part = PaddedRollout(rollout, torch.arange(3))
        logp, ent = part.logprobs(part.forward(model), vocab, with_entropy=True)
        return {"logp": logp * response_mask, "entropy": ent * response_mask}, ((logp + 0.5 * ent) * w * response_mask).sum()
    run("rl_padded", padded)

    def packed():
        from megatron.core import parallel_state as ps

        cp = ps.get_context_parallel_world_size()
        parts = pack_rollout(rollout, 16, multiple=2 * cp if cp > 1 else 1)
        logp = torch.zeros(3, R)
        ent = torch.zeros(3, R)
        for part in parts:
            lp, en = part.logprobs(part.forward(model), vocab, with_entropy=True)
            logp = logp.index_put((part.index,), lp)
            ent = ent.index_put((part.index,), en)
        return {"logp": logp * response_mask, "entropy": ent * response_mask}, ((logp + 0.5 * ent) * w * response_mask).sum()
    run("rl_packed", packed)
    return out


def _worker(rank: int, port: int, model_dir: str, out: str) -> None:
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from megatron.core import parallel_state as ps

    from trinity.config.megatron import MegatronConfig
    from trinity.distributed import collectives
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts
    from trinity.models.ring_attention import RingCoreAttention

    facts = ModelFacts.from_hf_dir(model_dir)
    init_parallel(device="cpu", layout=ParallelLayout(), seed=1)  # CP=1 (DP=2): the reference on each rank
    try:
        ref = build_model(facts, MegatronConfig(), device="cpu", dtype=torch.float32)[0]
        state = {n: p.detach().clone() for n, p in ref.named_parameters()}
        want = _cases(ref, facts.vocab_size)
        init_parallel(device="cpu", layout=ParallelLayout(cp=2), seed=1)
        model = build_model(facts, MegatronConfig(context_parallel_size=2), device="cpu", dtype=torch.float32)[0]
        assert all(type(layer.self_attention.core_attention) is RingCoreAttention for layer in model.decoder.layers)
        from trinity.models.build import packed_attention
        from trinity.models.ring_attention import RingDocumentParams

        cpu = torch.device("cpu")  # unpacked rows attend causally (flash on GPUs), packed ones by document
        assert packed_attention(model, torch.tensor([[0, 0, 0, -1], [0, 0, 0, 0]]), cpu) == {"attention_mask": None}
        assert isinstance(packed_attention(model, torch.tensor([[0, 0, 1, -1]]), cpu)["packed_seq_params"],
                          RingDocumentParams)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(state[n])
        got = _cases(model, facts.vocab_size)
        group = ps.get_context_parallel_group()
        res = {}
        for name, (values, grads) in got.items():
            ref_values, ref_grads = want[name]
            errs = {}
            for k, v in values.items():
                # the SFT loss sum is each rank's share; everything else comes back whole
                whole = collectives.all_reduce(v, "sum", group) if k == "loss_sum" else v
                errs[k] = float((whole - ref_values[k]).abs().max())
            assert grads.keys() == ref_grads.keys(), name
            errs["grads"] = max(float((collectives.all_reduce(gr, "sum", group) - ref_grads[n]).abs().max())
                                for n, gr in grads.items())
            errs["grad_scale"] = max(float(gr.abs().max()) for gr in ref_grads.values())
            errs["value_scale"] = max(float(v.abs().max()) for v in ref_values.values())
            res[name] = errs
        Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    finally:
        destroy()


@pytest.mark.multiproc
@pytest.mark.slow  # two spawned ranks building two models: ~25 s on 2 idle cores
@pytest.mark.parametrize("family", ["qwen2", "deepseek_v3"])  # deepseek_v3: MLA (its own RoPE on q/k) + MoE
def test_cp2_recipes_equal_cp1(tmp_path, monkeypatch, family):
    from trinity.distributed import collectives
    from trinity.testing.tiny_models import make_tiny_hf_model

    monkeypatch.setenv(collectives.STRICT_ENV, "1")
    model_dir = make_tiny_hf_model(family, tmp_path / "model")
    run_ranks(2, _worker, str(model_dir), str(tmp_path))
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(res) == ["dpo_packed", "dpo_unpacked", "rl_packed", "rl_padded", "sft_packed", "sft_unpacked"]
        for name, errs in res.items():
            assert errs["grad_scale"] > 1e-3 and errs["value_scale"] > 0.1, (rank, name, errs)
            for what, err in errs.items():  # fp32 within 1e-5 (relative to a loss sum in the hundreds)
                if not what.endswith("scale"):
                    assert err < 1e-5 * (1 if what == "grads" else max(1.0, errs["value_scale"])), (rank, name, what, errs)
