"""The adapter's request parser (backend/exspec_request.py), without a server: string spellings
parse like JSON values, and every problem is an InvalidRequestError naming it."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from exspec import InvalidRequestError
from exspec_request import parse_request

DEMO_TOKENIZER = Path(__file__).resolve().parents[2] / "model_repository" / "exspec" / "1" / "demo" / "tokenizer"


def _text(value="hi"):
    return np.array([value.encode()], dtype=np.object_)


def parse(parameters=None, **inputs):
    inputs.setdefault("text_input", _text())
    inputs = {k: v for k, v in inputs.items() if v is not None}
    return parse_request(inputs, json.dumps(parameters or {}))


@pytest.mark.parametrize("raw,expected", [
    ({"max_tokens": "12"}, {"max_tokens": 12}),
    ({"max_tokens": 12.0}, {"max_tokens": 12}),
    ({"temperature": "0.25", "top_p": "1"}, {"temperature": 0.25, "top_p": 1.0}),
    ({"ignore_eos": "False"}, {"ignore_eos": False}),
    ({"ignore_eos": "1"}, {"ignore_eos": True}),
    ({"stop": "\\n\\n"}, {"stop": ["\\n\\n"]}),
    ({"stop": '["a", "b"]'}, {"stop": ["a", "b"]}),
    ({"stop_token_ids": "1, 2"}, {"stop_token_ids": [1, 2]}),
    ({"stop_token_ids": "[3]"}, {"stop_token_ids": [3]}),
    ({"num_speculative_tokens": "0"}, {"num_speculative_tokens": 0}),
    ({"binary_data_output": True, "max_tokens": 3}, {"max_tokens": 3}),   # transport, ignored
])
def test_request_parameter_spellings(raw, expected):
    params = parse(raw).params
    for key, value in expected.items():
        assert getattr(params, key) == value, key


def test_the_same_value_twice_in_two_spellings_is_one_value():
    # vLLM backend clients send sampling_parameters and the same keys as request parameters
    sampling = np.array([json.dumps({"temperature": 0, "max_tokens": 4, "stop": ["a"]}).encode()],
                        dtype=np.object_)
    parsed = parse({"temperature": "0", "max_tokens": "4", "stop": '["a"]'},
                   sampling_parameters=sampling)
    assert (parsed.params.temperature, parsed.params.max_tokens, parsed.params.stop) == (0.0, 4, ["a"])


def test_sampling_parameters_json_and_request_parameters_merge():
    sampling = np.array([json.dumps({"max_tokens": 5}).encode()], dtype=np.object_)
    parsed = parse({"temperature": "0.5", "seed": "3"}, sampling_parameters=sampling)
    assert (parsed.params.max_tokens, parsed.params.temperature, parsed.params.seed) == (5, 0.5, 3)


@pytest.mark.parametrize("kwargs,needle", [
    ({"parameters": {"max_tokens": "1.5"}}, "max_tokens must be an integer"),
    ({"parameters": {"max_tokens": True}}, "max_tokens must be an integer"),
    ({"parameters": {"temperature": "nan"}}, "finite"),
    ({"parameters": {"temperature": "inf"}}, "finite"),
    ({"parameters": {"top_k": "ten"}}, "top_k must be an integer"),
    ({"parameters": {"ignore_eos": 2}}, "ignore_eos must be true or false"),
    ({"parameters": {"stop": '["a", 1]'}}, "stop must be"),
    ({"parameters": {"stop": "[oops"}}, "does not parse"),
    ({"parameters": {"n": "0"}}, r"n must be an integer in \[1, 16\]"),
    ({"parameters": {"n": 2, "best_of": "3"}}, "best_of=3 is not supported with n=2"),
    ({"parameters": {"length_penalty": "0.5"}}, "length_penalty='0.5' is not supported"),
    ({"parameters": {"prompt_logprobs": 1}}, "prompt_logprobs only as null or empty"),
    ({"parameters": {"frequency_penalty": "2.5"}}, r"frequency_penalty must be in \[-2, 2\], got 2.5."),
    ({"parameters": {"logit_bias": '{"5": "x"}'}}, "logit_bias must be a number"),
    ({"parameters": {"logit_bias": "[1]"}}, "logit_bias must map token ids to numbers"),
    ({"parameters": {"min_tokens": 9, "max_tokens": 4}}, "min_tokens must be less than or equal to max_tokens=4"),
    ({"parameters": {"lora_name": "sql"}}, "lora_name only as null or empty"),
    ({"parameters": {"logprobs": 21}}, r"logprobs must be an integer in \[0, 20\]"),
    ({"parameters": {"logprobs": True}}, "logprobs must be an integer"),
    ({"parameters": {"banana": 1}}, "unknown sampling parameter 'banana'"),
    ({"sampling_parameters": np.array([b'{"max_tokens": 2}'], dtype=np.object_),
      "parameters": {"max_tokens": 3}}, "given twice"),
    ({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}, "not valid UTF-8"),
    ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "exactly one string"),
    ({"input_ids": np.array([], dtype=np.int64), "text_input": None}, "input_ids is empty"),
    ({"stream": np.array([True]), "exclude_input_in_output": np.array([False])},
     "^Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed.$"),
])
def test_problems_are_named(kwargs, needle):
    parameters = kwargs.pop("parameters", None)
    with pytest.raises(InvalidRequestError, match=needle):
        parse(parameters, **kwargs)


def test_logprob_outputs_ask_the_engine_for_logprobs():
    assert parse(return_cumulative_logprob=np.array([True])).params.logprobs == 0
    assert parse().params.logprobs is None


@pytest.mark.parametrize("logprobs,return_logprobs,cumulative,engine,output", [
    (2, True, False, 2, 2),        # top 2 asked and returned
    (None, True, False, None, None),   # return_logprobs alone: null, as in vLLM
    (3, False, False, 3, 3),       # asked for but not returned (as in vLLM)
    (None, False, True, 0, None),  # cumulative_logprob needs the chosen tokens' logprobs only
    (0, True, True, 0, 0),
])
def test_logprobs_key_and_flags(logprobs, return_logprobs, cumulative, engine, output):
    parsed = parse({} if logprobs is None else {"logprobs": logprobs},
                   return_logprobs=np.array([return_logprobs]),
                   return_cumulative_logprob=np.array([cumulative]))
    assert (parsed.params.logprobs, parsed.logprobs) == (engine, output)


# What Triton's OpenAI frontend sends for a plain completion (vLLM's defaults), plus the rest of
# vLLM's keys at their neutral values, as strings the way gRPC clients send them.
NEUTRAL_REQUEST = {"n": 1, "best_of": 1, "frequency_penalty": 0, "presence_penalty": 0.0,
                   "ignore_eos": False, "temperature": 0.0, "top_p": 1.0, "max_tokens": 4,
                   "repetition_penalty": "1", "min_tokens": "0", "min_p": 0, "logit_bias": {},
                   "skip_special_tokens": "true", "include_stop_str_in_output": False,
                   "lora_name": None, "seed": None, "bad_words": [], "stop": None}


def test_logits_processing_keys_parse_from_json_and_strings():
    """vLLM's processing keys reach SamplingParams typed, from either spelling (gRPC sends strings)."""
    typed = {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": -0.5,
             "min_p": 0.1, "min_tokens": 3, "logit_bias": {"5": -100, "7": 2.5},
             "allowed_token_ids": [5, 7, 9], "bad_words": ["foo bar", "baz"]}
    strings = {key: value if key == "bad_words" else json.dumps(value) for key, value in typed.items()}
    from_json = parse(sampling_parameters=np.array([json.dumps(typed).encode()], dtype=np.object_)).params
    from_strings = parse(strings).params
    assert from_json == from_strings
    assert (from_json.logit_bias, from_json.min_tokens, from_json.bad_words) == (
        {5: -100.0, 7: 2.5}, 3, ["foo bar", "baz"])


def test_vllm_neutral_values_are_accepted_and_change_nothing():
    sampling = np.array([json.dumps(NEUTRAL_REQUEST).encode()], dtype=np.object_)
    parsed = parse(sampling_parameters=sampling)
    plain = parse({"temperature": 0.0, "top_p": 1.0, "max_tokens": 4})
    assert parsed.params == plain.params


def test_triton_transport_parameters_are_not_sampling_parameters():
    # the HTTP generate endpoint passes the body's "id" on as a request parameter
    assert parse({"id": "42", "max_tokens": 3}).params == parse({"max_tokens": 3}).params


def test_prepend_rule():
    assert parse().prepend_prompt
    assert not parse(exclude_input_in_output=np.array([True])).prepend_prompt
    assert not parse(stream=np.array([True])).prepend_prompt


def test_oversized_request_is_refused_before_parsing():
    import numpy as np
    from exspec_request import request_bytes
    inputs = {"text_input": np.array([b"x" * 5000], dtype=object)}
    assert request_bytes(inputs, "{}") == 5002
    with pytest.raises(InvalidRequestError, match="request is 5002 bytes; the limit is 4096"):
        parse_request(inputs, "{}", max_request_bytes=4096)
    assert parse_request(inputs, "{}", max_request_bytes=8192).prompt == "x" * 5000


SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize("raw", [
    {"structured_outputs": {"json": SCHEMA}},
    {"structured_outputs": json.dumps({"json": SCHEMA})},
    {"structured_outputs": {"json": json.dumps(SCHEMA), "backend": "xgrammar"}},
    {"guided_decoding": json.dumps({"json": json.dumps(SCHEMA), "regex": None, "choice": None,
                                    "grammar": None, "json_object": None, "backend": None,
                                    "whitespace_pattern": None, "structural_tag": None})},
    {"guided_decoding": {"guided_json": SCHEMA}},
    {"guided_json": json.dumps(SCHEMA)},
    {"guided_decoding": {"regex": "x"}, "structured_outputs": {"json": SCHEMA}},   # vllm_backend: it wins
])
def test_structured_outputs_spellings(raw):
    """vLLM's structured_outputs, its older guided_decoding (a JSON string as vllm_backend and
    Triton's OpenAI frontend send it, or an object; fields with or without guided_) and the
    OpenAI server's top-level guided_json: one constraint, the schema's key order kept."""
    spec = parse(raw).params.structured_outputs
    assert spec.kind == "json" and list(json.loads(spec.text)["properties"]) == ["b", "a"]


@pytest.mark.parametrize("raw,needle", [
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"structured_outputs": "{oops"}, "not valid JSON"),
    ({"structured_outputs": {"json": 3}}, "must be a JSON schema"),
    ({"structured_outputs": {"choice": "yes"}}, "choice must be a non-empty list"),
    ({"structured_outputs": {"whitespace_pattern": " *", "regex": "a"}}, "whitespace_pattern"),
    ({"guided_decoding": {"schema": {}}}, "unknown field"),
    ({"guided_regex": "a", "guided_decoding": {"regex": "b"}}, "not both"),
])
def test_bad_structured_outputs_name_the_problem(raw, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        parse(raw)


def test_messages_parse_and_render_through_the_chat_template():
    """`messages` (JSON text) is a chat: rendered by the tokenizer's own template, the rendered
    prompt left out of a non-streamed answer unless asked for; a tokenizer without a template
    is refused naming the fix."""
    from transformers import AutoTokenizer

    from exspec_request import render_chat
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    parsed = parse(text_input=None, messages=_text(json.dumps(chat)))
    assert parsed.prompt is None and parsed.messages == chat and not parsed.prepend_prompt
    assert parse(text_input=None, messages=_text(json.dumps(chat)),
                 exclude_input_in_output=np.array([False])).prepend_prompt
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    assert render_chat(tokenizer, chat) == tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False)
    tokenizer.chat_template = None
    with pytest.raises(InvalidRequestError, match="no chat template; send the prompt as text_input"):
        render_chat(tokenizer, chat)


@pytest.mark.parametrize("raw, needle", [
    ("hello", "messages must be a JSON list as text"),
    ('{"role": "user", "content": "hi"}', "non-empty JSON list"),
    ('[{"role": "user", "content": 3}]', "messages[0] must be an object with string role and content"),
])
def test_malformed_messages_are_named(raw, needle):
    with pytest.raises(InvalidRequestError, match=re.escape(needle)):
        parse(text_input=None, messages=_text(raw))
    with pytest.raises(InvalidRequestError, match="not two"):
        parse(messages=_text('[{"role": "user", "content": "hi"}]'))


def _strings(*values):
    return np.array([v.encode() for v in values], dtype=np.object_)


@pytest.mark.parametrize("tensor,expected", [
    (_strings("five", "six"), ["five", "six"]),   # HTTP generate's top-level "stop": [...]
    (_strings("five"), ["five"]),
    (_strings('["a", "b"]'), ["a", "b"]),         # one element reads like the parameter's string
])
def test_the_stop_input_holds_the_stop_strings(tensor, expected):
    assert parse(stop=tensor).params.stop == expected


def test_stop_given_twice_with_different_values_names_both_places():
    sampling = np.array([json.dumps({"stop": ["a"]}).encode()], dtype=np.object_)
    assert parse(stop=_strings("a"), sampling_parameters=sampling).params.stop == ["a"]
    with pytest.raises(InvalidRequestError, match=r"'stop' given twice .*sampling_parameters: \['a'\], stop input"):
        parse(stop=_strings("b", "c"), sampling_parameters=sampling)


def test_category_is_the_requests_label_from_either_place_and_not_a_sampling_parameter():
    """`category` (record_traffic's column) is taken from the request parameters or the
    sampling_parameters JSON, never refused as unknown; a non-string or two different values
    are refused, naming it."""
    assert parse().category is None
    assert parse({"category": "chat"}).category == "chat"
    sampling = np.array([json.dumps({"category": "code", "max_tokens": 3}).encode()], dtype=np.object_)
    parsed = parse(sampling_parameters=sampling)
    assert (parsed.category, parsed.params.max_tokens) == ("code", 3)
    assert parse({"category": 7}).category == "7"
    with pytest.raises(InvalidRequestError, match="category must be a string"):
        parse({"category": ["a"]})
    with pytest.raises(InvalidRequestError, match="'category' given twice"):
        parse({"category": "chat"}, sampling_parameters=sampling)
