"""The Dockerfile without Docker. The image installs the engine with --no-deps after pinning its
dependencies by hand, so its pins must be exactly pyproject.toml's: a dependency added or bumped
in one place only would give an image that fails at model load (e.g. device_map without
accelerate). Its command restricts Triton's administrative APIs as the chart does."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_dockerfile_installs_every_runtime_dependency_at_the_pinned_version():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    # the runtime's, and the `real` extra's (the image converts the real pair once at build)
    wanted = dict(dep.split("==") for dep in pyproject["project"]["dependencies"]
                  + pyproject["project"]["optional-dependencies"]["real"])
    dockerfile = (REPO / "Dockerfile").read_text()
    installed = dict(re.findall(r"\b([A-Za-z0-9_.\-]+)==([0-9][^\s\\]*)", dockerfile))
    assert installed == wanted, (
        f"Dockerfile pins {installed} but pyproject.toml asks for {wanted}")
    assert "install --no-deps ." in dockerfile, "the engine must not pull its own dependencies"


def image_command() -> list[str]:
    (line,) = [line for line in (REPO / "Dockerfile").read_text().splitlines()
               if line.startswith("CMD ")]
    return json.loads(line[len("CMD "):])


def run_image_command(tmp_path, key: str | None) -> subprocess.CompletedProcess:
    """The image's CMD through the shell, as Docker runs it, with `tritonserver` on PATH
    replaced by a script that prints its arguments: what the shell hands Triton."""
    shim = tmp_path / "bin" / "tritonserver"
    shim.parent.mkdir()
    shim.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    shim.chmod(0o755)
    env = {"PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}"}
    if key is not None:
        env["EXSPEC_ADMIN_KEY"] = key
    return subprocess.run(image_command(), env=env, capture_output=True, text=True, timeout=30)


def test_the_image_command_restricts_what_the_chart_restricts(tmp_path):
    """Same flags, groups and header as the chart's pod (whose flags tests/deploy/test_admin_api.py
    runs against a real tritonserver), with the key from EXSPEC_ADMIN_KEY."""
    sys.path.insert(0, str(REPO / "tests" / "deploy"))
    from deploykit import one, render
    from pods import expand
    container = one(render(), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    chart = [expand(arg, {"EXSPEC_ADMIN_KEY": "k3y"}) for arg in container["args"]
             if "restricted" in arg]
    assert len(chart) == 2, container["args"]
    done = run_image_command(tmp_path, "k3y")
    assert done.returncode == 0, done.stderr
    args = done.stdout.splitlines()
    assert args[0] == "--model-repository=/models"
    assert [arg for arg in args if "restricted" in arg] == chart


@pytest.mark.parametrize("key", [None, ""])
def test_the_image_refuses_to_start_without_an_admin_key(tmp_path, key):
    done = run_image_command(tmp_path, key)
    assert done.returncode != 0 and done.stdout == "", "tritonserver ran without a key"
    assert "EXSPEC_ADMIN_KEY: no admin key" in done.stderr, done.stderr
