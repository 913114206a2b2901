"""The real model as `make serve` serves it: SmolLM2-135M-Instruct from the model repository
`make real-pair` writes beside the pair (model `smollm2`, n-gram proposer, and `smollm2_unary`),
in a real tritonserver. A chat question comes back as the target alone answers it greedily, ending
at `<|im_end|>`: sent as Triton's OpenAI frontend sends a chat completion (the template rendered
by the client), as `messages` (rendered by the server with the model's own template) over HTTP
generate, the unary front model and exspec-client --chat; and the README's quick start, run as
written against this server, prints those answers.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from exspec import EngineConfig, LLMEngine, SamplingParams
from exspec.models.real_pair import QUESTIONS, SERVED_NAME, chat_prompt, ensure_pair
from exspec.serving.launcher import TritonServer

from clients import generate, generate_stream, grpc_one
from test_openai_frontend import frontend_request

REPO = Path(__file__).resolve().parents[2]
QUESTION = QUESTIONS[4][1]   # "What is the capital of France?": a short answer, then <|im_end|>
CODING = QUESTIONS[0][1]     # "Write a Python function that reverses a string."


@pytest.fixture(scope="module")
def pair():
    return ensure_pair()


@pytest.fixture(scope="module")
def real_server(pair):
    """The repository `make serve` serves, as written (its model.json untouched)."""
    repository = pair / "model_repository"
    assert (repository / SERVED_NAME / "1" / "model.json").exists()
    with TritonServer(repository, free_ports=True, startup_timeout_s=300) as srv:
        yield srv


@pytest.fixture(scope="module")
def target_only(pair):
    """question -> the target alone's greedy answer (autoregressive, in-process)."""
    tokenizer = AutoTokenizer.from_pretrained(pair / "target")
    engine = LLMEngine(EngineConfig(target_model=str(pair / "target"), method="autoregressive"))
    questions = [QUESTION, CODING]
    outs = engine.generate([chat_prompt(tokenizer, q) for q in questions],
                           [SamplingParams(max_tokens=64), SamplingParams(max_tokens=128)])
    assert outs[0].finish_reason == "stop" and "Paris" in outs[0].text, outs[0]
    return {q: out.text for q, out in zip(questions, outs)} | {"tokenizer": tokenizer}


def test_chat_completion_request_over_grpc_stream(real_server, target_only):
    """Served on the compiled decode path (the repository's enforce_eager false), warmed up in
    Triton's stub (whose C locale once made inductor's UTF-8 templates fail to load), its
    engine's log lines in Triton's log, and exactly the target alone's answer, whose engine here
    is eager."""
    log = Path(real_server.log_path).read_text(errors="replace")
    assert "decode path compiled" in log and "layer linears packed by oneDNN" in log, log[-3000:]
    # the engine's own log lines reach Triton's log (exspec_log.EngineLog): its warm-up summary
    assert "exspec: compiled decode path ready: compiled" in log, log[-3000:]
    prompt = chat_prompt(target_only["tokenizer"], QUESTION)
    call = grpc_one(real_server.urls["grpc"], SERVED_NAME,
                    **frontend_request(prompt, chat=True, stream=True, max_tokens=64, temperature=0))
    errors = [r.error for r in call.responses if r.error]
    assert not errors, errors
    text = b"".join(r.outputs["text_output"][0] for r in call.responses).decode()
    assert text == target_only[QUESTION]
    assert "<|im_end|>" not in text   # the end of turn stops the answer, it is not text


def test_messages_are_rendered_by_the_servers_chat_template(real_server, target_only):
    """`messages` as JSON text: the answer alone comes back (not the rendered template), streamed
    or not, exactly the target's greedy answer to the same chat rendered by the client."""
    messages = f'[{{"role": "user", "content": "{QUESTION}"}}]'
    status, body = generate(real_server.urls["http"], SERVED_NAME,
                            {"messages": messages, "max_tokens": 64, "temperature": 0})
    assert status == 200, body
    assert body["text_output"] == target_only[QUESTION]
    status, events = generate_stream(real_server.urls["http"], SERVED_NAME,
                                     {"messages": messages, "max_tokens": 64, "stream": True})
    assert status == 200, events
    assert "".join(e["text_output"] for e in events) == target_only[QUESTION]


@pytest.mark.parametrize("body, words", [
    ({"messages": "What is the capital of France?"}, "messages must be a JSON list"),
    ({"messages": "[]"}, "non-empty JSON list"),
    ({"messages": '[{"role": "user"}]'}, "messages[0] must be an object with string role and content"),
    ({"messages": '[{"role": "user", "content": "hi"}]', "text_input": "hi"}, "not two"),
])
def test_a_malformed_chat_is_refused_naming_the_fix(real_server, body, words):
    status, answer = generate(real_server.urls["http"], SERVED_NAME, {**body, "max_tokens": 4})
    assert status == 400 and words in answer["error"], answer


def test_unary_front_model_and_the_cli_chat(real_server, target_only):
    from exspec_client import Client
    client = Client(real_server.urls["grpc"], model=SERVED_NAME)
    chat = [{"role": "user", "content": QUESTION}]
    assert client.infer(chat, max_tokens=64).text == target_only[QUESTION]
    cli = subprocess.run([str(Path(sys.executable).parent / "exspec-client"), QUESTION, "--chat",
                          "--max-tokens", "64", "--url", real_server.urls["grpc"]],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == target_only[QUESTION] + "\n"


def quick_start_block() -> str:
    """The README quick start's first bash block."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Quick start"):readme.index("## The guarantee")]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def test_the_readme_quick_start_as_written(real_server, target_only):
    """Its curl and exspec-client lines, run by bash as written but for the server's address
    (this server's free ports), print the target-only answers; the server lines it skips are
    this fixture's job, and `pip install ./client` is make's."""
    block = quick_start_block()
    assert "make serve &" in block and "until curl -sf localhost:8000/v2/health/ready" in block
    script = "\n".join(line for line in block.splitlines()
                       if not line.startswith(("make serve", "until curl", "pip install")))
    http = real_server.urls["http"].removeprefix("http://")
    script = script.replace("localhost:8000", http).replace(
        "exspec-client ", f"exspec-client --url {real_server.urls['grpc']} ")
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    done = subprocess.run(["bash", "-e", "-c", script], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert f'"text_output":"{target_only[QUESTION]}"' in done.stdout, done.stdout
    assert done.stdout.endswith(target_only[CODING] + "\n"), done.stdout


def test_the_readme_python_snippet(target_only):
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Quick start"):readme.index("## The guarantee")]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout == target_only[QUESTION] + "\n"
