"""No code from user files, anywhere: a pickle planted in any file trinity reads (a dist checkpoint's
`.metadata`, `common.pt` and byte items, a training checkpoint's RNG state, an HF folder's
`pytorch_model.bin`) is refused in one line naming the file, and its payload never runs; a model folder
that asks transformers to run its own code (`auto_map`) is refused in one line by run, convert,
validate and generate. Real checkpoints written by megatron-core still load."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from trinity.cli.main import app
from trinity.convert.api import hf_to_mcore, mcore_to_hf
from trinity.convert.dist_ckpt import check_readable, load_model_checkpoint
from trinity.convert.safe_pickle import load_dcp_index
from trinity.errors import UserError

pytestmark = pytest.mark.timeout(180)

AUTO_MAP_FIX = ("has auto_map (custom code); trinity never runs code from a model folder: "
                "use a model whose architecture transformers ships")
REFUSED = "refused to load: it holds Python objects other than"


class Payload:
    """Unpickling this creates `marker` (through `how`): a file that was unpickled leaves it behind."""

    def __init__(self, marker: Path, how: str):
        self.marker, self.how = marker, how

    def __reduce__(self):
        if self.how == "os.system":
            return (os.system, (f"touch {self.marker}",))
        if self.how == "builtins.exec":
            return (exec, (f"open({str(self.marker)!r}, 'w').close()",))
        return (Path.touch, (self.marker,))


# How the payload runs -> the global its pickle names, in a plain pickle (protocol 4) and in a torch.save
# (protocol 2: a method is getattr(class, name)); os.system is posix.system on Linux.
PICKLED_AS = {"os.system": os.system.__module__ + ".system", "builtins.exec": "builtins.exec",
              "pathlib.Path.touch": "pathlib.Path.touch"}
TORCH_PICKLED_AS = {**PICKLED_AS, "builtins.exec": "exec", "pathlib.Path.touch": "getattr"}
HOWS = list(PICKLED_AS)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """(HF folder with a tokenizer, its dist checkpoint) of a 2-layer Qwen2."""
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer

    root = tmp_path_factory.mktemp("nocode")
    tok = make_tiny_tokenizer(root / "tok")
    hf = make_tiny_qwen2(root / "hf", tok, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    hf_to_mcore(str(hf), str(root / "mcore"), dtype="fp32", device="cpu")
    return hf, root / "mcore"


def _copy(src: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    out = tmp_path / name
    shutil.copytree(src, out)
    return out


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and "Traceback" not in text
    assert exc.value.__cause__ is None and (exc.value.__context__ is None or exc.value.__suppress_context__)
    return text


def _refused(where: Path | str, what: str, global_name: str) -> str:
    return (f"{where}: {REFUSED} {what} ({global_name}); it was not written by trinity or megatron-core, "
            "and trinity never runs code from a file")


def _build(hf: Path) -> list[torch.nn.Module]:
    from trinity.config.megatron import MegatronConfig
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts

    return build_model(ModelFacts.from_hf_dir(hf), MegatronConfig(), device="cpu", dtype=torch.float32)


@pytest.fixture
def cpu_world():
    from trinity.compat import cpu_compat
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel

    was_enabled = cpu_compat.is_enabled()
    init_parallel(device="cpu", layout=ParallelLayout(), seed=3)
    try:
        yield
    finally:
        destroy()
        if not was_enabled:
            cpu_compat.disable()


# --- .metadata: the restricted unpickler ---------------------------------------------------------------


def _plant_in_index(ckpt: Path, payload: object) -> None:
    """The checkpoint's real index with `payload` hidden inside it (the index is this test's own
    file, so the plain pickle reads it)."""
    with open(ckpt / ".metadata", "rb") as f:
        index = pickle.load(f)
    index.planner_data = {"innocent": payload}
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(index, f)


@pytest.mark.parametrize("how", HOWS)
def test_a_payload_in_metadata_is_refused_and_never_runs(tiny, tmp_path, how):
    ckpt, marker = _copy(tiny[1], tmp_path), tmp_path / "ran"
    _plant_in_index(ckpt, Payload(marker, how))
    with pytest.raises(UserError) as exc:
        check_readable(ckpt)
    assert _one_line(exc) == _refused(ckpt / ".metadata", "a dist checkpoint index", PICKLED_AS[how])
    with pytest.raises(UserError, match=r"\.metadata: refused to load"):
        mcore_to_hf(str(ckpt), str(tmp_path / "out"), device="cpu")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_convert_and_generate_print_one_line_for_a_planted_metadata(tiny, tmp_path):
    ckpt, marker = _copy(tiny[1], tmp_path), tmp_path / "ran"
    _plant_in_index(ckpt, Payload(marker, "os.system"))
    want = f"error: {ckpt / '.metadata'}: {REFUSED} a dist checkpoint index ({PICKLED_AS['os.system']});"
    for args in (["convert", "mcore-to-hf", "--mcore-path", str(ckpt), "--output", str(tmp_path / "o")],
                 ["generate", "--model", str(ckpt), "--prompt", "hi", "--device", "cpu", "--max-new-tokens", "1"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        errors = [line for line in result.output.splitlines() if line.startswith("error")]
        assert len(errors) == 1 and errors[0].startswith(want), result.output
        assert "Traceback" not in result.output
    assert not marker.exists()


def test_resume_refuses_a_planted_metadata_naming_the_file(tiny, tmp_path):
    from trinity.trainer.checkpoint import CheckpointManager

    root = tmp_path / "checkpoints"
    step = root / "step_4"
    step.mkdir(parents=True)
    shutil.copytree(tiny[1], step / "actor")
    (step / "complete").write_text("")
    _plant_in_index(step / "actor", Payload(tmp_path / "ran", "builtins.exec"))
    manager = CheckpointManager(root, keep_last=3, is_rank0=True, engines={}, data=None)
    with pytest.raises(UserError) as exc:
        manager._check_readable(step, step / "actor")
    assert _one_line(exc).startswith(f"trainer.resume: {step / 'actor' / '.metadata'}: {REFUSED}")
    assert exc.value.args[0].endswith("no older complete checkpoint is left: use trainer.resume=disable to start over")
    assert not (tmp_path / "ran").exists()


def test_a_real_index_loads_as_the_plain_pickle_reads_it(tiny, tmp_path):
    """The allow-list is not too narrow: megatron-core's own index loads, equal to what pickle reads."""
    with open(tiny[1] / ".metadata", "rb") as f:
        plain = pickle.load(f)
    ours = load_dcp_index(tiny[1] / ".metadata")
    assert ours.state_dict_metadata == plain.state_dict_metadata
    assert ours.storage_data == plain.storage_data and len(ours.storage_data) > 10
    # Any dtype a checkpoint may hold (bf16 weights, int64 steps) is a torch dtype and admitted.
    for meta in plain.state_dict_metadata.values():
        if hasattr(meta, "properties"):
            meta.properties.dtype = torch.bfloat16
    (tmp_path / "bf16").write_bytes(pickle.dumps(plain))
    bf16 = load_dcp_index(tmp_path / "bf16")
    assert {m.properties.dtype for m in bf16.state_dict_metadata.values() if hasattr(m, "properties")} == {torch.bfloat16}


@pytest.mark.parametrize("rel", ["../outside.distcp", "/etc/hostname", "sub/__0_1.distcp"])
def test_an_index_naming_a_data_file_outside_the_folder_is_refused(tiny, tmp_path, rel):
    import dataclasses

    ckpt = _copy(tiny[1], tmp_path)
    with open(ckpt / ".metadata", "rb") as f:
        index = pickle.load(f)
    key = next(iter(index.storage_data))
    index.storage_data[key] = dataclasses.replace(index.storage_data[key], relative_path=rel)
    (ckpt / ".metadata").write_bytes(pickle.dumps(index))
    with pytest.raises(UserError) as exc:
        check_readable(ckpt)
    assert _one_line(exc) == (f"{ckpt}: the dist checkpoint index (.metadata) names data file {rel!r} outside the "
                              "checkpoint folder; it was not written by megatron-core")


def test_an_index_of_another_type_is_refused(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"storage_data": {}}))
    with pytest.raises(UserError, match=r"\.metadata: not a dist checkpoint index \(it holds a dict\)"):
        load_dcp_index(tmp_path / ".metadata")


# --- common.pt, byte items in .distcp files, the optimizer's common state ------------------------------


@pytest.mark.parametrize("key", ["extra", "optimizer"])
def test_a_payload_in_common_pt_is_refused_and_never_runs(tiny, tmp_path, cpu_world, key):
    """`extra` is what resume reads (step, data position); `optimizer` is where megatron-core keeps the
    optimizer's non-sharded state (param groups): both are in common.pt, read weights-only."""
    from trinity.convert.dist_ckpt import read_extra

    ckpt, marker = _copy(tiny[1], tmp_path), tmp_path / "ran"
    common = torch.load(ckpt / "common.pt", weights_only=True)
    torch.save({**common, key: {"param_groups": [Payload(marker, "pathlib.Path.touch")]}}, ckpt / "common.pt")
    check_readable(ckpt)  # a complete, well-formed archive: only loading it finds the payload
    want = _refused(ckpt / "common.pt", "tensors and plain values", TORCH_PICKLED_AS["pathlib.Path.touch"])
    with pytest.raises(UserError) as exc:
        read_extra(ckpt)
    assert _one_line(exc) == want
    with pytest.raises(UserError) as exc:
        load_model_checkpoint(_build(tiny[0]), ckpt)
    assert _one_line(exc) == want
    assert not marker.exists()


def _plant_byte_item(ckpt: Path, payload: object) -> str:
    """Replace one byte item (a ShardedObject megatron-core torch.save'd into a `.distcp`) by a
    torch.save of `payload`, appended to its file; returns that file's name."""
    import dataclasses
    import io

    with open(ckpt / ".metadata", "rb") as f:
        index = pickle.load(f)
    key = next(k for k, v in index.storage_data.items() if k.fqn.endswith("_extra_state/shard_0_2"))
    info = index.storage_data[key]
    blob = io.BytesIO()
    torch.save(payload, blob)
    target = ckpt / info.relative_path
    offset = target.stat().st_size
    with open(target, "ab") as f:
        f.write(blob.getvalue())
    index.storage_data[key] = dataclasses.replace(info, offset=offset, length=len(blob.getvalue()))
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(index, f)
    return info.relative_path


def test_a_payload_in_a_byte_item_of_a_data_file_is_refused(tiny, tmp_path, cpu_world):
    """torch's own load planner unpickles byte items with weights_only=False; trinity's does not."""
    ckpt, marker = _copy(tiny[1], tmp_path), tmp_path / "ran"
    name = _plant_byte_item(ckpt, {"state": Payload(marker, "os.system")})
    check_readable(ckpt)
    with pytest.raises(UserError) as exc:
        load_model_checkpoint(_build(tiny[0]), ckpt)
    text = _one_line(exc)
    assert text.startswith(f"{ckpt / name} (item decoder.layers.")
    assert text.endswith(_refused("", "tensors and plain values", TORCH_PICKLED_AS["os.system"]))
    assert not marker.exists()


def test_a_real_checkpoint_loads_into_the_model(tiny, cpu_world):
    """Through trinity's reader, planner and common strategy: the weights are the HF model's."""
    from trinity.convert.builtin import load_hf_weights
    from trinity.models.facts import ModelFacts

    want, got = _build(tiny[0]), _build(tiny[0])
    load_hf_weights(want, tiny[0], ModelFacts.from_hf_dir(tiny[0]))
    for p in got[0].parameters():
        torch.nn.init.constant_(p, 7.0)
    assert load_model_checkpoint(got, tiny[1]) == {}
    mine = dict(got[0].named_parameters())
    for name, p in want[0].named_parameters():
        assert torch.equal(mine[name], p), name


def test_a_critic_backbone_loads_through_the_same_readers(tiny, tmp_path, cpu_world):
    """A critic started from an LM dist checkpoint (`load_backbone_from_dist_checkpoint`): a real
    checkpoint gives every tensor but the value head; a planted common.pt is refused there too."""
    from trinity.config.megatron import MegatronConfig
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts
    from trinity.convert.load import load_backbone_from_dist_checkpoint

    facts = ModelFacts.from_hf_dir(tiny[0])
    critic = build_model(facts, MegatronConfig(), device="cpu", dtype=torch.float32, value_head=True)
    load_backbone_from_dist_checkpoint(critic, str(tiny[1]))
    lm = _build(tiny[0])
    load_model_checkpoint(lm, tiny[1])
    want = dict(lm[0].named_parameters())
    for name, p in critic[0].named_parameters():
        if name != "output_layer.weight":
            assert torch.equal(p, want[name]), name
    ckpt, marker = _copy(tiny[1], tmp_path), tmp_path / "ran"
    torch.save({"extra": Payload(marker, "os.system")}, ckpt / "common.pt")
    with pytest.raises(UserError) as exc:
        load_backbone_from_dist_checkpoint(critic, str(ckpt))
    assert _one_line(exc) == _refused(ckpt / "common.pt", "tensors and plain values", TORCH_PICKLED_AS["os.system"])
    assert not marker.exists()


# --- the RNG state of a training checkpoint -------------------------------------------------------------


def test_a_payload_in_the_rng_file_is_refused_and_never_runs(tmp_path, cpu_world):
    from trinity.trainer.checkpoint import load_rng, save_rng

    path, marker = tmp_path / "rank_0.pt", tmp_path / "ran"
    save_rng(path)
    good = torch.load(path, weights_only=True)
    load_rng(path)  # the file trinity writes loads
    torch.save({**good, "python": Payload(marker, "builtins.exec")}, path)
    with pytest.raises(UserError) as exc:
        load_rng(path)
    assert _one_line(exc) == _refused(path, "tensors and plain values", TORCH_PICKLED_AS["builtins.exec"])
    assert not marker.exists()


# --- pytorch_model.bin in an HF folder ------------------------------------------------------------------


def test_a_payload_in_pytorch_model_bin_is_refused_and_never_runs(tiny, tmp_path):
    from safetensors.torch import load_file

    from trinity.convert.hf_io import HFCheckpoint

    hf, marker = _copy(tiny[0], tmp_path, "hf"), tmp_path / "ran"
    weights = load_file(str(hf / "model.safetensors"))
    (hf / "model.safetensors").unlink()
    torch.save(weights, hf / "pytorch_model.bin")
    assert HFCheckpoint(hf).names()  # a clean .bin folder loads
    torch.save({**weights, "lm_head.bias": Payload(marker, "os.system")}, hf / "pytorch_model.bin")
    with pytest.raises(UserError) as exc:
        HFCheckpoint(hf)
    assert _one_line(exc) == _refused(hf / "pytorch_model.bin", "tensors and plain values", TORCH_PICKLED_AS["os.system"])
    with pytest.raises(UserError, match=r"pytorch_model\.bin: refused to load"):
        hf_to_mcore(str(hf), str(tmp_path / "out"), dtype="fp32", device="cpu")
    assert not marker.exists()


# --- auto_map: a model folder with its own code ---------------------------------------------------------


def _with_custom_code(hf: Path, tmp_path: Path, file: str, marker: Path) -> Path:
    """A copy of `hf` whose `file` points transformers at a Python file of the folder that would
    create `marker` when imported."""
    import json

    out = _copy(hf, tmp_path, "custom")
    (out / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    cfg = json.loads((out / file).read_text())
    cls = "AutoTokenizer" if file == "tokenizer_config.json" else "AutoConfig"
    cfg["auto_map"] = {cls: ["modeling_evil.Evil", None] if cls == "AutoTokenizer" else "modeling_evil.Evil"}
    (out / file).write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("file", ["config.json", "tokenizer_config.json"])
def test_a_folder_with_auto_map_is_refused_by_every_reader(tiny, tmp_path, file):
    from trinity.data.loader import load_tokenizer
    from trinity.models.facts import ModelFacts

    marker = tmp_path / "ran"
    hf = _with_custom_code(tiny[0], tmp_path, file, marker)
    want = f"{hf / file} {AUTO_MAP_FIX}"
    for read in (ModelFacts.from_hf_dir, load_tokenizer):
        with pytest.raises(UserError) as exc:
            read(hf)
        assert str(exc.value) == want
    with pytest.raises(UserError) as exc:
        hf_to_mcore(str(hf), str(tmp_path / "out"), dtype="fp32", device="cpu")
    assert str(exc.value) == want and not (tmp_path / "out").exists()
    result = CliRunner().invoke(app, ["generate", "--model", str(hf), "--prompt", "hi", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert [line for line in result.output.splitlines() if line.startswith("error")] == [f"error: {want}"]
    assert not marker.exists()


def test_validate_refuses_auto_map_in_the_model_and_the_tokenizer_folder(tiny, tmp_path, small_job, write_job):
    from trinity.cli import commands
    from trinity.errors import ConfigError

    marker = tmp_path / "ran"
    hf = _with_custom_code(tiny[0], tmp_path, "config.json", marker)
    small_job["model"]["path"] = str(hf)
    with pytest.raises(ConfigError) as exc:
        commands.validate(write_job(small_job), [])
    assert f"model.path: {hf / 'config.json'} {AUTO_MAP_FIX}" in exc.value.problems
    tok = _with_custom_code(tiny[0], tmp_path / "t", "tokenizer_config.json", marker)
    small_job["model"] = {"path": str(tiny[0]), "tokenizer_path": str(tok)}
    with pytest.raises(ConfigError) as exc:
        commands.validate(write_job(small_job), [])
    assert f"model.tokenizer_path: {tok / 'tokenizer_config.json'} {AUTO_MAP_FIX}" in exc.value.problems
    assert not marker.exists()


def test_transformers_never_prompts_for_a_folder_trinity_loads(tiny, tmp_path):
    """Below trinity's own check: every from_pretrained call in trinity passes trust_remote_code=False,
    with which transformers refuses a folder whose architecture only its own code defines, instead of
    asking "[y/N]" on a terminal (a "y" answered here runs nothing)."""
    import json

    marker = tmp_path / "ran"
    hf = _with_custom_code(tiny[0], tmp_path, "config.json", marker)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "model_type": "evil"}))
    code = f"from transformers import AutoConfig\nAutoConfig.from_pretrained({str(hf)!r}, trust_remote_code=False)\n"
    done = subprocess.run([sys.executable, "-c", code], input="y\n", capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "trust_remote_code=True" in done.stderr, done.stderr[-2000:]
    assert not marker.exists()
    sources = Path(__file__).resolve().parents[2].joinpath("trinity").rglob("*.py")
    calls = [line.strip() for p in sources for line in p.read_text().splitlines()
             if ".from_pretrained(" in line and "`" not in line and not line.lstrip().startswith("#")]
    assert len(calls) >= 6 and all("trust_remote_code=False" in line for line in calls), calls
