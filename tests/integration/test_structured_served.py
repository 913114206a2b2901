"""Structured outputs through a real tritonserver: a schema-constrained request returns JSON
that validates and equals the in-process engine's output, vLLM's older `guided_decoding`
spelling (as vllm_backend and Triton's OpenAI frontend send it: a JSON string of every
GuidedDecodingParams field) gives the same output, and a bad schema is a 400 naming it."""
from __future__ import annotations

import json

import jsonschema

from exspec import SamplingParams

from clients import event_ids, generate, grpc_one

PROMPT = "def add(a, b):"
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"enum": ["red", "blue"]}},
          "required": ["name", "age", "tag"], "additionalProperties": False}
MAX_TOKENS = 96


def test_schema_constrained_generate_returns_valid_json_equal_to_in_process(server, engine):
    status, body = generate(server.urls["http"], "exspec", {
        "text_input": PROMPT, "exclude_input_in_output": True,
        "sampling_parameters": json.dumps({"max_tokens": MAX_TOKENS,
                                           "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})})
    assert status == 200, body
    jsonschema.validate(json.loads(body["text_output"]), SCHEMA)
    expected = engine.generate([PROMPT], [SamplingParams(max_tokens=MAX_TOKENS,
                                                         structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})])[0]
    assert event_ids(body) == expected.token_ids


def test_guided_decoding_spelling_over_grpc_gives_the_same_output(server):
    structured = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, exclude_input_in_output=True,
                          sampling={"max_tokens": MAX_TOKENS, "structured_outputs": json.dumps({"json": SCHEMA, "disable_any_whitespace": True})})
    # what Triton's OpenAI frontend sends for a named tool: json.dumps(asdict(GuidedDecodingParams))
    guided = json.dumps({"json": json.dumps(SCHEMA), "regex": None, "choice": None, "grammar": None,
                         "json_object": None, "backend": None, "whitespace_pattern": None,
                         "structural_tag": None, "disable_any_whitespace": True})
    old = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, exclude_input_in_output=True,
                   sampling={"max_tokens": MAX_TOKENS, "guided_decoding": guided})
    for call in (structured, old):
        assert all(r.error is None for r in call.responses), call.responses
    assert old.ids() == structured.ids()
    jsonschema.validate(json.loads(old.text()), SCHEMA)


def test_choice_as_a_request_parameter(server):
    status, body = generate(server.urls["http"], "exspec", {
        "text_input": PROMPT, "exclude_input_in_output": True, "max_tokens": 20,
        "structured_outputs": json.dumps({"choice": ["yes", "no"]})})
    assert status == 200 and body["text_output"] in ("yes", "no"), body


def test_a_bad_schema_is_a_400_naming_it(server):
    status, body = generate(server.urls["http"], "exspec", {
        "text_input": PROMPT, "sampling_parameters": json.dumps(
            {"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}})})
    assert status == 400, body
    assert "structured_outputs.json is invalid" in body.get("error", ""), body
    status, body = generate(server.urls["http"], "exspec", {
        "text_input": PROMPT, "sampling_parameters": json.dumps({"guided_decoding": {"regex": "([a-z"}})})
    assert status == 400 and "regex" in body.get("error", ""), body
    status, body = generate(server.urls["http"], "exspec", {"text_input": PROMPT, "max_tokens": 3})
    assert status == 200 and len(event_ids(body)) == 3, "the server stopped serving after bad specs"


def test_vllm_backend_accuracy_test_structured_request_shape(server):
    """vllm_backend's ci accuracy_test.py::test_structured_outputs, its request as it sends it:
    gRPC stream, stream false, sampling_parameters {"temperature": 0, "top_p": 1,
    "structured_outputs": json.dumps({"choice": ["Positive", "Negative"]})}. (Its own check
    compares `list.sort()` results, None == None, so it only asserts that a text_output came
    back without error; here the text must also be one of the choices.)"""
    prompt = "Classify intent of the sentence: Harry Potter is underrated. "
    call = grpc_one(server.urls["grpc"], "exspec", prompt=prompt, stream=False, sampling={
        "temperature": 0, "top_p": 1,
        "structured_outputs": json.dumps({"choice": ["Positive", "Negative"]})})
    (only,) = call.responses
    assert only.error is None and only.final, only
    assert only.text() in (prompt + "Positive", prompt + "Negative"), only.text()
