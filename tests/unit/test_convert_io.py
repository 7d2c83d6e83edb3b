"""Safetensors reading/writing and atomic output folders: every failure names its file and tensor."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trinity.convert.hf_io import INDEX, HFCheckpoint, write_safetensors, write_shards
from trinity.convert import outdir
from trinity.convert.outdir import atomic_dir, check_output, stale_siblings
from trinity.errors import UserError


def _sharded(tmp_path):
    tensors = {"a.weight": torch.randn(4, 3), "b.weight": torch.randn(5), "c.bias": torch.randn(2, 2)}
    save_file({"a.weight": tensors["a.weight"]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] for k in ("b.weight", "c.bias")}, tmp_path / "model-00002-of-00002.safetensors")
    wm = {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors",
          "c.bias": "model-00002-of-00002.safetensors"}
    (tmp_path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return tensors


def test_reads_sharded_folder_tensor_by_tensor(tmp_path):
    tensors = _sharded(tmp_path)
    ck = HFCheckpoint(tmp_path)
    assert sorted(ck.names()) == sorted(tensors)
    assert ck.shape("a.weight") == (4, 3)
    for k, v in tensors.items():
        assert torch.equal(ck.get(k), v)
    ck.close()


def test_missing_shard_names_file(tmp_path):
    _sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(UserError, match=r"model-00002-of-00002\.safetensors: weight shard listed in the index does not exist"):
        HFCheckpoint(tmp_path)


def test_truncated_shard_names_file(tmp_path):
    _sharded(tmp_path)
    shard = tmp_path / "model-00001-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-7])
    with pytest.raises(UserError, match=r"model-00001-of-00002\.safetensors: corrupt or truncated"):
        HFCheckpoint(tmp_path)


def test_shard_truncated_after_validation_names_file_and_tensor(tmp_path):
    _sharded(tmp_path)
    ck = HFCheckpoint(tmp_path)  # headers are fine now; the file is cut while the conversion runs
    shard = tmp_path / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(UserError, match=re.escape(f"{shard}: shard ended early while reading tensor 'a.weight'")):
        ck.get("a.weight")


def test_garbage_shard_names_file(tmp_path):
    _sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(UserError, match=r"model-00002-of-00002\.safetensors: corrupt or truncated"):
        HFCheckpoint(tmp_path)


def test_index_entry_missing_from_shard_names_tensor_and_file(tmp_path):
    _sharded(tmp_path)
    idx = json.loads((tmp_path / INDEX).read_text())
    idx["weight_map"]["d.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / INDEX).write_text(json.dumps(idx))
    with pytest.raises(UserError, match=r"model-00001-of-00002\.safetensors: tensor 'd.weight' listed in the index is missing"):
        HFCheckpoint(tmp_path)


def test_no_weights_and_bad_index(tmp_path):
    with pytest.raises(UserError, match="no \\*.safetensors"):
        HFCheckpoint(tmp_path)
    (tmp_path / INDEX).write_text("{oops")
    with pytest.raises(UserError, match="model.safetensors.index.json: not a valid weight index"):
        HFCheckpoint(tmp_path)


def test_bin_shards_load_with_weights_only(tmp_path):
    t = {"x.weight": torch.randn(3, 2)}
    torch.save(t, tmp_path / "pytorch_model.bin")
    ck = HFCheckpoint(tmp_path)
    assert torch.equal(ck.get("x.weight"), t["x.weight"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_writer_output_reads_back_exactly(tmp_path, dtype):
    pairs = [("w", torch.randn(7, 3).to(dtype)), ("b", torch.randn(5).to(dtype)), ("s", torch.randn(()).to(dtype))]
    n = write_safetensors(tmp_path / "x.safetensors", pairs)
    assert n == (tmp_path / "x.safetensors").stat().st_size
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        for name, t in pairs:
            got = f.get_tensor(name)
            assert got.dtype == dtype and torch.equal(got, t)


def test_write_shards_splits_and_indexes(tmp_path):
    pairs = [(f"t{i}", torch.full((256,), float(i))) for i in range(5)]  # 1 KiB each
    written, wm = write_shards(iter(pairs), tmp_path, dtype=torch.bfloat16, max_shard_bytes=1100)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]  # 512 B each in bf16: 2 per shard
    ck = HFCheckpoint(tmp_path)
    assert torch.equal(ck.get("t4"), torch.full((256,), 4.0, dtype=torch.bfloat16))
    assert json.loads((tmp_path / INDEX).read_text())["metadata"]["total_size"] == written


def test_output_refused_unless_force_and_failure_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="output folder exists and is not empty"):
        check_output(out, force=False)
    with pytest.raises(RuntimeError):
        with atomic_dir(out, force=True) as tmp:
            (tmp / "half").write_text("partial")
            raise RuntimeError("boom")
    assert (out / "keep.txt").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with atomic_dir(out, force=True) as tmp:
        (tmp / "new").write_text("y")
    assert sorted(p.name for p in out.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temp_siblings_of_dead_processes_are_removed(tmp_path):
    host, dead = outdir._host(), _dead_pid()
    out = tmp_path / "out"
    stale = [tmp_path / f".out.tmp-{host}-{dead}-0123abcd", tmp_path / f".out.old-{host}-{dead}-89abcdef"]
    kept = [
        tmp_path / f".out.tmp-{host}-{os.getppid()}-0123abcd",  # a live process (pytest's parent)
        tmp_path / f".out.tmp-{host}_elsewhere-{dead}-0123abcd",  # another host (shared filesystem)
        tmp_path / f".out2.tmp-{host}-{dead}-0123abcd",  # another output's
        tmp_path / ".out.tmp-1a2b3c4d",  # not our pattern (older naming): left alone
        tmp_path / "keep",
    ]
    for p in stale + kept:
        p.mkdir()
        (p / "shard").write_text("partial")
    assert stale_siblings(out) == sorted(stale)
    check_output(out, force=False)  # the start of every conversion
    assert not any(p.exists() for p in stale)
    assert all((p / "shard").is_file() for p in kept)


def test_atomic_dir_names_its_temp_after_host_and_pid(tmp_path):
    out = tmp_path / "out"
    with atomic_dir(out, force=False) as tmp:
        assert re.fullmatch(rf"\.out\.tmp-{re.escape(outdir._host())}-{os.getpid()}-[0-9a-f]{{8}}", tmp.name)
        assert stale_siblings(out) == []  # ours, alive: never removed while in use
        (tmp / "x").write_text("y")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_rows_into_fills_the_callers_memory(tmp_path, dtype):
    w, b = torch.randn(9, 5).to(dtype), torch.randn(7).to(dtype)
    save_file({"w": w, "b": b}, tmp_path / "model.safetensors")
    ck = HFCheckpoint(tmp_path)
    assert ck.dtype("w") == dtype
    dest = torch.full((6, 5), 7.0, dtype=dtype)
    ck.read_rows_into("w", 2, 4, dest[1:5])  # a view into a bigger tensor: only its rows change
    assert torch.equal(dest[1:5], w[2:6]) and (dest[0] == 7).all() and (dest[5] == 7).all()
    bias = torch.empty(3, dtype=dtype)
    ck.read_rows_into("b", 4, 3, bias)
    assert torch.equal(bias, b[4:])
    with pytest.raises(ValueError, match="contiguous CPU"):
        ck.read_rows_into("w", 0, 1, torch.empty(5, dtype=torch.float16))
    with pytest.raises(ValueError, match="do not fit"):
        ck.read_rows_into("w", 8, 2, torch.empty(10, dtype=dtype))
    ck.close()


def test_read_rows_into_from_many_threads(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    w = torch.randn(64, 33)
    save_file({"w": w}, tmp_path / "model.safetensors")
    ck = HFCheckpoint(tmp_path)
    out = torch.empty_like(w)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda r: ck.read_rows_into("w", r, 1, out[r]), range(64)))
    assert torch.equal(out, w)


def test_read_rows_into_truncated_shard_names_file_and_tensor(tmp_path):
    _sharded(tmp_path)
    ck = HFCheckpoint(tmp_path)
    shard = tmp_path / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(UserError, match=re.escape(f"{shard}: shard ended early while reading tensor 'a.weight'")):
        ck.read_rows_into("a.weight", 2, 2, torch.empty(2, 3))


def test_read_rows_into_bin_shard(tmp_path):
    t = {"x.weight": torch.randn(5, 2).to(torch.bfloat16)}
    torch.save(t, tmp_path / "pytorch_model.bin")
    ck = HFCheckpoint(tmp_path)
    assert ck.dtype("x.weight") == torch.bfloat16
    out = torch.empty(3, 2, dtype=torch.bfloat16)
    ck.read_rows_into("x.weight", 1, 3, out)
    assert torch.equal(out, t["x.weight"][1:4])


def test_reads_and_writes_leave_parameter_storage_resizable(tmp_path):
    """Offload frees a parameter with `storage.resize_(0)`: reading into it or writing from it must not
    pin its storage (tensor.numpy() would, for good)."""
    src = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    write_safetensors(tmp_path / "x.safetensors", [("w", src)])
    param = torch.nn.Parameter(torch.zeros(6, 4))
    HFCheckpoint(tmp_path).read_rows_into("w", 0, 6, param.data)
    assert torch.equal(param.data, src)
    (tmp_path / "out").mkdir()
    write_safetensors(tmp_path / "out" / "y.safetensors", [("w", param.data)])  # a CPU parameter, in place
    assert torch.equal(HFCheckpoint(tmp_path / "out").get("w"), src)
    param.data.untyped_storage().resize_(0)
    assert param.data.untyped_storage().nbytes() == 0
