"""The Dockerfile installs the built wheel, not an editable checkout, so a subpackage missing
from pyproject.toml's explicit package list would only show in the image (an editable install
finds every file in the tree). Build the wheel and compare it with the tree."""
from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENGINE = REPO / "backend" / "exspec"


def test_the_wheel_holds_every_module_of_the_engine_package(tmp_path):
    # Built from a copy: setuptools reuses an in-tree build/ folder, whose stale files would
    # hide a package missing from the list.
    source = tmp_path / "src"
    for name in ("pyproject.toml", "README.md"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(ENGINE, source / "backend" / "exspec",
                    ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(source)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("exspec-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = configparser.ConfigParser()
        scripts.read_string(archive.read(entry_points).decode())
    tree = {"exspec/" + p.relative_to(ENGINE).as_posix() for p in ENGINE.rglob("*.py")
            if "__pycache__" not in p.parts}
    assert tree - names == set(), f"modules missing from the wheel: {sorted(tree - names)}"
    assert {"exspec/bench/cli.py", "exspec/serving/launcher.py", "exspec/demo/tiny.py"} <= names
    for name, target in scripts["console_scripts"].items():
        module = target.split(":")[0].replace(".", "/") + ".py"
        assert module in names, f"console script {name} points at {target}, not in the wheel"
    assert set(scripts["console_scripts"]) == {"exspec-serve", "exspec-openai", "exspec-bench"}
