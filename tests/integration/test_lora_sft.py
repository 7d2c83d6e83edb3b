"""LoRA adapters (actor.lora) on the CPU: exactness of a fresh adapter, what is trained and stored, and
SFT through `trinity run` at several layouts and across a resume."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import trinity_run

LORA = {"rank": 4, "alpha": 8.0}


def _cfg(**kw):
    return SimpleNamespace(**{"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["all-linear"], **kw})


def _forward(model, ids):
    from trinity.models.build import causal_mask

    pos = torch.arange(ids.shape[1]).expand_as(ids)
    return model(ids, pos, causal_mask(ids.shape[1]))


# ---------------------------------------------------------------- in process, one rank


def test_zero_b_is_the_base_model_and_merge_restores_bits(tiny_qwen2_tp1):
    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.models import lora
    from trinity.models.build import build_model

    facts, path = tiny_qwen2_tp1
    (model,) = build_model(facts, MegatronConfig(), device="cpu", dtype=torch.float32)
    load_hf_weights([model], path, facts)
    ids = torch.randint(0, facts.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = _forward(model, ids)
        names = sorted(n for n, _ in model.named_parameters())
        n = lora.apply_lora([model], _cfg())
        assert torch.equal(_forward(model, ids), base)  # B = 0: exactly the base model
        # base parameter names unchanged; adapters beside them, 4 linears x 2 layers x (A, B)
        assert sorted(k for k, _ in model.named_parameters() if ".lora." not in k) == names
        assert len(lora.adapter_state_dict([model])) == 4 * facts.num_layers * 2
        assert n == lora.adapter_parameter_count(facts, 4, ["all-linear"])
        assert all(not p.requires_grad for k, p in model.named_parameters() if ".lora." not in k)
        for _, _, a in lora.lora_modules([model]):
            a.lora_B.normal_(std=0.05)
        adapted = _forward(model, ids)
        assert (adapted - base).abs().max() > 1e-3
        with lora.adapters_disabled([model]):
            assert torch.equal(_forward(model, ids), base)
        bits = {k: p.clone() for k, p in model.named_parameters()}
        with lora.adapters_merged([model]):
            torch.testing.assert_close(_forward(model, ids), adapted, rtol=0, atol=1e-5)
        assert all(torch.equal(p, bits[k]) for k, p in model.named_parameters())
        assert torch.equal(_forward(model, ids), adapted)  # hooks back on after the merge


def test_only_adapters_reach_ddp_and_the_optimizer(tiny_qwen2_tp1):
    from trinity.config.megatron import MegatronConfig
    from trinity.config.schema import OptimConfig
    from trinity.models import lora
    from trinity.models.build import build_model
    from trinity.trainer.engine.setup import build_train_state

    facts, _ = tiny_qwen2_tp1
    (model,) = build_model(facts, MegatronConfig(), device="cpu", dtype=torch.float32)
    n = lora.apply_lora([model], _cfg(target_modules=["q_proj", "down_proj"]))
    assert n == lora.adapter_parameter_count(facts, 4, ["linear_qkv", "linear_fc2"])
    state = build_train_state([model], MegatronConfig(), OptimConfig(lr=1e-2), dtype=torch.float32, total_steps=2)
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = state.optimizer.chained_optimizers  # megatron chains one optimizer per param group
    assert inner and all(isinstance(o, DistributedOptimizer) for o in inner)  # use_distributed_optimizer: default
    buffers = sum(b.numel_unpadded for chunk in state.model for b in chunk.buffers)
    assert buffers == n
    in_optimizer = sum(p.numel() for g in state.optimizer.param_groups for p in g["params"])
    assert in_optimizer == n
    # one step changes the adapters (B leaves zero) and leaves every base weight bit for bit
    base = {k: p.clone() for k, p in model.named_parameters() if ".lora." not in k}
    ids = torch.randint(0, facts.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    for chunk in state.model:
        chunk.zero_grad_buffer()
    from trinity.models.build import causal_mask

    loss = state.model[0](ids, torch.arange(16).expand(2, 16), causal_mask(16), labels=ids).mean()
    loss.backward()
    ok, _, _ = state.optimizer.step()
    assert ok
    assert all(torch.equal(p, base[k]) for k, p in model.named_parameters() if ".lora." not in k)
    assert all(a.lora_B.abs().sum() > 0 for _, _, a in lora.lora_modules([model]))


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_gives_the_adapters_the_same_gradients(tiny_qwen2_tp1, granularity):
    """Full recompute checkpoints each layer on its hidden-state input, which a frozen embedding leaves
    without grad: the adapters would get none (apply_lora marks the embedding output)."""
    from trinity.config.megatron import MegatronConfig
    from trinity.models import lora
    from trinity.models.build import build_model, causal_mask

    facts, _ = tiny_qwen2_tp1
    ids = torch.randint(0, facts.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    grads = []
    for block in (MegatronConfig(), MegatronConfig(override_transformer_config={"recompute_granularity": granularity})):
        torch.manual_seed(0)
        (model,) = build_model(facts, block, device="cpu", dtype=torch.float32)
        lora.apply_lora([model], _cfg())
        for _, _, a in lora.lora_modules([model]):
            torch.nn.init.normal_(a.lora_B, std=0.05, generator=torch.Generator().manual_seed(1))
        model(ids, torch.arange(16).expand(2, 16), causal_mask(16), labels=ids).mean().backward()
        grads.append({k: p.grad for k, p in model.named_parameters() if p.requires_grad})
    plain, recomputed = grads
    assert plain.keys() == recomputed.keys() and len(plain) == 4 * facts.num_layers * 2
    for k in plain:
        assert recomputed[k] is not None, k
        torch.testing.assert_close(recomputed[k], plain[k], rtol=0, atol=1e-6, msg=k)


def test_the_docs_cpu_example_validates_as_shown(tmp_path, monkeypatch, capsys):
    """docs/lora.md's `trinity validate --config configs/lora_sft_cpu.yaml` on the quickstart assets
    prints the lines the doc shows (its ```text block), in order."""
    import re

    from trinity.cli.commands import validate
    from trinity.testing.tiny_assets import make_quickstart_assets

    repo = Path(__file__).resolve().parents[2]
    doc = (repo / "docs" / "lora.md").read_text()
    assert "trinity tiny-assets quickstart_assets" in doc and "trinity run --config configs/lora_sft_cpu.yaml" in doc
    shown = re.search(r"```text\n(LoRA: .*?)```", doc, re.S).group(1).strip().splitlines()
    make_quickstart_assets(tmp_path / "quickstart_assets")
    monkeypatch.chdir(tmp_path)  # the config's paths are relative to where trinity starts
    assert validate(repo / "configs" / "lora_sft_cpu.yaml", []) == 0
    printed = capsys.readouterr().out.splitlines()
    at = 0
    for line in shown:
        at = printed.index(line, at) + 1  # ValueError: the doc shows a line validate does not print


# ---------------------------------------------------------------- trinity run


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer, write_sft_dataset

    root = tmp_path_factory.mktemp("lora_assets")
    tok = make_tiny_tokenizer(root / "tokenizer")
    model = make_tiny_qwen2(root / "model", tok, num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2)
    return {"model": model, "data": write_sft_dataset(root / "sft.jsonl", 300, seed=0)}


def job(assets, out: Path, *, steps: int = 4, save: int | None = None, nproc: int = 1, **megatron) -> dict:
    return {
        "algorithm": {"name": "sft"},
        "model": {"path": str(assets["model"])},
        "data": {"train_files": [str(assets["data"])], "seq_length": 64, "packing": True},
        "cluster": {"device": "cpu", "nproc_per_node": nproc},
        "trainer": {"total_steps": steps, "global_batch_size": 8, "micro_batch_size": 2, "output_dir": str(out),
                    "save_interval": save, "keep_last": 4, "log_interval": 1, "tensorboard": False, "export_hf": False},
        "actor_rollout_ref": {"actor": {
            "optim": {"lr": 1e-2, "lr_scheduler": "constant", "weight_decay": 0.0, "clip_grad": 1.0},
            "megatron": megatron, "lora": LORA,
        }},
    }


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


_STORED: dict[Path, dict[str, torch.Tensor]] = {}


def stored_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a dist checkpoint by sharded key (in a child process: it needs a process group).
    Read once per checkpoint: three tests compare against the baseline's step 4 (each child imports
    megatron-core, seconds)."""
    import subprocess
    import sys

    if ckpt in _STORED:
        return {k: v.clone() for k, v in _STORED[ckpt].items()}

    code = (
        "import sys, torch, torch.distributed as d\n"
        "from trinity.distributed.parallel import free_port\n"
        "d.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n"
        "from megatron.core.dist_checkpointing.serialization import load_plain_tensors\n"
        "sd = load_plain_tensors(sys.argv[1])\n"
        "torch.save({k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}, sys.argv[2])\n"
    )
    dest = ckpt.parent / f"{ckpt.name}.tensors.pt"
    subprocess.run([sys.executable, "-c", code, str(ckpt), str(dest)], check=True, timeout=120,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _STORED[ckpt] = torch.load(dest)
    return {k: v.clone() for k, v in _STORED[ckpt].items()}


@pytest.fixture(scope="module")
def baseline(assets, tmp_path_factory) -> Path:
    """4 LoRA steps at TP=PP=DP=1, a checkpoint at step 2 and 4."""
    tmp = tmp_path_factory.mktemp("lora_base")
    proc = trinity_run(job(assets, tmp / "run", save=2), tmp / "job.yaml", timeout=170, reuse_conversion=True)
    assert proc.returncode == 0
    assert "LoRA: 13,312 trainable adapter parameters" in proc.stdout  # the plan
    assert "LoRA rank 4 on linear_qkv, linear_proj, linear_fc1, linear_fc2: 13,312 trainable parameters" in proc.stdout
    return tmp / "run"


@pytest.mark.slow
def test_lora_sft_learns_and_its_checkpoint_holds_only_adapters(baseline):
    b = losses(baseline)
    assert sorted(b) == [1, 2, 3, 4] and b[4] < b[1] - 0.1, b
    stored = stored_tensors(baseline / "checkpoints" / "step_4")
    model = sorted(k for k in stored if not k.startswith("optimizer."))
    assert model and all(".lora.lora_" in k for k in model), model
    assert len(model) == 8  # (A, B) x 4 linears, layers stacked along the sharded key's first axis
    meta = json.loads((baseline / "checkpoints" / "step_4" / "trinity_meta.json").read_text())
    assert meta["lora"]["rank"] == 4


@pytest.mark.slow
def test_resume_is_bit_exact(assets, baseline, tmp_path):
    out = tmp_path / "run"
    assert trinity_run(job(assets, out, steps=2, save=2), tmp_path / "a.yaml", timeout=170, reuse_conversion=True).returncode == 0
    proc = trinity_run(job(assets, out, steps=4, save=2), tmp_path / "b.yaml", timeout=170, reuse_conversion=True)
    assert proc.returncode == 0 and "at step 2" in proc.stdout
    assert losses(out) == losses(baseline)  # bit-equal floats, steps 1-4
    mine, theirs = stored_tensors(out / "checkpoints" / "step_4"), stored_tensors(baseline / "checkpoints" / "step_4")
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), [k for k in mine if not torch.equal(mine[k], theirs[k])]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(
    "layout",
    [
        {"tensor_model_parallel_size": 2, "sequence_parallel": True},  # TP=2's code paths, and SP's
        {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},  # PP=2, 2 chunks each
        {"use_distributed_optimizer": True, "overlap_grad_reduce": True},  # DP=2: adapter states sharded over DP
    ],
    ids=["tp2_sp", "pp2_vpp2", "dp2"],
)
def test_layouts_give_the_same_lora_losses(assets, baseline, tmp_path, layout):
    """TP=2 (adapter A or B sharded like the base weight; with sequence parallel the adapter's input is
    this rank's sequence shard), PP=2 (+VPP: adapters live in each stage's chunks) and DP=2 (the
    distributed optimizer shards the adapters' states) follow the TP=1 run: the adapters, initialised
    from the layer's global name, are the same at any layout."""
    assert trinity_run(job(assets, tmp_path / "run", nproc=2, **layout), tmp_path / "job.yaml", timeout=170, reuse_conversion=True).returncode == 0
    mine, ref = losses(tmp_path / "run"), losses(baseline)
    assert sorted(mine) == [1, 2, 3, 4]
    for step in mine:
        assert mine[step] == pytest.approx(ref[step], rel=1e-5), (step, mine, ref)


@pytest.mark.slow
def test_pretraining_with_lora_and_the_optimizer_in_host_memory(assets, baseline, tmp_path):
    """`pt` (every token trained, the SFT step) with LoRA, and optimizer_offload (the host optimizer
    steps the adapters' fp32 states in host memory): runs and its loss falls."""
    cfg = job(assets, tmp_path / "run", steps=6, optimizer_offload=True)
    cfg["algorithm"]["name"] = "pt"
    cfg["data"] = {"train_files": [str(Path(__file__).resolve().parents[2] / "README.md")], "seq_length": 64}
    proc = trinity_run(cfg, tmp_path / "job.yaml", timeout=170, reuse_conversion=True)
    assert proc.returncode == 0
    b = losses(tmp_path / "run")
    assert sorted(b) == list(range(1, 7)) and b[6] < b[1] - 0.1, b


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_tp1_checkpoint_resumes_at_tp2(assets, baseline, tmp_path):
    """The adapters' checkpoint is reshardable like the model's: step 2 of the TP=1 run, resumed at TP=2,
    gives the TP=1 losses of steps 3-4 and the same adapter tensors at step 4 (linear_fc1's B is stored as
    gate and up halves, as megatron stores the fused weight)."""
    import shutil

    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(baseline / "checkpoints" / "step_2", out / "checkpoints" / "step_2")
    proc = trinity_run(job(assets, out, save=2, nproc=2, tensor_model_parallel_size=2), tmp_path / "tp2.yaml", timeout=170, reuse_conversion=True)
    assert proc.returncode == 0 and "at step 2" in proc.stdout
    mine, ref = losses(out), losses(baseline)
    assert sorted(mine) == [3, 4]
    for step in mine:
        assert mine[step] == pytest.approx(ref[step], rel=1e-5), (step, mine, ref)
    a, b = stored_tensors(out / "checkpoints" / "step_4"), stored_tensors(baseline / "checkpoints" / "step_4")
    lora = sorted(k for k in b if ".lora.lora_" in k and not k.startswith("optimizer."))
    assert lora and all(k in a for k in lora)
    for k in lora:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)
