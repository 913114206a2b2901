"""The one install step: lay out a Triton backend directory that serves `backend: "exspec"`.

The Dockerfile, the launcher (`exspec-serve`) and CI all call this, so every one of them serves
from the same layout:

    <backends>/python/   libtriton_python.so, triton_python_backend_utils.py and the stub built
                         for the Python that will run the models (design: "Running Triton")
    <backends>/exspec/   model.py, the adapter's helper modules, and the engine package exspec/

Triton finds no libtriton_exspec.so in <backends>/exspec, sees model.py, and runs it through the
Python backend: a "Python-based backend", like Triton's vLLM backend. This module only copies
files; it never imports Triton.

    python -m exspec.serving.install --backends-dir /opt/tritonserver/backends
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

BACKEND_NAME = "exspec"
STUB = "triton_python_backend_stub"
PYTHON_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
# backend/ holds model.py and its helpers; the engine package sits inside it.
DEFAULT_SOURCE = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class TritonDist:
    """A tritonserver installation: an NGC image's /opt/tritonserver or nvidia-pytriton's copy."""

    root: Path

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def backends(self) -> Path:
        return self.root / "backends"

    @property
    def python_backend(self) -> Path:
        return self.backends / "python"

    @property
    def caches(self) -> Path:
        return self.root / "caches"

    @property
    def libs(self) -> Path | None:
        """Shared libraries the binary needs beside the system's (nvidia-pytriton vendors them)."""
        libs = self.root.parent.parent / "nvidia_pytriton.libs"
        return libs if libs.is_dir() else None

    def stub_for(self, version: str) -> Path | None:
        """The stub linked against libpython<version>; nvidia-pytriton ships one per version."""
        per_version = self.root / "python_backend_stubs" / version / STUB
        if per_version.is_file():
            return per_version
        own = self.python_backend / STUB   # NGC images: one stub, for the image's Python
        return own if own.is_file() else None


def find_tritonserver(explicit: str | os.PathLike | None = None) -> TritonDist:
    """$TRITONSERVER (binary or root) or `explicit`, then /opt/tritonserver, then nvidia-pytriton."""
    tried = []
    candidates = []
    for given in (explicit, os.environ.get("TRITONSERVER")):
        if given:
            path = Path(given).resolve()
            candidates.append(path.parent.parent if path.is_file() else path)
    candidates.append(Path("/opt/tritonserver"))
    try:
        import importlib.util
        spec = importlib.util.find_spec("pytriton")
        if spec and spec.origin:
            candidates.append(Path(spec.origin).parent / "tritonserver")
    except (ImportError, ValueError):
        pass
    for root in candidates:
        dist = TritonDist(root)
        tried.append(str(dist.binary))
        if dist.binary.is_file() and (dist.python_backend / PYTHON_BACKEND_FILES[0]).is_file():
            return dist
    raise FileNotFoundError(
        "no tritonserver found (tried: " + ", ".join(tried) + "). Set $TRITONSERVER, run inside an "
        "NGC tritonserver image, or `pip install -e '.[serve]'` for the nvidia-pytriton binary.")


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def install(backends_dir: str | os.PathLike, dist: TritonDist | None = None,
            source: str | os.PathLike = DEFAULT_SOURCE, version: str | None = None) -> Path:
    """Lay out <backends_dir>/python and <backends_dir>/exspec; return <backends_dir>.

    When backends_dir is the distribution's own backends folder (the Docker image), its Python
    backend is kept as shipped and only checked for a stub.
    """
    backends = Path(backends_dir).resolve()
    dist = dist or find_tritonserver()
    version = version or python_version()
    source = Path(source).resolve()
    if not (source / "model.py").is_file() or not (source / BACKEND_NAME / "__init__.py").is_file():
        raise FileNotFoundError(f"{source} holds no model.py and {BACKEND_NAME}/ package; pass "
                                "--source pointing at the repository's backend/ folder")

    stub = dist.stub_for(version)
    if stub is None:
        raise FileNotFoundError(f"{dist.root} has no {STUB} for Python {version}; run the "
                                "launcher with a Python the distribution has a stub for")
    python_dir = backends / "python"
    if python_dir.resolve() != dist.python_backend.resolve():
        python_dir.mkdir(parents=True, exist_ok=True)
        for name in PYTHON_BACKEND_FILES:
            shutil.copy2(dist.python_backend / name, python_dir / name)
        shutil.copy2(stub, python_dir / STUB)

    target = backends / BACKEND_NAME
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for module in sorted(source.glob("*.py")):       # model.py and the adapter's helpers
        shutil.copy2(module, target / module.name)
    shutil.copytree(source / BACKEND_NAME, target / BACKEND_NAME,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return backends


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exspec.serving.install", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends-dir", required=True,
                        help="folder to lay out (Triton's --backend-directory)")
    parser.add_argument("--tritonserver", default=None,
                        help="tritonserver binary or root (default: $TRITONSERVER, "
                             "/opt/tritonserver, nvidia-pytriton)")
    parser.add_argument("--source", default=str(DEFAULT_SOURCE),
                        help="the repository's backend/ folder (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        out = install(args.backends_dir, find_tritonserver(args.tritonserver), args.source)
    except FileNotFoundError as exc:
        print(f"install_backend: {exc}", file=sys.stderr)
        return 1
    print(f"installed the {BACKEND_NAME} backend into {out / BACKEND_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
