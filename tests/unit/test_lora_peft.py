"""LoRA adapters as a PEFT folder (trinity.convert.peft_io) and the merged HF export, against PEFT and
transformers themselves, in fp32 on CPU.

The tiny Qwen2 has GQA (4 heads, 2 query groups), so megatron's fused linear_qkv interleaves
[q q k v] per group: a wrong de-interleaving of B gives other logits. Every adapter gets a random
non-zero A and B (a fresh adapter's B is zero and would hide any mistake).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trinity.errors import UserError

RANK, ALPHA = 4, 8.0
LORA = SimpleNamespace(rank=RANK, alpha=ALPHA, dropout=0.0,
                       target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
TOKENS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))


def _build(facts, hf_dir, *, tp: int = 1, pp: int = 1):
    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.models.build import build_model
    from trinity.models.lora import apply_lora

    block = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    chunks = build_model(facts, block, device="cpu", dtype=torch.float32)
    load_hf_weights(chunks, hf_dir, facts)
    apply_lora(chunks, LORA)
    return chunks


def _randomise(chunks, seed: int = 0) -> None:
    from trinity.models.lora import lora_modules

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, _, a in lora_modules(chunks):
            a.lora_A.copy_(torch.randn(a.lora_A.shape, generator=g) * 0.2)
            a.lora_B.copy_(torch.randn(a.lora_B.shape, generator=g) * 0.2)


def _ours(chunks, vocab: int) -> torch.Tensor:
    from trinity.models.build import causal_mask

    model = chunks[0]
    pos = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
    with torch.no_grad():
        out = model(TOKENS, pos, causal_mask(TOKENS.shape[1]), runtime_gather_output=True)
    return out[..., :vocab].float()


def _peft_logits(hf_dir: Path, folder: Path) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(folder)).eval()
    with torch.no_grad():
        return model(TOKENS).logits.float()


def _hf_logits(hf_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits.float()


@pytest.fixture(scope="module")
def adapted(tiny_qwen2_tp1, tmp_path_factory):
    """(facts, HF folder, chunks with random adapters, their logits, their PEFT folder)."""
    from trinity.convert.peft_io import save_peft_folder

    facts, hf_dir = tiny_qwen2_tp1
    chunks = _build(facts, hf_dir)
    base = _ours(chunks, facts.vocab_size)
    _randomise(chunks)
    logits = _ours(chunks, facts.vocab_size)
    assert (logits - base).abs().max() > 1e-2  # the adapters change the model: the checks below can fail
    folder = save_peft_folder(chunks, facts, tmp_path_factory.mktemp("peft") / "adapter", rank=RANK, alpha=ALPHA,
                              dropout=0.0, base_model=str(hf_dir))
    return SimpleNamespace(facts=facts, hf_dir=hf_dir, chunks=chunks, logits=logits, folder=folder)


def test_peft_loads_our_adapters_and_gives_our_logits(adapted):
    cfg = json.loads((adapted.folder / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["peft_type"]) == (RANK, ALPHA, "LORA")
    assert cfg["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    theirs = _peft_logits(adapted.hf_dir, adapted.folder)
    assert (theirs - adapted.logits).abs().max() < 1e-4


def test_q_k_v_share_a_and_take_their_rows_of_b(adapted):
    from safetensors.torch import load_file

    from trinity.models.lora import lora_modules

    t = load_file(str(adapted.folder / "adapter_model.safetensors"))
    att = "base_model.model.model.layers.1.self_attn"
    a = [t[f"{att}.{p}_proj.lora_A.weight"] for p in "qkv"]
    assert torch.equal(a[0], a[1]) and torch.equal(a[0], a[2])
    qkv = {n: ad for n, _, ad in lora_modules(adapted.chunks)}["decoder.layers.1.self_attention.linear_qkv"]
    assert torch.equal(a[0], qkv.lora_A.detach())
    # group 0's rows of the fused B are [q heads 0-1; k head 0; v head 0] (head_dim 16)
    b = qkv.lora_B.detach()
    hd = adapted.facts.head_dim
    assert torch.equal(t[f"{att}.q_proj.lora_B.weight"][: 2 * hd], b[: 2 * hd])
    assert torch.equal(t[f"{att}.k_proj.lora_B.weight"][:hd], b[2 * hd: 3 * hd])
    assert torch.equal(t[f"{att}.v_proj.lora_B.weight"][:hd], b[3 * hd: 4 * hd])


def test_peft_folder_loads_back_exactly(adapted):
    from trinity.models.lora import lora_modules
    from trinity.convert.peft_io import load_peft_adapters

    fresh = _build(adapted.facts, adapted.hf_dir)
    assert load_peft_adapters(fresh, adapted.folder, adapted.facts, rank=RANK, alpha=ALPHA) == 8
    for (n1, _, a1), (n2, _, a2) in zip(lora_modules(adapted.chunks), lora_modules(fresh), strict=True):
        assert n1 == n2 and torch.equal(a1.lora_A, a2.lora_A) and torch.equal(a1.lora_B, a2.lora_B), n1
    with pytest.raises(UserError, match=r"adapter_config.json: r 4, lora_alpha 8.0 but the model's adapters have rank 8, alpha 8.0"):
        load_peft_adapters(fresh, adapted.folder, adapted.facts, rank=8, alpha=ALPHA)


def test_foreign_adapter_with_its_own_a_per_projection_is_refused(adapted, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from trinity.convert.peft_io import load_peft_adapters

    folder = tmp_path / "foreign"
    shutil.copytree(adapted.folder, folder)
    t = load_file(str(folder / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"
    t[key] = t[key] + 1.0
    save_file(t, str(folder / "adapter_model.safetensors"))
    fresh = _build(adapted.facts, adapted.hf_dir)
    message = (r"foreign/adapter_model.safetensors: model.layers.0.self_attn.k_proj and "
               r"model.layers.0.self_attn.q_proj have different lora_A; megatron fuses them into one linear ")
    with pytest.raises(UserError, match=message):
        load_peft_adapters(fresh, folder, adapted.facts, rank=RANK, alpha=ALPHA)
    # the same check before launch (actor.lora.adapter_path), reading the lora_A tensors only
    from trinity.models.lora_targets import check_shared_a

    with pytest.raises(UserError, match=message):
        check_shared_a(folder)
    check_shared_a(adapted.folder)  # trinity's own folders: one A per fused linear


def test_merged_export_gives_the_adapted_logits_and_restores_the_weights(adapted, tmp_path):
    from trinity.convert.builtin import export_hf_weights
    from trinity.convert.jobs import save_hf_folder
    from trinity.models.lora import adapters_merged

    before = {n: p.detach().clone() for n, p in adapted.chunks[0].named_parameters()}
    with adapters_merged(adapted.chunks):
        # written inside: at TP=1 the exported tensors are views of the (merged) parameters
        save_hf_folder(export_hf_weights(adapted.chunks, adapted.facts), tmp_path / "merged", adapted.hf_dir,
                       torch.float32)
    from trinity.convert.hf_io import HFCheckpoint

    assert all(".lora" not in name for name in HFCheckpoint(tmp_path / "merged").names())
    assert (_hf_logits(tmp_path / "merged") - adapted.logits).abs().max() < 1e-4
    for n, p in adapted.chunks[0].named_parameters():
        assert torch.equal(p, before[n]), n


# ---------------------------------------------------------------- a TP=2 job's adapters


def _tp2_worker(rank: int, port: int, hf_dir: str, folder: str, out: str) -> None:
    """TP=2: load the TP=1 job's folder (each rank cuts its shards), run, save it back (gathered); then PP=2
    (one layer per stage): load and save again, the stages' adapters gathered under their global layer names."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.facts import ModelFacts
    from trinity.convert.peft_io import load_peft_adapters, save_peft_folder

    init_parallel(device="cpu", layout=ParallelLayout(tp=2), seed=3, timeout_s=120)
    facts = ModelFacts.from_hf_dir(hf_dir)
    chunks = _build(facts, Path(hf_dir), tp=2)
    load_peft_adapters(chunks, folder, facts, rank=RANK, alpha=ALPHA)  # each rank cuts its shards
    logits = _ours(chunks, facts.vocab_size)
    save_peft_folder(chunks, facts, Path(out) / "adapter", rank=RANK, alpha=ALPHA, dropout=0.0, base_model=hf_dir)
    # the rollout at TP=2 (module path: the adapters' hooks with their TP collectives) with the adapters
    # unmerged (actor.lora.rollout_weights `adapters`) and merged
    from trinity.rollout.continuous import generate_continuous
    from trinity.rollout.types import SamplingParams
    from trinity.trainer.recipes.lora_ref import rollout_weights

    rollouts = {}
    for keep in ("adapters", "device"):
        with rollout_weights(chunks, keep=keep):
            rollouts[keep] = generate_continuous(chunks[0], [[5, 6, 7], [9, 10, 11, 12]], SamplingParams(
                temperature=0.0, max_new_tokens=4), vocab_size=facts.vocab_size, pad_id=0)
    if rank == 0:
        torch.save(logits, Path(out) / "logits.pt")
        torch.save({k: (r.tokens, r.logprobs) for k, r in rollouts.items()}, Path(out) / "rollouts.pt")
    init_parallel(device="cpu", layout=ParallelLayout(pp=2), seed=3, timeout_s=120)
    chunks = _build(facts, Path(hf_dir), pp=2)
    assert load_peft_adapters(chunks, folder, facts, rank=RANK, alpha=ALPHA) == 4  # this stage's layer
    save_peft_folder(chunks, facts, Path(out) / "adapter_pp2", rank=RANK, alpha=ALPHA, dropout=0.0, base_model=hf_dir)
    destroy()


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tp2_and_pp2_jobs_gather_and_split_adapters_exactly(adapted, tmp_path):
    from safetensors.torch import load_file

    from tests.conftest import run_two_ranks

    run_two_ranks(_tp2_worker, str(adapted.hf_dir), str(adapted.folder), str(tmp_path))
    # TP=2 ran the TP=1 job's adapters (split per rank) and gathered them back bit for bit
    ours = load_file(str(adapted.folder / "adapter_model.safetensors"))
    for folder in ("adapter", "adapter_pp2"):
        back = load_file(str(tmp_path / folder / "adapter_model.safetensors"))
        assert sorted(ours) == sorted(back), folder
        for k in ours:
            assert torch.equal(ours[k], back[k]), (folder, k)
    assert (torch.load(tmp_path / "logits.pt") - adapted.logits).abs().max() < 1e-4
    ro = torch.load(tmp_path / "rollouts.pt")
    assert torch.equal(ro["adapters"][0], ro["device"][0])  # greedy tokens of the TP=2 rollouts
    assert (ro["adapters"][1] - ro["device"][1]).abs().max() < 1e-5


# ---------------------------------------------------------------- a job started from a PEFT folder


def test_a_job_starts_from_a_peft_folder_with_its_logits(adapted):
    """actor.lora.adapter_path: the actor's engine (built as a job builds it) starts with the folder's
    adapters: its step-0 logits are those of the model that wrote the folder."""
    from trinity.config.megatron import MegatronConfig
    from trinity.config.roles import Role
    from trinity.config.schema import LoraConfig, OptimConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.models.build import build_model
    from trinity.trainer.engine import RoleEngine

    chunks = build_model(adapted.facts, MegatronConfig(), device="cpu", dtype=torch.float32)
    load_hf_weights(chunks, adapted.hf_dir, adapted.facts)
    lora = LoraConfig(rank=RANK, alpha=ALPHA, target_modules=["all-linear"], adapter_path=str(adapted.folder))
    engine = RoleEngine(Role.actor, chunks, MegatronConfig(), OptimConfig(lr=1e-3), dtype=torch.float32,
                        total_steps=2, lora=lora, facts=adapted.facts)
    assert engine.lora_loaded == 2 * 4
    assert torch.equal(_ours(engine.modules, adapted.facts.vocab_size), adapted.logits)


def _job(small_job, **lora):
    job = {**small_job, "actor_rollout_ref": {"actor": {"lora": lora}}}
    return job


def test_adapter_path_is_checked_against_the_job_before_launch(adapted, write_job, small_job, tmp_path):
    from trinity.config.loader import load_config
    from trinity.errors import ConfigError

    p = "actor_rollout_ref.actor.lora"
    where = adapted.folder / "adapter_config.json"
    ok = load_config(write_job(_job(small_job, rank=RANK, alpha=ALPHA, adapter_path=str(adapted.folder))), []).config
    assert ok.actor_rollout_ref.actor.lora.adapter_path == str(adapted.folder)

    def problems(**lora):
        with pytest.raises(ConfigError) as err:
            load_config(write_job(_job(small_job, **lora)), [])
        return sorted(x for x in err.value.problems if x.startswith(p))

    assert problems(rank=8, alpha=16.0, target_modules=["q_proj", "o_proj"], adapter_path=str(adapted.folder)) == [
        f"{p}.alpha: 16 but {where} has lora_alpha 8.0; set {p}.alpha to 8.0 to start from its adapters",
        f"{p}.rank: 8 but {where} has r 4; set {p}.rank to 4 to start from its adapters",
        f"{p}.target_modules: adapts linear_qkv, linear_proj but {where} adapts linear_qkv, linear_proj, "
        f"linear_fc1, linear_fc2; set {p}.target_modules to ['linear_qkv', 'linear_proj', 'linear_fc1', 'linear_fc2']",
    ]
    assert problems(rank=RANK, adapter_path=str(tmp_path / "nowhere")) == [
        f"{p}.adapter_path: {tmp_path / 'nowhere'} does not exist; point it at a PEFT adapter folder "
        "(adapter_config.json + adapter_model.safetensors)"]
    assert problems(adapter_path=str(adapted.folder)) == [
        f"{p}.adapter_path: has no effect while {p}.rank is 0 (LoRA off); set rank >= 1 or remove the key"]
    # a PEFT folder adapting q and v only: megatron's fused linear_qkv cannot hold a part of q, k, v
    foreign = tmp_path / "qv"
    foreign.mkdir()
    (foreign / "adapter_model.safetensors").write_bytes((adapted.folder / "adapter_model.safetensors").read_bytes())
    (foreign / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": ["q_proj", "v_proj"]}))
    assert problems(rank=RANK, alpha=ALPHA, adapter_path=str(foreign)) == [
        f"{p}.adapter_path: {foreign / 'adapter_config.json'}: target_modules adapts q_proj, v_proj but not k_proj; "
        "megatron-core fuses q_proj, k_proj, v_proj into linear_qkv, whose one adapter cannot hold a part of them: "
        "only folders adapting all of them (with one shared lora_A) load"]
    (foreign / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "use_dora": True}))
    assert problems(rank=RANK, alpha=ALPHA, adapter_path=str(foreign)) == [
        f"{p}.adapter_path: {foreign / 'adapter_config.json'}: use_dora: only plain LoRA adapters (peft_type LORA, "
        "one r and lora_alpha, no DoRA, rsLoRA, bias or modules_to_save) map onto trinity's adapters"]


def test_rollout_weights_is_refused_where_there_is_no_rollout(write_job, small_job):
    from trinity.config.loader import load_config
    from trinity.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(write_job(_job(small_job, rank=RANK, rollout_weights="adapters")), [])
    assert err.value.problems == ["actor_rollout_ref.actor.lora.rollout_weights: sft jobs have no rollout, so it has "
                                  "no effect; remove the key"]
    job = {**_job(small_job, rank=RANK, rollout_weights="adapters"), "algorithm": {"name": "grpo"},
           "data": {**small_job["data"], "train_batch_size": 8}}
    assert load_config(write_job(job), []).config.actor_rollout_ref.actor.lora.rollout_weights == "adapters"
