"""Streamed text pieces join to exactly the non-streamed text, with multi-byte characters split
across byte-level tokens and a stop string spanning several tokens (the `scripted` model's
greedy output cycles through serverkit.SCRIPT)."""
from __future__ import annotations

import json

import pytest

from clients import generate, generate_stream, grpc_one
from serverkit import SCRIPT

STOP = " STOP here"   # five tokens in the test tokenizer: ' ', 'ST', 'OP', ' he', 're'


def _unary_text(server, prompt, **sampling) -> str:
    # sampling_parameters JSON: HTTP generate takes only int, bool and string parameters.
    status, body = generate(server.urls["http"], "scripted",
                            {"text_input": prompt, "exclude_input_in_output": True,
                             "sampling_parameters": json.dumps(sampling)})
    assert status == 200, body
    return body["text_output"]


@pytest.mark.parametrize("prompt", ["日本", "hello", "🚀"])
def test_streamed_deltas_join_to_the_unary_text_byte_for_byte(server, prompt):
    whole = _unary_text(server, prompt, max_tokens=40)
    # max_tokens may cut the last character short: the final text then ends in U+FFFD.
    assert whole.rstrip("\ufffd") in SCRIPT * 5 and "🚀" in whole and "ü" in whole, f"script not followed: {whole!r}"
    call = grpc_one(server.urls["grpc"], "scripted", prompt=prompt, stream=True,
                    sampling={"max_tokens": 40})
    pieces = [r.outputs["text_output"][0] for r in call.responses]   # raw UTF-8 bytes
    for piece in pieces:
        piece.decode("utf-8")   # never a partial character, whatever the token split
    assert b"".join(pieces) == whole.encode("utf-8")
    status, events = generate_stream(server.urls["http"], "scripted",
                                     {"text_input": prompt, "stream": True, "max_tokens": 40})
    assert status == 200 and "".join(e["text_output"] for e in events) == whole


def test_multi_token_stop_string_is_never_streamed(server):
    unstopped = _unary_text(server, "日本", max_tokens=40)
    assert STOP in unstopped
    expected = unstopped[:unstopped.index(STOP)]
    stopped = _unary_text(server, "日本", max_tokens=40, stop=[STOP])
    assert stopped == expected
    call = grpc_one(server.urls["grpc"], "scripted", prompt="日本", stream=True,
                    sampling={"max_tokens": 40, "stop": [STOP]}, return_finish_reason=True)
    pieces = [r.text() for r in call.responses]
    # The pieces join to the text before the stop string, which ends in no prefix of it: so no
    # piece ever carried a part of the matched stop string.
    assert not any(expected.endswith(STOP[:i]) for i in range(1, len(STOP) + 1))
    assert "".join(pieces) == expected, pieces
    assert call.responses[-1].outputs["finish_reason"][0].decode() == "stop"


def test_stop_string_as_request_parameter_string(server):
    expected = _unary_text(server, "日本", max_tokens=40, stop=[STOP])
    # A gRPC request parameter can only be a string: a JSON list in a string parses as a list.
    call = grpc_one(server.urls["grpc"], "scripted", prompt="日本", exclude_input_in_output=True,
                    parameters={"max_tokens": 40, "stop": f'["{STOP}"]'})
    assert call.text() == expected
