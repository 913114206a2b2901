"""The response rules (design: "The Triton adapter"), input/return flags, parameter parsing and
bad inputs."""
from __future__ import annotations

import itertools
import json
import urllib.request

import pytest

from clients import event_ids, generate, grpc_one, grpc_stream

PROMPT = "def add(a, b):"


def test_stream_true_sends_deltas_with_final_flag_on_last_data_response(server):
    call = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, stream=True,
                    sampling={"max_tokens": 17}, return_finish_reason=True,
                    return_num_output_tokens=True, return_num_input_tokens=True)
    rs = call.responses
    assert len(rs) >= 2, "17 tokens in one response: no streaming happened"
    assert [r.final for r in rs] == [False] * (len(rs) - 1) + [True]
    assert all(r.error is None and "text_output" in r.outputs for r in rs), "a response without data"
    reasons = [r.outputs["finish_reason"][0].decode() for r in rs]
    assert reasons == ["None"] * (len(rs) - 1) + ["length"]
    deltas = [int(r.outputs["num_output_tokens"][0]) for r in rs]
    assert deltas == [len(r.ids()) for r in rs] and sum(deltas) == 17
    assert all(d >= 1 for d in deltas[:-1]), f"an intermediate response committed no token: {deltas}"
    drafted = [int(r.outputs["total_draft_tokens"][0]) for r in rs]
    accepted = [int(r.outputs["total_accepted_draft_tokens"][0]) for r in rs]
    assert drafted == sorted(drafted) and accepted == sorted(accepted), "stats are not cumulative"
    last = rs[-1].outputs
    assert last["acceptance_rate"][0] == pytest.approx(accepted[-1] / max(drafted[-1], 1), abs=1e-6)
    assert int(last["num_input_tokens"][0]) > 0


def test_stream_false_sends_exactly_one_final_response_with_totals(server):
    call = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, stream=False,
                    sampling={"max_tokens": 9}, return_num_output_tokens=True)
    assert len(call.responses) == 1 and call.responses[0].final
    only = call.responses[0]
    assert int(only.outputs["num_output_tokens"][0]) == 9 == len(only.ids())
    assert only.text().startswith(PROMPT)


@pytest.mark.parametrize("stream,exclude,prepended", [
    (False, None, True), (False, True, False), (False, False, True),
    (True, None, False), (True, True, False)])
def test_exclude_input_in_output(server, stream, exclude, prepended):
    flags = {"stream": stream}
    if exclude is not None:
        flags["exclude_input_in_output"] = exclude
    call = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, sampling={"max_tokens": 6},
                    **flags)
    alone = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, sampling={"max_tokens": 6},
                     stream=False, exclude_input_in_output=True).text()
    assert call.text() == (PROMPT + alone if prepended else alone)


def test_exclude_input_false_while_streaming_is_invalid(server):
    call = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, stream=True,
                    exclude_input_in_output=False)
    # A gRPC stream carries only the error's message (no status code); one final response.
    assert len(call.responses) == 1 and call.responses[0].final
    assert "exclude_input_in_output" in (call.responses[0].error or ""), call.responses[0]


RETURNS = {"return_finish_reason": "finish_reason", "return_num_input_tokens": "num_input_tokens",
           "return_num_output_tokens": "num_output_tokens", "return_logprobs": "logprobs",
           "return_cumulative_logprob": "cumulative_logprob"}


def _pairwise_flag_sets():
    """Every pair of return flags on and off together (all off, all on, each alone and with
    each other flag): covers the combinations pairwise without all 32 subsets."""
    names = list(RETURNS)
    sets = [dict.fromkeys(names, False), dict.fromkeys(names, True)]
    for a, b in itertools.combinations(names, 2):
        sets.append({n: n in (a, b) for n in names})
    return sets


def test_return_flags_add_exactly_their_outputs(server):
    for stream in (False, True):
        for flags in _pairwise_flag_sets():
            status, body = generate(server.urls["http"], "exspec",
                                    {"text_input": PROMPT, "max_tokens": 4, "stream": stream,
                                     **flags}) if not stream else _last_event(server, flags)
            assert status == 200, body
            for flag, output in RETURNS.items():
                assert (output in body) == flags[flag], f"stream={stream} {flags}: {sorted(body)}"
            for always in ("text_output", "output_ids", "acceptance_rate",
                           "total_accepted_draft_tokens", "total_draft_tokens"):
                assert always in body, f"{always} missing with {flags}"


def _last_event(server, flags):
    from clients import generate_stream
    status, events = generate_stream(server.urls["http"], "exspec",
                                     {"text_input": PROMPT, "max_tokens": 4, "stream": True, **flags})
    return status, events[-1]


def test_input_ids_in_output_ids_out(server, hf_target):
    _, tokenizer = hf_target
    ids = tokenizer(PROMPT, add_special_tokens=False).input_ids
    by_ids = grpc_one(server.urls["grpc"], "exspec", input_ids=ids, sampling={"max_tokens": 8})
    by_text = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, sampling={"max_tokens": 8})
    assert by_ids.ids() == by_text.ids() and len(by_ids.ids()) == 8
    assert by_ids.text() == by_text.text()   # the prompt, decoded from the ids, comes first


def test_request_parameters_as_strings_parse_like_json(server):
    as_strings = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, exclude_input_in_output=True,
                          parameters={"max_tokens": "5", "temperature": "0.8", "seed": "7",
                                      "top_k": "50", "ignore_eos": "true", "stop": "[]"})
    as_json = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, exclude_input_in_output=True,
                       sampling={"max_tokens": 5, "temperature": 0.8, "seed": 7, "top_k": 50,
                                 "ignore_eos": True, "stop": []})
    assert len(as_strings.ids()) == 5
    assert as_strings.ids() == as_json.ids(), "same seed, same parameters, different spelling"


def test_per_request_num_speculative_tokens_zero_is_plain_decoding(server):
    spec = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, sampling={"max_tokens": 10})
    plain = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT,
                     sampling={"max_tokens": 10, "num_speculative_tokens": 0})
    assert plain.ids() == spec.ids()
    assert int(plain.responses[-1].outputs["total_draft_tokens"][0]) == 0


BAD_INPUTS = [
    ({}, "missing prompt"),
    ({"text_input": ""}, "empty"),
    ({"text_input": PROMPT, "sampling_parameters": "{not json"}, "not valid JSON"),
    ({"text_input": PROMPT, "sampling_parameters": "[1, 2]"}, "JSON object"),
    ({"text_input": PROMPT, "max_tokens": -1}, "max_tokens"),
    ({"text_input": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"text_input": PROMPT, "max_tokens": 10 ** 9}, "max_tokens"),
    ({"text_input": PROMPT, "max_tokens": "many"}, "max_tokens must be an integer"),
    ({"text_input": PROMPT, "banana": 1}, "unknown sampling parameter 'banana'"),
    ({"text_input": PROMPT, "temperature": "hot"}, "temperature must be a number"),
    ({"text_input": PROMPT, "sampling_parameters": '{"temperature": NaN}'}, "finite"),
    ({"text_input": PROMPT, "top_p": 0}, "top_p"),
    ({"text_input": PROMPT, "ignore_eos": "perhaps"}, "ignore_eos must be true or false"),
    ({"text_input": PROMPT, "stop_token_ids": "[1, -2]"}, "stop_token_ids"),
    ({"text_input": "hello " * 700}, "prompt has"),
    ({"text_input": PROMPT, "input_ids": [1, 2]}, "not both"),
    ({"input_ids": [1, 10 ** 6]}, "token ids"),
    ({"text_input": PROMPT, "stream": True, "exclude_input_in_output": False},
     "exclude_input_in_output"),
]


@pytest.mark.parametrize("body,needle", BAD_INPUTS, ids=[n for _, n in BAD_INPUTS])
def test_bad_input_is_invalid_arg_naming_the_problem(server, body, needle):
    status, answer = generate(server.urls["http"], "exspec", body)
    assert status == 400, f"{body}: HTTP {status} {answer}"
    assert needle in answer.get("error", ""), f"{body}: {answer}"


def test_server_ready_and_serving_after_bad_inputs(server):
    for body, _ in BAD_INPUTS[:5]:
        generate(server.urls["http"], "exspec", body)
    with urllib.request.urlopen(server.urls["http"] + "/v2/health/ready", timeout=5) as r:
        assert r.status == 200
    status, body = generate(server.urls["http"], "exspec", {"text_input": PROMPT, "max_tokens": 3})
    assert status == 200 and len(event_ids(body)) == 3


def test_bad_input_over_grpc_stream_gets_one_error_response(server):
    calls = grpc_stream(server.urls["grpc"], "exspec",
                        [{"prompt": PROMPT, "sampling": '{"top_k": "x"}', "stream": True}])
    (only,) = calls[0].responses
    assert only.final and "top_k must be an integer" in (only.error or ""), only


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_input_over_unary_infer_is_invalid_argument(server, protocol):
    from tritonclient.utils import InferenceServerException
    from clients import grpc_infer, http_infer
    call = http_infer if protocol == "http" else grpc_infer
    with pytest.raises(InferenceServerException) as info:
        call(server.urls[protocol], "exspec_unary", PROMPT, {"temperature": "hot"})
    assert "temperature must be a number" in info.value.message()
    if protocol == "grpc":
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    else:
        assert info.value.status() == "400"
