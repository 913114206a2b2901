"""The one install step ships the whole adapter: model.py imports its helper modules
(backend/exspec_*.py) by name from the backend folder Triton runs it in, so a helper left out of
the layout fails only at model load. The Docker image (and so the chart, which runs it) and the
launcher both lay out the folder through install(); the image from a copy of all of backend/."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from exspec.serving.install import PYTHON_BACKEND_FILES, STUB, TritonDist, install

REPO = Path(__file__).resolve().parents[1]
BACKEND = REPO / "backend"


def fake_dist(root: Path) -> TritonDist:
    """What install() reads from a tritonserver installation: its Python backend and a stub."""
    python_backend = root / "backends" / "python"
    python_backend.mkdir(parents=True)
    for name in (*PYTHON_BACKEND_FILES, STUB):
        (python_backend / name).write_text("")
    return TritonDist(root)


def local_imports(module: Path, folder: Path) -> set[str]:
    """Top-level module names `module` imports that are files of `folder`, or would be: any
    name spelled exspec_* is an adapter helper, shipped or not."""
    names = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if n.startswith("exspec_") or (folder / f"{n}.py").is_file()}


def test_install_ships_every_module_model_py_imports(tmp_path):
    target = install(tmp_path / "backends", fake_dist(tmp_path / "triton"), BACKEND) / "exspec"
    seen, todo = set(), ["model"]
    while todo:   # model.py's imports, and theirs
        name = todo.pop()
        module = target / f"{name}.py"
        assert module.is_file(), f"{name}.py is imported by the adapter but not installed in {target}"
        seen.add(name)
        todo += sorted(local_imports(module, target) - seen)
    assert len(seen) > 5, f"the import walk found only {sorted(seen)}: it is not following imports"
    shipped = {p.stem for p in target.glob("*.py")}
    assert shipped == {p.stem for p in BACKEND.glob("*.py")}, "install() left out or added a module"
    assert (target / "exspec" / "__init__.py").is_file(), "the engine package is not installed"


def test_the_image_installs_from_a_copy_of_the_whole_backend_folder():
    dockerfile = (REPO / "Dockerfile").read_text()
    workdir = re.findall(r"^WORKDIR (\S+)", dockerfile, re.M)[-1]
    assert re.search(r"^COPY backend/ backend/$", dockerfile, re.M), "the image copies only part of backend/"
    assert "exspec.serving.install" in dockerfile and f"--source {workdir}/backend" in dockerfile
    ignored = (REPO / ".dockerignore").read_text().split()
    assert not [p for p in ignored if "exspec_" in p or p in ("*.py", "backend")], ignored
