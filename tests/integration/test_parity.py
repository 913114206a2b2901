"""Served greedy output equals the in-process engine's and Hugging Face target-only greedy, for
concurrent requests of different lengths, on every protocol the server offers."""
from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch

from clients import event_ids, generate, generate_stream, grpc_infer, grpc_stream, http_infer

PROMPTS = ["def add(a, b):", "hello", "The quick brown fox jumps over the lazy",
           "import os\nimport sys\n\nclass Engine:\n    pass\n"]
MAX_TOKENS = [12, 20, 7, 16]


@pytest.fixture(scope="module")
def reference(engine, hf_target):
    """Per prompt: (engine token ids, engine text, HF greedy token ids)."""
    from exspec import SamplingParams
    outs = engine.generate(PROMPTS, [SamplingParams(max_tokens=n) for n in MAX_TOKENS])
    model, tokenizer = hf_target
    refs = []
    for prompt, n, out in zip(PROMPTS, MAX_TOKENS, outs):
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                do_sample=False, pad_token_id=tokenizer.eos_token_id)
        refs.append((out.token_ids, out.text, hf[0, ids.shape[1]:].tolist()))
    for i, (eng, _, hf) in enumerate(refs):
        assert eng == hf, f"prompt {i}: in-process engine differs from HF greedy:\n{eng}\n{hf}"
    return refs


def test_grpc_stream_equals_engine_and_hf_greedy(server, reference):
    calls = grpc_stream(server.urls["grpc"], "exspec",
                        [{"prompt": p, "stream": True, "sampling": {"max_tokens": n}}
                         for p, n in zip(PROMPTS, MAX_TOKENS)])
    for i, (call, (ids, text, hf)) in enumerate(zip(calls, reference)):
        assert call.ids() == hf, f"request {i}: streamed ids {call.ids()} != HF greedy {hf}"
        assert call.text() == text, f"request {i}: streamed text {call.text()!r} != {text!r}"


def test_http_generate_equals_engine_concurrently(server, reference):
    def one(i):
        return generate(server.urls["http"], "exspec",
                        {"text_input": PROMPTS[i], "max_tokens": MAX_TOKENS[i],
                         "exclude_input_in_output": True})
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(one, range(len(PROMPTS))))
    for i, ((status, body), (ids, text, _)) in enumerate(zip(results, reference)):
        assert status == 200, f"request {i}: {body}"
        assert event_ids(body) == ids, f"request {i}: ids {body.get('output_ids')} != {ids}"
        assert body["text_output"] == text, f"request {i}: {body['text_output']!r} != {text!r}"


def test_http_generate_stream_joins_to_engine_text(server, reference):
    status, events = generate_stream(server.urls["http"], "exspec",
                                     {"text_input": PROMPTS[1], "stream": True,
                                      "max_tokens": MAX_TOKENS[1]})
    assert status == 200, events
    ids, text, _ = reference[1]
    assert [t for e in events for t in event_ids(e)] == ids
    assert "".join(e["text_output"] for e in events) == text


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_unary_infer_equals_engine(server, reference, protocol):
    ids, text, _ = reference[0]
    params = {"max_tokens": MAX_TOKENS[0]}
    if protocol == "http":
        result = http_infer(server.urls["http"], "exspec_unary", PROMPTS[0], params)
    else:
        result = grpc_infer(server.urls["grpc"], "exspec_unary", PROMPTS[0], params)
    assert result.as_numpy("output_ids").tolist() == ids
    # Not streaming and exclude_input_in_output absent: the prompt comes first (vLLM's rule).
    assert result.as_numpy("text_output")[0].decode() == PROMPTS[0] + text
