"""Our side of the contract with Triton's OpenAI frontend (server repo, python/openai, r26.06,
`--backend vllm`): the exact requests its vLLM request builder makes, sent to a real tritonserver.

The frontend turns every OpenAI field it does not handle itself into sampling_parameters JSON
(pydantic model_dump, defaults included: frequency_penalty 0, ignore_eos false, n 1,
presence_penalty 0, temperature 1 for completions and 0.7 for chat, top_p 1; max_tokens always
set, 16 unless asked), sends `exclude_input_in_output = not echo` (true when echo is absent),
asks for num_input_tokens / num_output_tokens on every request, and return_logprobs. It reads
usage from those two outputs (summing num_output_tokens over streamed chunks), text from
text_output, and the echo tensor's name from the model config. The frontend itself is not run in
CI (its in-process bindings are built from Triton's sources, see docs/serving.md, "Triton's
OpenAI frontend"); these tests pin what it needs from us, and test_openai_live.py runs it where it is
available.
"""
from __future__ import annotations

import json
import re

import pytest
import tritonclient.grpc as grpcclient

from clients import grpc_one

MODEL = "exspec"
PROMPT = "def add(a, b):"
# The neutral sampling values the frontend's request schema always carries (pydantic defaults).
NEUTRAL = {"frequency_penalty": 0, "ignore_eos": False, "n": 1, "presence_penalty": 0, "top_p": 1}


def frontend_request(prompt: str, *, chat: bool = False, stream: bool = False,
                     echo: bool | None = None, max_tokens: int = 16, logprobs: int | None = None,
                     **fields) -> dict:
    """The inputs _create_vllm_generate_request builds for one OpenAI request (grpc_one kwargs).

    `fields` are the request's other OpenAI fields (temperature, stop, seed, ...); they land in
    sampling_parameters as given."""
    sampling = {**NEUTRAL, "temperature": 0.7 if chat else 1, **fields, "max_tokens": max_tokens}
    if logprobs:
        sampling["logprobs"] = logprobs
    return {"prompt": prompt, "sampling": json.dumps(sampling), "stream": stream,
            "exclude_input_in_output": True if echo is None else not echo,
            "return_num_input_tokens": True, "return_num_output_tokens": True,
            "return_logprobs": bool(logprobs)}


@pytest.fixture(scope="module")
def greedy(engine):
    """The in-process engine's greedy completion of PROMPT (test_parity holds it to HF greedy)."""
    from exspec import SamplingParams
    [out] = engine.generate([PROMPT], [SamplingParams(max_tokens=12)])
    prompt_tokens = len(engine.tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    return out.text, len(out.token_ids), prompt_tokens


def _usage(call) -> tuple[int, int]:
    """(prompt_tokens, completion_tokens) as the frontend computes them from our responses."""
    prompts = {int(r.outputs["num_input_tokens"].reshape(-1)[0]) for r in call.responses}
    assert len(prompts) == 1, f"num_input_tokens changed between chunks: {prompts}"
    completion = sum(int(r.outputs["num_output_tokens"].reshape(-1)[0]) for r in call.responses)
    return prompts.pop(), completion


def _ok(call):
    errors = [r.error for r in call.responses if r.error]
    assert not errors, f"the frontend's request was refused: {errors}"
    assert sum(r.final for r in call.responses) == 1 and call.responses[-1].final
    for r in call.responses:
        assert r.outputs["num_input_tokens"].dtype.name == "uint32"
        assert r.outputs["num_output_tokens"].dtype.name == "uint32"
    return call


def test_model_config_names_the_echo_input_the_frontend_looks_for(server):
    """The frontend finds its echo tensor by name in the model config; without it echo would
    be silently ignored."""
    client = grpcclient.InferenceServerClient(server.urls["grpc"])
    try:
        config = client.get_model_config(MODEL, as_json=True)["config"]
    finally:
        client.close()
    inputs = {i["name"]: i for i in config["input"]}
    assert inputs["exclude_input_in_output"]["data_type"] == "TYPE_BOOL"
    assert {"text_input", "stream", "sampling_parameters", "return_num_input_tokens",
            "return_num_output_tokens", "return_logprobs"} <= set(inputs)


# From here on every test sends the neutral sampling values, so each needs the vLLM-contract
# change to the request parser (the drop-in contract, design: "The Triton adapter"); before it
# they fail on "unknown sampling parameter".

@pytest.mark.parametrize("field,value", [("n", 17), ("presence_penalty", 2.5)])
def test_non_neutral_vllm_value_is_refused_by_name(server, field, value):
    """What exspec cannot honour is refused in one final error response that names it (the
    frontend passes the message on as the HTTP error's detail). The frontend itself refuses
    n > 1 before it reaches a backend (r26.06 and main); n up to 16 is served (test_n_samples)."""
    call = grpc_one(server.urls["grpc"], MODEL,
                    **frontend_request(PROMPT, temperature=0, max_tokens=4, **{field: value}))
    [response] = call.responses
    assert response.final and response.error, f"{field}={value} was accepted: {call.responses}"
    assert re.search(rf"\b{field}\b", response.error), f"{field} not named: {response.error}"


def test_penalties_and_logit_bias_are_answered_as_the_engine_runs_them(server, engine):
    """OpenAI's frequency_penalty, presence_penalty and logit_bias (string token ids), in the
    frontend's request shape: answered, with the in-process engine's text."""
    from exspec import SamplingParams
    fields = dict(frequency_penalty=0.5, presence_penalty=0.5, logit_bias={"5": -100})
    call = _ok(grpc_one(server.urls["grpc"], MODEL,
                        **frontend_request(PROMPT, temperature=0, max_tokens=12, **fields)))
    [expected] = [out.text for out in engine.generate([PROMPT], [SamplingParams(max_tokens=12, **fields)])]
    assert call.text() == expected, f"completion {call.text()!r} != engine {expected!r}"


def test_completion_is_target_greedy_with_usage(server, greedy):
    text, n_tokens, prompt_tokens = greedy
    call = _ok(grpc_one(server.urls["grpc"], MODEL,
                        **frontend_request(PROMPT, temperature=0, max_tokens=12)))
    assert len(call.responses) == 1, "a non-streamed completion must be exactly one response"
    assert call.text() == text, f"completion {call.text()!r} != target greedy {text!r}"
    assert _usage(call) == (prompt_tokens, n_tokens)


def test_streamed_completion_joins_to_the_same_text_and_usage(server, greedy):
    text, n_tokens, prompt_tokens = greedy
    call = _ok(grpc_one(server.urls["grpc"], MODEL,
                        **frontend_request(PROMPT, stream=True, temperature=0, max_tokens=12)))
    assert len(call.responses) > 1, "a stream of one chunk proves nothing about deltas"
    assert call.text() == text, f"streamed {call.text()!r} != target greedy {text!r}"
    assert _usage(call) == (prompt_tokens, n_tokens), "streamed usage (summed deltas) is wrong"


def test_echo_prepends_the_prompt(server, greedy):
    text, n_tokens, prompt_tokens = greedy
    call = _ok(grpc_one(server.urls["grpc"], MODEL,
                        **frontend_request(PROMPT, echo=True, temperature=0, max_tokens=12)))
    assert call.text() == PROMPT + text
    assert _usage(call) == (prompt_tokens, n_tokens), "echo must not count the prompt as output"


def test_streamed_echo_is_refused_in_one_final_response(server):
    """echo with stream (exclude_input_in_output=false while streaming) is refused, as the vLLM
    backend refuses it, in one final error response that says why; through exspec-openai the
    stream then ends with an SSE error event (test_openai_live.py)."""
    call = grpc_one(server.urls["grpc"], MODEL, **frontend_request(
        PROMPT, echo=True, stream=True, temperature=0, max_tokens=12))
    [response] = call.responses
    assert response.final and response.error, f"streamed echo was accepted: {call.responses}"
    assert "exclude_input_in_output" in response.error and "stream" in response.error.lower()


def test_chat_stop_as_a_plain_string(server, greedy):
    """Chat requests carry `stop` as the string the client gave (not a list) and temperature
    0.7 unless set; the text ends before the stop string."""
    text, _, _ = greedy
    stop = text[len(text) // 2:][:3]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    call = _ok(grpc_one(server.urls["grpc"], MODEL, **frontend_request(
        PROMPT, chat=True, temperature=0, max_tokens=12, stop=stop)))
    assert call.text() == text[:text.index(stop)], (call.text(), stop)


def test_logprobs_in_vllm_format(server, greedy):
    """logprobs: N → per token, {token_id: {logprob, rank, decoded_token}} with the chosen token
    at rank 1 (the frontend sorts by rank and takes the first as the selected token)."""
    text, n_tokens, _ = greedy
    call = _ok(grpc_one(server.urls["grpc"], MODEL, **frontend_request(
        PROMPT, temperature=0, max_tokens=12, logprobs=2)))
    per_token = json.loads(call.responses[0].outputs["logprobs"].reshape(-1)[0])
    assert len(per_token) == n_tokens
    chosen = []
    for i, alternatives in enumerate(per_token):
        ranked = sorted(alternatives.values(), key=lambda a: a["rank"])
        assert ranked[0]["rank"] == 1 and len(alternatives) >= 2, (i, alternatives)
        assert all(a["logprob"] <= 0 for a in ranked), (i, alternatives)
        chosen.append(ranked[0]["decoded_token"])
    assert "".join(chosen) == text, f"rank-1 tokens {chosen} do not spell {text!r}"
