"""The image installs the engine with --no-deps after pinning its dependencies by hand, so the
Dockerfile's pins must be exactly pyproject.toml's: a dependency added or bumped in one place
only would give an image that fails at model load (e.g. device_map without accelerate)."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_dockerfile_installs_every_runtime_dependency_at_the_pinned_version():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    wanted = dict(dep.split("==") for dep in pyproject["project"]["dependencies"])
    dockerfile = (REPO / "Dockerfile").read_text()
    installed = dict(re.findall(r"\b([A-Za-z0-9_.\-]+)==([0-9][^\s\\]*)", dockerfile))
    assert installed == wanted, (
        f"Dockerfile pins {installed} but pyproject.toml asks for {wanted}")
    assert "install --no-deps ." in dockerfile, "the engine must not pull its own dependencies"
