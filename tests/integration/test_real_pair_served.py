"""The real pair (SmolLM2-135M-Instruct, exspec.models.real_pair) in a real tritonserver: a chat
question rendered through the model's own chat template, sent as Triton's OpenAI frontend sends a
chat completion (test_openai_frontend.frontend_request) over the gRPC stream and as an HTTP
generate_stream, comes back as the in-process engine's greedy answer, ending at `<|im_end|>`.
"""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from exspec import EngineConfig, LLMEngine, SamplingParams
from exspec.models.real_pair import QUESTIONS, chat_prompt, ensure_pair
from exspec.serving.launcher import TritonServer

from clients import generate_stream, grpc_one
from modelrepo import write_model
from test_openai_frontend import frontend_request

MODEL = "smollm2"
ENGINE = {"method": "exspec", "num_speculative_tokens": 4, "adaptive_k": False,
          "max_batch_size": 2, "max_num_seqs": 4, "default_max_tokens": 16}
QUESTION = QUESTIONS[4][1]   # "What is the capital of France?": a short answer, then <|im_end|>


@pytest.fixture(scope="module")
def real():
    pair = ensure_pair()
    return pair, chat_prompt(AutoTokenizer.from_pretrained(pair / "target"), QUESTION)


@pytest.fixture(scope="module")
def real_server(real, tmp_path_factory):
    pair, _ = real
    repo = tmp_path_factory.mktemp("real-pair") / "models"
    write_model(repo, MODEL, pair, {**ENGINE, "tokenizer": str(pair / "target")})
    with TritonServer(repo, free_ports=True, startup_timeout_s=300,
                      log_path=repo.parent / "tritonserver.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def answer(real):
    pair, prompt = real
    engine = LLMEngine(EngineConfig.from_dict({
        "target_model": str(pair / "target"), "draft_model": str(pair / "draft"),
        "tokenizer": str(pair / "target"), **ENGINE}))
    [out] = engine.generate([prompt], [SamplingParams(max_tokens=48)])
    assert out.finish_reason == "stop" and "Paris" in out.text, out
    return out.text


def test_chat_completion_request_over_grpc_stream(real, real_server, answer):
    _, prompt = real
    call = grpc_one(real_server.urls["grpc"], MODEL,
                    **frontend_request(prompt, chat=True, stream=True, max_tokens=48, temperature=0))
    errors = [r.error for r in call.responses if r.error]
    assert not errors, errors
    text = b"".join(r.outputs["text_output"][0] for r in call.responses).decode()
    assert text == answer
    assert "<|im_end|>" not in text   # the end of turn stops the answer, it is not text


def test_http_generate_stream(real, real_server, answer):
    _, prompt = real
    status, events = generate_stream(real_server.urls["http"], MODEL,
                                     {"text_input": prompt, "stream": True, "max_tokens": 48,
                                      "exclude_input_in_output": True})
    assert status == 200
    assert "".join(e["text_output"] for e in events) == answer
