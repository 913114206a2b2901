"""exspec-openai: Triton's OpenAI-compatible frontend serving the exspec backend.

    exspec-openai --model-repository DIR [--frontend DIR] [--openai-port 9000]
                  [--tokenizer PATH] [--python PATH] [-- more frontend arguments]

The frontend is Triton's own (triton-inference-server/server, python/openai; NGC images ship it
as /opt/tritonserver/python/openai): a FastAPI app around an in-process tritonserver, which
serves exspec with `--backend vllm` because exspec speaks the vLLM backend's tensors. This
module only prepares its run and then replaces itself with it (exec):

- the backend folder: the distribution's own when exspec is installed there (the image), else
  the one install step lays it out in --work-dir, as exspec-serve does;
- the stub's environment (stub_environment): the Python that runs the models is this one;
- the tokenizer for chat templates: the one the model's model.json names, unless given.

The frontend has no --backend-directory flag (its in-process server defaults to
/opt/tritonserver/backends), so a three-line bootstrap hands our folder to tritonserver.Server
before the frontend's main.py runs. Outside an image the frontend's Python needs its
requirements and Triton's in-process bindings (docs/serving.md, "Triton's OpenAI frontend").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from ..config import resolve_model_paths
from .install import BACKEND_NAME, find_tritonserver, install
from .launcher import split_passthrough, stub_environment

DEFAULT_FRONTEND = "/opt/tritonserver/python/openai/openai_frontend"

# Runs in the frontend's Python: every tritonserver.Server the frontend creates gets our backend
# folder unless told otherwise, then the frontend's own main.py runs as a script.
BOOTSTRAP = """\
import runpy, sys, tritonserver
frontend, backends = sys.argv[1], sys.argv[2]
class Server(tritonserver.Server):
    def __init__(self, options=None, **kwargs):
        kwargs.setdefault("backend_directory", backends)
        super().__init__(options, **kwargs)
tritonserver.Server = Server
sys.path.insert(0, frontend)
sys.argv = [frontend + "/main.py"] + sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def model_tokenizer(model_repository: Path, model: str) -> str | None:
    """The tokenizer (else the target) that model.json names, resolved as the Triton model
    resolves it (exspec.config.resolve_model_paths)."""
    path = model_repository / model / "1" / "model.json"
    if not path.is_file():
        return None
    config = resolve_model_paths(json.loads(path.read_text()), path.parent)
    return config.get("tokenizer") or config.get("target_model") or None


def frontend_command(args, extra: list[str], backends: Path) -> list[str]:
    main = Path(args.frontend) / "main.py"
    if not main.is_file():
        raise FileNotFoundError(f"{main} not found: pass --frontend (or $TRITON_OPENAI_FRONTEND)"
                                " pointing at the server repository's python/openai/openai_frontend")
    cmd = [args.python, "-c", BOOTSTRAP, str(Path(args.frontend).resolve()), str(backends),
           "--model-repository", str(Path(args.model_repository).resolve()),
           "--backend", "vllm", "--openai-port", str(args.openai_port), "--host", args.host]
    tokenizer = args.tokenizer or model_tokenizer(Path(args.model_repository), args.model)
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    return cmd + extra


def backend_folder(work_dir: str | None, backend_source: str | None) -> Path:
    """The distribution's backends when exspec is installed there (the image), else a fresh
    layout in work_dir (a temporary folder that lives as long as the frontend)."""
    dist = find_tritonserver()
    if (dist.backends / BACKEND_NAME / "model.py").is_file() and not backend_source:
        return dist.backends
    work = Path(work_dir or tempfile.mkdtemp(prefix="exspec-openai-"))
    return install(work / "backends", dist,
                   **({"source": backend_source} if backend_source else {}))


def parse_args(argv: list[str] | None):
    argv, extra = split_passthrough(argv)
    parser = argparse.ArgumentParser(prog="exspec-openai", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-repository", required=True)
    parser.add_argument("--frontend", default=os.environ.get("TRITON_OPENAI_FRONTEND",
                                                             DEFAULT_FRONTEND),
                        help="the frontend's openai_frontend/ folder (default: %(default)s)")
    parser.add_argument("--openai-port", type=int, default=9000)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--model", default=BACKEND_NAME,
                        help="model whose model.json names the chat tokenizer (default: exspec)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer for chat templates (default: the one model.json names)")
    parser.add_argument("--python", default=sys.executable,
                        help="Python with the frontend's requirements and Triton's in-process "
                             "bindings (default: this one)")
    parser.add_argument("--work-dir", default=None,
                        help="where the backend folder goes outside an image (default: a "
                             "temporary folder)")
    parser.add_argument("--backend-source", default=None,
                        help="folder with model.py and the exspec/ package to install")
    return parser.parse_args(argv), extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    try:
        backends = backend_folder(args.work_dir, args.backend_source)
        cmd = frontend_command(args, extra, backends)
    except FileNotFoundError as exc:
        print(f"exspec-openai: {exc}", file=sys.stderr)
        return 1
    env = stub_environment(dist=find_tritonserver())
    print("exspec-openai: " + " ".join(cmd[:2] + ["<bootstrap>"] + cmd[3:]), flush=True)
    os.execve(cmd[0], cmd, env)
    return 127   # not reached


if __name__ == "__main__":
    sys.exit(main())
