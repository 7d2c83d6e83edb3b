"""MoE through mbridge (`use_mbridge: true`, `--backend mbridge`), as Trinity-RFT's guide recommends for
Qwen3-30B-A3B (#20): tiny Qwen3-MoE and Mixtral loaded and exported through mbridge 0.15.1 give exactly
the tensors of trinity's builtin converter, at EP=1 in this process and at EP=2 over two gloo ranks
(each rank holds half of the experts; mbridge's EP code gathers them for the export)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_two_ranks
from trinity.testing.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.timeout(300)


def _compare(hf_dir: Path, ep: int) -> None:
    """Build the model twice at this process group's layout, load one through the builtin converter
    and one through mbridge: every parameter equal; both exports equal the HF source."""
    from trinity.convert import mbridge_adapter
    from trinity.convert.options import megatron_config
    from trinity.convert.builtin import export_hf_weights, load_hf_weights
    from trinity.convert.jobs import _build
    from trinity.models.facts import ModelFacts

    facts = ModelFacts.from_hf_dir(hf_dir)
    block = megatron_config(ep=ep)
    builtin, bridged = _build(facts, block, "cpu", torch.float32), _build(facts, block, "cpu", torch.float32)
    with torch.no_grad():
        for p in bridged[0].parameters():
            p.fill_(7.0)  # a parameter mbridge left alone shows
    load_hf_weights(builtin, hf_dir, facts)
    mbridge_adapter.load_weights(bridged, hf_dir, facts)
    want, got = dict(builtin[0].named_parameters()), dict(bridged[0].named_parameters())
    assert sorted(got) == sorted(want)
    experts = [n for n in want if ".local_experts." in n]
    assert len(experts) == 2 * 2 * facts.num_experts // ep  # 2 layers x (fc1, fc2) x this rank's experts
    for name in want:
        assert torch.equal(got[name], want[name]), name
    source = load_file(str(hf_dir / "model.safetensors"))
    ours = dict(export_hf_weights(builtin, facts))
    theirs = dict(mbridge_adapter.export_weights(bridged, hf_dir, facts))
    assert sorted(theirs) == sorted(ours) == sorted(source)
    for name in source:
        assert torch.equal(theirs[name], source[name]) and torch.equal(ours[name], source[name]), name


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_mbridge_moe_equals_builtin_at_ep1(tmp_path, family):
    from trinity.convert.options import megatron_config
    from trinity.convert.jobs import parallel_session

    hf = make_tiny_hf_model(family, tmp_path / "hf")
    with parallel_session("cpu", megatron_config()):
        _compare(hf, ep=1)


def _ep2_worker(rank: int, port: int, hf_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel

    init_parallel(device="cpu", layout=ParallelLayout(ep=2), seed=0, timeout_s=120)
    try:
        _compare(Path(hf_dir), ep=2)
    finally:
        destroy()


@pytest.mark.multiproc
@pytest.mark.slow
def test_mbridge_qwen3_moe_equals_builtin_at_ep2(tmp_path):
    hf = make_tiny_hf_model("qwen3_moe", tmp_path / "hf")
    run_two_ranks(_ep2_worker, str(hf), timeout=240)


def test_hf_to_mcore_with_the_mbridge_backend_equals_builtin_for_moe(tmp_path):
    """`trinity convert hf-to-mcore --backend mbridge` on a MoE model (refused before): the checkpoint
    holds the builtin backend's tensors."""
    from megatron.core import dist_checkpointing

    from trinity.convert.api import hf_to_mcore

    hf = make_tiny_hf_model("qwen3_moe", tmp_path / "hf")
    for backend in ("builtin", "mbridge"):
        hf_to_mcore(str(hf), str(tmp_path / backend), backend=backend, dtype="fp32", device="cpu")
    a = dist_checkpointing.load_tensors_metadata(str(tmp_path / "builtin"))
    b = dist_checkpointing.load_tensors_metadata(str(tmp_path / "mbridge"))
    assert sorted(a) == sorted(b) and "decoder.layers.mlp.experts.experts.linear_fc1.weight" in a
    files = sorted(p.name for p in (tmp_path / "builtin").glob("*.distcp"))
    assert files == sorted(p.name for p in (tmp_path / "mbridge").glob("*.distcp"))
    for name in files:
        assert (tmp_path / "builtin" / name).read_bytes() == (tmp_path / "mbridge" / name).read_bytes(), name


def test_validate_accepts_use_mbridge_for_a_moe_model(tmp_path, write_job):
    from trinity.config.loader import load_config

    from tests.conftest import HF_CONFIGS

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    path = write_job({
        "model": {"path": str(HF_CONFIGS / "qwen3_30b_a3b")},
        "data": {"train_files": [str(data)], "seq_length": 512},
        "cluster": {"device": "cuda", "nproc_per_node": 8},
        "trainer": {"global_batch_size": 16, "micro_batch_size": 1},
        "actor_rollout_ref": {"actor": {"megatron": {"use_mbridge": True, "expert_model_parallel_size": 8}}},
    })
    loaded = load_config(path, check_paths=False)
    assert loaded.config.actor_rollout_ref.actor.megatron.use_mbridge
