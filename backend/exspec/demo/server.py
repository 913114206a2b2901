"""`python -m exspec.demo.server`: the exspec backend in a real tritonserver, as a client sees it.

Starts tritonserver on model_repository/ through the launcher (free ports), then
  1. streams one completion over gRPC (tritonclient, decoupled model `exspec`),
  2. streams one over HTTP generate_stream with curl,
  3. answers one unary infer (tritonclient HTTP, front model `exspec_unary`),
and stops the server. Until the trained demo pair is in model_repository/exspec/1/demo, it
serves a copy of the repository with a small seeded pair (exspec.demo.tiny) in its place.
"""
from __future__ import annotations

import argparse
import json
import queue
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..serving.launcher import TritonServer

REPOSITORY = Path(__file__).resolve().parents[3] / "model_repository"
FALLBACK_PROMPT = "def add(a, b):\n"


def _repository(work: Path) -> Path:
    demo = REPOSITORY / "exspec" / "1" / "demo"
    if (demo / "target" / "config.json").exists() and (demo / "draft" / "config.json").exists():
        return REPOSITORY
    from .tiny import build_demo_pair
    copy = work / "model_repository"
    shutil.copytree(REPOSITORY, copy, ignore=shutil.ignore_patterns("demo", "__pycache__"))
    print(f"(no trained demo pair in {demo}; serving a small seeded pair from {copy})")
    build_demo_pair(copy / "exspec" / "1" / "demo")
    return copy


def _prompt(repository: Path) -> str:
    prompts = repository / "exspec" / "1" / "demo" / "prompts.jsonl"
    if prompts.exists():
        for line in prompts.read_text().splitlines():
            if line.strip():
                return json.loads(line)["turns"][0]
    return FALLBACK_PROMPT


def _grpc_stream(url: str, prompt: str, max_tokens: int) -> None:
    import numpy as np
    import tritonclient.grpc as grpcclient

    print(f"\n== 1. gRPC stream (tritonclient, model exspec, {url})")
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    stream = grpcclient.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    params = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([json.dumps({"max_tokens": max_tokens}).encode()],
                                        dtype=np.object_))
    reason = grpcclient.InferInput("return_finish_reason", [1], "BOOL")
    reason.set_data_from_numpy(np.array([True]))
    start = time.perf_counter()
    client.async_stream_infer("exspec", [text, stream, params, reason], request_id="demo",
                              enable_empty_final_response=True)
    pieces = 0
    sys.stdout.write(prompt)
    while True:
        result, error = events.get(timeout=300)
        if error is not None:
            raise RuntimeError(f"stream failed: {error}")
        response = result.get_response()
        if response.outputs:
            sys.stdout.write(result.as_numpy("text_output")[0].decode())
            sys.stdout.flush()
            pieces += 1
        if response.parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    seconds = time.perf_counter() - start
    print(f"\n-- {pieces} streamed responses in {seconds:.2f} s; finish_reason "
          f"{result.as_numpy('finish_reason')[0].decode()}, acceptance rate "
          f"{float(result.as_numpy('acceptance_rate')[0]):.2f} "
          f"({int(result.as_numpy('total_accepted_draft_tokens')[0])}/"
          f"{int(result.as_numpy('total_draft_tokens')[0])} draft tokens)")


def _curl_stream(http: str, prompt: str, max_tokens: int) -> None:
    body = json.dumps({"text_input": prompt, "stream": True, "max_tokens": max_tokens,
                       "return_finish_reason": True})
    cmd = ["curl", "-sN", "-X", "POST", f"{http}/v2/models/exspec/generate_stream", "-d", body]
    print(f"\n== 2. HTTP generate_stream\n$ {shlex.join(cmd)}")
    if not shutil.which("curl"):
        print("(curl not installed; skipped)")
        return
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("data: ")]
    for line in lines[:3]:
        print(line)
    if len(lines) > 3:
        print(f"... ({len(lines) - 3} more events)")
        print(lines[-1])
    joined = "".join(json.loads(line[6:]).get("text_output", "") for line in lines)
    print(f"-- joined text: {joined!r}")


def _unary(http: str, prompt: str, max_tokens: int) -> None:
    import numpy as np
    import tritonclient.http as httpclient

    print(f"\n== 3. unary infer (tritonclient HTTP, model exspec_unary, {http})")
    client = httpclient.InferenceServerClient(http.replace("http://", ""))
    text = httpclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    result = client.infer("exspec_unary", [text], parameters={"max_tokens": max_tokens})
    client.close()
    print(result.as_numpy("text_output")[0].decode())
    print(f"-- {len(result.as_numpy('output_ids'))} tokens, acceptance rate "
          f"{float(result.as_numpy('acceptance_rate')[0]):.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exspec.demo.server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompt", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="exspec-demo-") as tmp:
        repository = _repository(Path(tmp))
        prompt = args.prompt or _prompt(repository)
        print(f"starting tritonserver on {repository} ...", flush=True)
        started = time.perf_counter()
        with TritonServer(repository, free_ports=True, startup_timeout_s=600,
                          log_path=Path(tmp) / "tritonserver.log") as server:
            print(f"ready in {time.perf_counter() - started:.1f} s: HTTP {server.urls['http']}, "
                  f"gRPC {server.urls['grpc']}, metrics {server.urls['metrics']}")
            _grpc_stream(server.urls["grpc"], prompt, args.max_tokens)
            _curl_stream(server.urls["http"], prompt, args.max_tokens)
            _unary(server.urls["http"], prompt, args.max_tokens)
            print("\nstopping tritonserver ...")
        print("stopped.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
