"""Checkpoint and conversion inputs that must fail with one line naming the file, never damage data:
corrupt or truncated dist checkpoints, an output folder overlapping the source, index entries that
point outside the model folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trinity.convert.api import hf_to_mcore, mcore_to_hf
from trinity.convert.dist_ckpt import check_readable
from trinity.convert.hf_io import INDEX, HFCheckpoint
from trinity.convert.outdir import check_output
from trinity.errors import UserError
from trinity.testing.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF folder, dist checkpoint folder) of a tiny Qwen2."""
    root = tmp_path_factory.mktemp("trust")
    hf = make_tiny_hf_model("qwen2", root / "hf")
    hf_to_mcore(str(hf), str(root / "mcore"), dtype="fp32", device="cpu")
    return hf, root / "mcore"


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(ckpt, out)
    return out


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


# --- corrupt or truncated dist checkpoints (#19 item 7) -----------------------------------------------


def test_a_complete_checkpoint_passes_the_check(tiny):
    check_readable(tiny[1])


@pytest.mark.parametrize(
    "name,cut,message",
    [
        (".metadata", 0.5, r"corrupt or truncated dist checkpoint file \.metadata \(UnpicklingError"),
        (".metadata", 0.0, r"corrupt or truncated dist checkpoint file \.metadata \(EOFError"),
        ("__0_1.distcp", 0.5, r"dist checkpoint file __0_1\.distcp is truncated \(\d+ bytes, its items need \d+\)"),
        ("common.pt", 0.5, r"corrupt or truncated dist checkpoint file common\.pt"),
        ("metadata.json", 0.5, r"corrupt or truncated dist checkpoint file metadata\.json"),
    ],
)
def test_truncated_files_are_named_by_the_check_and_by_mcore_to_hf(tiny, tmp_path, name, cut, message):
    ckpt = _copy(tiny[1], tmp_path)
    data = (ckpt / name).read_bytes()
    (ckpt / name).write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(UserError, match=message) as exc:
        check_readable(ckpt)
    assert _one_line(exc).startswith(f"{ckpt}: ")
    with pytest.raises(UserError, match=message):
        mcore_to_hf(str(ckpt), str(tmp_path / "out"), device="cpu")
    assert not (tmp_path / "out").exists()


def test_missing_data_file_is_named(tiny, tmp_path):
    ckpt = _copy(tiny[1], tmp_path)
    (ckpt / "__0_2.distcp").unlink()
    with pytest.raises(UserError, match=r"ckpt: dist checkpoint file __0_2\.distcp is missing"):
        check_readable(ckpt)


def test_not_a_dist_checkpoint(tmp_path):
    with pytest.raises(UserError, match=r"nope: dist checkpoint folder does not exist"):
        check_readable(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"empty: not a complete megatron-core dist checkpoint \(no metadata.json in it\)"):
        check_readable(tmp_path / "empty")


def test_garbled_bytes_inside_a_data_file_are_named_when_loading(tiny, tmp_path):
    ckpt = _copy(tiny[1], tmp_path)
    f = ckpt / "__0_1.distcp"
    data = f.read_bytes()
    f.write_bytes(data[:100] + bytes(200) + data[300:])  # same size: the cheap check cannot see it
    check_readable(ckpt)
    with pytest.raises(UserError, match=r"ckpt: corrupt or truncated dist checkpoint file __0_1\.distcp") as exc:
        mcore_to_hf(str(ckpt), str(tmp_path / "out"), device="cpu")
    assert "Traceback" not in _one_line(exc)
    assert exc.value.__cause__ is None and exc.value.__context__ is None  # no chained traceback either


def test_cli_prints_one_error_line_and_exits_2(tiny, tmp_path):
    from trinity.cli.main import app

    ckpt = _copy(tiny[1], tmp_path)
    (ckpt / ".metadata").write_bytes(b"")
    result = CliRunner().invoke(app, ["convert", "mcore-to-hf", "--mcore-path", str(ckpt), "--output", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {ckpt}: corrupt or truncated dist checkpoint file .metadata (EOFError: Ran out of input)"]
    assert "Traceback" not in result.output


# --- --output overlapping the source (#19 item 11) ----------------------------------------------------


def test_force_into_the_source_is_refused_and_the_source_survives(tiny, tmp_path):
    hf = make_tiny_hf_model("qwen2", tmp_path / "m" / "hf")
    (hf / "sub").mkdir()
    (hf / "sub" / "notes.txt").write_text("part of the model folder")
    before = sorted(p.name for p in hf.iterdir())
    cases = [(hf, "is the source folder"), (tmp_path / "m", "contains the source folder"),
             (hf / "sub", "is inside the source folder")]
    for out, how in cases:
        with pytest.raises(UserError, match=rf"{out}: the output {how} {hf}; choose an output folder outside the source"):
            hf_to_mcore(str(hf), str(out), force=True, device="cpu")
        assert sorted(p.name for p in hf.iterdir()) == before
    assert (hf / "sub" / "notes.txt").is_file()
    ckpt = _copy(tiny[1], tmp_path)
    for out in (ckpt, ckpt.parent, ckpt / "hf"):
        with pytest.raises(UserError, match=rf"the output .* {ckpt}; choose an output folder outside the source"):
            mcore_to_hf(str(ckpt), str(out), force=True, device="cpu")
        assert (ckpt / ".metadata").is_file() and (ckpt / "hf" / "config.json").is_file()


def test_a_new_folder_inside_the_source_deletes_nothing_and_is_allowed(tmp_path):
    """`trinity run` converts into <output_dir>/mcore_cache/<new folder>, and output_dir may lie inside
    the model folder: only an existing folder inside the source would be replaced."""
    (tmp_path / "src").mkdir()
    new = tmp_path / "src" / "run" / "mcore_cache" / "x"
    assert check_output(new, True, sources=[tmp_path / "src"]) == new.resolve()
    new.mkdir(parents=True)
    with pytest.raises(UserError, match="is inside the source folder"):
        check_output(new, True, sources=[tmp_path / "src"])


def test_overlap_sees_through_symlinks(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "w").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "src")
    with pytest.raises(UserError, match="is the source folder"):
        check_output(tmp_path / "link", True, sources=[tmp_path / "src"])
    assert check_output(tmp_path / "other", True, sources=[tmp_path / "src"]) == (tmp_path / "other").resolve()


# --- index entries outside the model folder (#19 item 12) ---------------------------------------------


@pytest.mark.parametrize("entry", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors", "C:\\x.safetensors"])
def test_index_entries_may_not_leave_the_model_folder(tmp_path, entry):
    hf = make_tiny_hf_model("qwen2", tmp_path / "hf")
    (tmp_path / "outside.safetensors").write_bytes((hf / "model.safetensors").read_bytes())
    names = list(HFCheckpoint(hf).names())
    wm = {n: "model.safetensors" for n in names}
    wm[names[0]] = entry
    (hf / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    with pytest.raises(UserError) as exc:
        HFCheckpoint(hf)
    assert _one_line(exc) == (
        f"{hf / INDEX}: weight_map entry {names[0]!r} -> {entry!r} points outside the model folder; "
        "shard names must be file names inside it"
    )


def test_symlinked_shards_inside_the_folder_still_load(tmp_path):
    """The HF hub cache links snapshot files to ../../blobs: the name is checked, not the link target."""
    hf = make_tiny_hf_model("qwen2", tmp_path / "hf")
    (tmp_path / "blob").write_bytes((hf / "model.safetensors").read_bytes())
    (hf / "model.safetensors").unlink()
    (hf / "model.safetensors").symlink_to(tmp_path / "blob")
    assert HFCheckpoint(hf).names()


def test_read_extra_names_a_damaged_common_pt(tiny, tmp_path):
    from trinity.convert.dist_ckpt import read_extra

    ckpt = _copy(tiny[1], tmp_path)
    assert isinstance(read_extra(ckpt), dict)
    data = (ckpt / "common.pt").read_bytes()
    (ckpt / "common.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"ckpt: corrupt or truncated dist checkpoint file common\.pt"):
        read_extra(ckpt)
