"""`python -m exspec.demo.server`: the real pair in a real tritonserver, as a client sees it.

Serves SmolLM2-135M-Instruct with the EAGLE-3 head trained for it (else its trained draft;
exspec.models.real_pair, set up once) as model
`exspec` on free ports through the launcher, on the compiled decode path (`--path compiled`,
enforce_eager false: a warm-up before READY, its graphs from the compile cache the engine part
of `make demo` filled; `--path eager` for Hugging Face's own forward), then
  1. streams each chat question over gRPC (tritonclient), once speculative and once with
     `num_speculative_tokens: 0` (the same server decoding autoregressively), the two
     alternating so both meet the same load: the streamed text, tokens/s, acceptance and the
     speed-up,
  2. streams one question over HTTP generate_stream with curl,
  3. asks one as a chat completion through Triton's OpenAI frontend (exspec-openai) where its
     sources are present ($TRITON_OPENAI_FRONTEND), else says so and skips,
and stops the server. Questions 1 and 2 are rendered through the model's own chat template
(ChatML) here; the OpenAI frontend renders its chat with the same template.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..models.real_pair import (QUESTIONS, SERVED_NAME, chat_prompt, demo_proposer, ensure_pair,
                                write_repository)
from ..serving.launcher import ServerNotReady, TritonServer
from ..serving.openai_frontend import DEFAULT_FRONTEND
from ..serving.ports import reserve_ports

MODEL = SERVED_NAME   # as `make serve` names it: the demo's printed curl works against it too
DEMO_QUESTIONS = [QUESTIONS[0][1], QUESTIONS[4][1], QUESTIONS[8][1]]   # coding, qa, writing


@dataclass
class Answer:
    """One streamed gRPC request: its text, token count, wall time and draft counts."""
    text: str
    tokens: int
    seconds: float
    drafted: int
    accepted: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _grpc_answer(client, events: queue.Queue, prompt: str, sampling: dict, echo: bool) -> Answer:
    """One request on an open gRPC stream, waited for to its final response."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    params = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=np.object_))
    inputs = [text, params]
    for name in ("stream", "exclude_input_in_output"):
        inputs.append(grpcclient.InferInput(name, [1], "BOOL"))
        inputs[-1].set_data_from_numpy(np.array([True]))
    start = time.perf_counter()
    client.async_stream_infer(MODEL, inputs, enable_empty_final_response=True)
    pieces, tokens = [], 0
    while True:
        result, error = events.get(timeout=600)
        if error is not None:
            raise RuntimeError(f"stream failed: {error}")
        response = result.get_response()
        if response.outputs:
            pieces.append(result.as_numpy("text_output")[0].decode())
            tokens += len(result.as_numpy("output_ids"))
            if echo:
                sys.stdout.write(pieces[-1])
                sys.stdout.flush()
            last = result
        if response.parameters["triton_final_response"].bool_param:
            break
    seconds = time.perf_counter() - start
    return Answer("".join(pieces), tokens, seconds,
                  int(last.as_numpy("total_draft_tokens")[0]),
                  int(last.as_numpy("total_accepted_draft_tokens")[0]))


def _grpc_side_by_side(url: str, prompts: list[str], max_tokens: int, k: int) -> None:
    import tritonclient.grpc as grpcclient

    print(f"\n== 1. gRPC stream (tritonclient, model {MODEL}, {url}): each question speculative "
          f"(adaptive k <= {k}) and autoregressive (num_speculative_tokens 0), greedy, one at a time")
    greedy = {"max_tokens": max_tokens, "temperature": 0}
    modes = {"speculative": greedy, "autoregressive": {**greedy, "num_speculative_tokens": 0}}
    answers = {mode: [] for mode in modes}
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        # one short untimed request first: the first step of each kind pays one-off costs
        _grpc_answer(client, events, prompts[0], {"max_tokens": 8}, echo=False)
        for i, prompt in enumerate(prompts):
            print(f"\n--- question {i + 1}: {DEMO_QUESTIONS[i]!r} (streamed, speculative)\n")
            # alternate which goes first, so neither always meets the same moment of the host
            for mode in sorted(modes, reverse=bool(i % 2)):
                answers[mode].append(_grpc_answer(client, events, prompt, modes[mode],
                                                  echo=mode == "speculative"))
            spec, plain = answers["speculative"][-1], answers["autoregressive"][-1]
            print(f"\n[speculative: {spec.tokens} tokens, {spec.tokens_per_s:.1f} tokens/s, "
                  f"acceptance {spec.accepted}/{spec.drafted}; autoregressive: "
                  f"{plain.tokens_per_s:.1f} tokens/s; same text: {spec.text == plain.text}]")
    finally:
        client.stop_stream()
        client.close()
    rate = {mode: sum(a.tokens for a in runs) / sum(a.seconds for a in runs)
            for mode, runs in answers.items()}
    drafted = sum(a.drafted for a in answers["speculative"])
    accepted = sum(a.accepted for a in answers["speculative"])
    same = sum(s.text == p.text for s, p in zip(answers["speculative"], answers["autoregressive"]))
    tokens = sum(a.tokens for a in answers["speculative"])
    print(f"\n-- served, B = 1, adaptive k <= {k}: speculative {rate['speculative']:.1f} tokens/s, "
          f"autoregressive {rate['autoregressive']:.1f} tokens/s, speed-up "
          f"{rate['speculative'] / rate['autoregressive']:.2f}x; acceptance "
          f"{accepted / drafted if drafted else 0:.2f} ({accepted} of {drafted} drafted tokens "
          f"for {tokens} committed); {same}/{len(prompts)} answers identical to autoregressive."
          f"\n   Wall times include the round trips.")


def _curl_stream(http: str, prompt: str, max_tokens: int) -> None:
    body = json.dumps({"text_input": prompt, "stream": True, "max_tokens": max_tokens,
                       "exclude_input_in_output": True, "return_finish_reason": True})
    cmd = ["curl", "-sN", "-X", "POST", f"{http}/v2/models/{MODEL}/generate_stream", "-d", body]
    print(f"\n== 2. HTTP generate_stream\n$ {shlex.join(cmd)}")
    if not shutil.which("curl"):
        print("(curl not installed; skipped)")
        return
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("data: ")]
    for line in lines[:3]:
        print(line)
    if len(lines) > 3:
        print(f"... ({len(lines) - 3} more events)")
        print(lines[-1])
    joined = "".join(json.loads(line[6:]).get("text_output", "") for line in lines)
    print(f"-- joined text: {joined!r}")


def _openai_chat(repository: Path, question: str, max_tokens: int) -> None:
    """A streamed chat completion through exspec-openai, when Triton's frontend is here."""
    frontend = Path(os.environ.get("TRITON_OPENAI_FRONTEND", DEFAULT_FRONTEND))
    print("\n== 3. OpenAI chat completion (Triton's OpenAI frontend, exspec-openai)")
    if not (frontend / "main.py").is_file():
        print(f"(skipped: Triton's OpenAI frontend is not on this machine ({frontend}/main.py); "
              "it ships in NGC images; elsewhere set TRITON_OPENAI_FRONTEND and "
              "EXSPEC_OPENAI_PYTHON: docs/serving.md, \"Triton's OpenAI frontend\")")
        return
    with reserve_ports(1, host="127.0.0.1") as (port,):
        pass
    python = os.environ.get("EXSPEC_OPENAI_PYTHON", sys.executable)
    log = repository.parent / "openai.log"
    proc = subprocess.Popen([sys.executable, "-m", "exspec.serving.openai_frontend",
                             "--model-repository", str(repository), "--frontend", str(frontend),
                             "--python", python, "--openai-port", str(port)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url + "/health/ready", log)
        body = {"model": MODEL, "messages": [{"role": "user", "content": question}],
                "max_tokens": max_tokens, "temperature": 0, "stream": True}
        print(f"POST {url}/v1/chat/completions {json.dumps(body)}")
        request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            for line in response:
                line = line.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:]).get("choices", []):
                        sys.stdout.write(choice.get("delta", {}).get("content") or "")
                        sys.stdout.flush()
        print()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def _wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exspec-openai exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"exspec-openai not ready in {timeout_s:.0f} s (log: {log})")


def _start(tmp: Path, pair: Path, args) -> tuple[TritonServer, Path]:
    """The server on `args.path`, ready; where the compiled path does not load (inductor without
    a C++ compiler, say), on the eager path, saying why."""
    proposer = demo_proposer(pair)
    with_what = "its EAGLE-3 head" if proposer == "eagle3" else "its trained draft"
    for path in dict.fromkeys((args.path, "eager")):
        repository = write_repository(tmp / path / "models", pair, proposer, args.k, MODEL,
                                      compiled=path == "compiled")
        print(f"starting tritonserver: SmolLM2-135M-Instruct (float32) with {with_what}, "
              f"the {path} decode path (--path), from {pair} ...", flush=True)
        started = time.perf_counter()
        server = TritonServer(repository, free_ports=True, startup_timeout_s=600,
                              log_path=tmp / path / "tritonserver.log")
        try:
            server.start()
        except ServerNotReady as exc:
            server.cleanup()
            if path == "eager":
                raise
            print(f"the compiled path did not load here ({str(exc)[-400:]}); serving on the eager "
                  f"path instead (--path eager)")
            continue
        print(f"ready in {time.perf_counter() - started:.1f} s: HTTP {server.urls['http']}, "
              f"gRPC {server.urls['grpc']}, metrics {server.urls['metrics']}")
        return server, repository
    raise AssertionError("unreachable: the eager path's start raises")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exspec.demo.server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("-k", type=int, default=4, help="the most speculative tokens per step")
    parser.add_argument("--num-questions", type=int, default=len(DEMO_QUESTIONS),
                        choices=range(1, len(DEMO_QUESTIONS) + 1))
    parser.add_argument("--path", choices=("compiled", "eager"), default="compiled",
                        help="the decode path the server runs (enforce_eager false or true)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer
    pair = ensure_pair()
    tokenizer = AutoTokenizer.from_pretrained(pair / "target")
    prompts = [chat_prompt(tokenizer, q) for q in DEMO_QUESTIONS[:args.num_questions]]
    with tempfile.TemporaryDirectory(prefix="exspec-demo-") as tmp:
        server, repository = _start(Path(tmp), pair, args)
        try:
            _grpc_side_by_side(server.urls["grpc"], prompts, args.max_tokens, args.k)
            _curl_stream(server.urls["http"], prompts[-1], args.max_tokens)
            _openai_chat(repository, DEMO_QUESTIONS[0], args.max_tokens)
            print("\nstopping tritonserver ...")
        finally:
            server.stop()
            server.cleanup()
        print("stopped.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
