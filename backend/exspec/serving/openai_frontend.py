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

The frontend runs through openai_bootstrap.py (in the frontend's Python): it hands our backend
folder to tritonserver.Server, cancels a request whose client went away, maps backend errors to
400 / 503 and ends a failed stream with an SSE error event, and removes the temporary folder at
exit. Loopback only unless --host says otherwise, as exspec-serve. Outside an image the
frontend's Python needs its requirements and Triton's in-process bindings (docs/serving.md,
"Triton's OpenAI frontend").
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from ..config import resolve_model_paths
from .install import BACKEND_NAME, find_tritonserver, install
from .launcher import host_argument, split_passthrough, stub_environment

DEFAULT_FRONTEND = "/opt/tritonserver/python/openai/openai_frontend"

BOOTSTRAP = Path(__file__).with_name("openai_bootstrap.py")
# The frontend's KServe ports take no restriction flags (tritonfrontend r26.06 builds them with
# an empty RestrictedFeatures), so their admin APIs are open: only on loopback unless asked.
KSERVE_FLAG = "--enable-kserve-frontends"
LOOPBACK = "127.0.0.1"


class Backends(NamedTuple):
    folder: Path
    temporary: Path | None      # exspec-openai's own folder, removed when the frontend exits


def model_tokenizer(model_repository: Path, model: str) -> str | None:
    """The tokenizer (else the target) that model.json names, resolved as the Triton model
    resolves it (exspec.config.resolve_model_paths)."""
    path = model_repository / model / "1" / "model.json"
    if not path.is_file():
        return None
    config = resolve_model_paths(json.loads(path.read_text()), path.parent)
    return config.get("tokenizer") or config.get("target_model") or None


def check_arguments(args, extra: list[str]) -> None:
    """What would make the frontend fail, or open more than asked, before anything is laid out."""
    main = Path(args.frontend) / "main.py"
    if not main.is_file():
        raise FileNotFoundError(f"{main} not found: pass --frontend (or $TRITON_OPENAI_FRONTEND)"
                                " pointing at the server repository's python/openai/openai_frontend")
    if KSERVE_FLAG in extra and args.host != LOOPBACK and not args.unrestricted_kserve:
        raise ValueError(f"{KSERVE_FLAG} on {args.host} opens Triton's administrative APIs "
                         "(model load/unload, ...) with no key: the frontend cannot restrict its "
                         "KServe ports. Pass --unrestricted-kserve to accept that, or keep "
                         f"--host {LOOPBACK}")


def frontend_command(args, extra: list[str], backends: Backends) -> list[str]:
    check_arguments(args, extra)
    cmd = [args.python, str(BOOTSTRAP), str(Path(args.frontend).resolve()), str(backends.folder),
           str(backends.temporary or ""),
           "--model-repository", str(Path(args.model_repository).resolve()),
           "--backend", "vllm", "--openai-port", str(args.openai_port), "--host", args.host]
    tokenizer = args.tokenizer or model_tokenizer(Path(args.model_repository), args.model)
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    return cmd + extra


def backend_folder(work_dir: str | None, backend_source: str | None) -> Backends:
    """The distribution's backends when exspec is installed there (the image), else a fresh
    layout in work_dir, or in a temporary folder that the frontend removes when it exits."""
    dist = find_tritonserver()
    if (dist.backends / BACKEND_NAME / "model.py").is_file() and not backend_source:
        return Backends(dist.backends, None)
    temporary = None if work_dir else Path(tempfile.mkdtemp(prefix="exspec-openai-"))
    try:
        folder = install(Path(work_dir or temporary) / "backends", dist,
                         **({"source": backend_source} if backend_source else {}))
    except BaseException:
        if temporary:
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    return Backends(folder, temporary)


def parse_args(argv: list[str] | None):
    argv, extra = split_passthrough(argv)
    parser = argparse.ArgumentParser(prog="exspec-openai", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-repository", required=True)
    parser.add_argument("--frontend", default=os.environ.get("TRITON_OPENAI_FRONTEND",
                                                             DEFAULT_FRONTEND),
                        help="the frontend's openai_frontend/ folder (default: %(default)s)")
    parser.add_argument("--openai-port", type=int, default=9000)
    parser.add_argument("--host", type=host_argument, default=LOOPBACK,
                        help="IPv4 address the frontend (and its KServe ports) listen on "
                             "(default 127.0.0.1: this machine only; 0.0.0.0: every interface)")
    parser.add_argument("--unrestricted-kserve", action="store_true",
                        help=f"allow {KSERVE_FLAG} beyond loopback, with Triton's "
                             "administrative APIs open on those ports")
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
        check_arguments(args, extra)
        backends = backend_folder(args.work_dir, args.backend_source)
    except (FileNotFoundError, ValueError) as exc:
        print(f"exspec-openai: {exc}", file=sys.stderr)
        return 1
    cmd = frontend_command(args, extra, backends)
    env = stub_environment(dist=find_tritonserver())
    print("exspec-openai: " + shlex.join(redacted(cmd)), flush=True)   # container logs: no keys
    try:
        os.execve(cmd[0], cmd, env)
    except OSError as exc:
        if backends.temporary:
            shutil.rmtree(backends.temporary, ignore_errors=True)
        print(f"exspec-openai: could not start the frontend with {cmd[0]}: {exc}", file=sys.stderr)
    return 127


def redacted(cmd: list[str]) -> list[str]:
    """The command with the secrets of restricted-API flags hidden: `--openai-restricted-api
    API HEADER VALUE` keeps its API and header name, and a `key=value` or `--flag=value` loses
    its value."""
    out, after = [], None   # after: arguments seen since a restricted flag
    for arg in cmd:
        if arg.startswith("--"):
            name, eq, _ = arg.partition("=")
            restricted = "restricted" in name
            after = 0 if restricted and not eq else None
            out.append(f"{name}=<redacted>" if restricted and eq else arg)
            continue
        if after is not None:
            after += 1
            if after == 3:
                arg = "<redacted>"
            elif "=" in arg:
                arg = arg.split("=", 1)[0] + "=<redacted>"
        out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(main())
