"""Print the project's runtime requirements that the Docker image installs with pip's resolver.

The image takes torch, Transformer Engine, flash-attn and apex from NVIDIA's base image and installs
megatron-core and mbridge with `--no-deps` (their torch requirement would otherwise let pip replace
NVIDIA's build). Everything else in `[project].dependencies` is small and pure Python: reading it here
from pyproject.toml keeps the image from drifting away from the package's own dependency list.

Usage: python runtime_requirements.py path/to/pyproject.toml > requirements.txt
Standard library only: it runs in the bare base image before anything is installed.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

# Provided by the base image (torch) or installed without dependencies by the Dockerfile.
HANDLED_BY_IMAGE = frozenset({"torch", "megatron-core", "mbridge"})

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def requirement_name(requirement: str) -> str:
    """The PEP 503 normalised project name of a PEP 508 requirement string."""
    match = _NAME.match(requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def runtime_requirements(pyproject: Path) -> list[str]:
    """`[project].dependencies` of `pyproject` without the packages the image handles itself."""
    with pyproject.open("rb") as f:
        dependencies: list[str] = tomllib.load(f)["project"]["dependencies"]
    return [dep for dep in dependencies if requirement_name(dep) not in HANDLED_BY_IMAGE]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} PYPROJECT_TOML", file=sys.stderr)
        return 2
    for requirement in runtime_requirements(Path(argv[1])):
        print(requirement)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
