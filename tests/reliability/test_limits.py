"""Limits, through the real server, each refused with an error a person can act on while the
server carries on: prompt tokens, request size, max_tokens, the pool and queue (busy: retry), and
the per-request parameter ranges. The `limits` model sets them in model.json (reliabilitykit.LIMITS)."""
from __future__ import annotations

import concurrent.futures as cf

import pytest

from reliabilitykit import LIMITS, clients, fill_pool_and_queue, ready


def one(server, model="limits", **request):
    return clients.grpc_stream(server.urls["grpc"], model, [request], timeout_s=60)[0]


def error_of(call) -> str | None:
    assert sum(r.final for r in call.responses) == 1 and call.responses[-1].final, call
    return call.responses[-1].error


def test_prompt_over_max_prompt_tokens_is_refused(rel_server):
    limit = LIMITS["max_prompt_tokens"]
    err = error_of(one(rel_server, prompt="hello world " * 40))
    assert err and f"the limit is {limit}" in err, err
    err = error_of(one(rel_server, input_ids=[5] * (limit + 1)))
    assert err and f"prompt has {limit + 1} tokens; the limit is {limit}" in err, err
    assert error_of(one(rel_server, input_ids=[5] * limit, sampling={"max_tokens": 2})) is None


def test_very_large_request_is_refused_and_the_server_carries_on(rel_server):
    # A 1 MiB prompt is refused by max_request_bytes before it is parsed or tokenized
    # (over gRPC and HTTP alike).
    big = "x" * (1 << 20)
    err = error_of(one(rel_server, prompt=big))
    assert err and "bytes; the limit is 65536" in err, err[:300]
    status, body = clients.generate(rel_server.urls["http"], "limits", {"text_input": big})
    assert status == 400 and "bytes; the limit is 65536" in body["error"], (status, str(body)[:300])
    assert ready(rel_server, "limits")


def test_max_tokens_over_max_output_tokens_is_refused(rel_server):
    limit = LIMITS["max_output_tokens"]
    err = error_of(one(rel_server, prompt="hello", sampling={"max_tokens": limit + 1}))
    assert err == f"max_tokens {limit + 1} exceeds the server limit of {limit}", err
    call = one(rel_server, prompt="hello", sampling={"max_tokens": limit, "ignore_eos": True})
    assert error_of(call) is None and len(call.ids()) == limit


def test_full_pool_and_queue_refuse_with_busy_retry(rel_server):
    # Holders fill the pool and then the queue of `busy` (the limits model with slowed ticks).
    # Each asks for max_output_tokens one token a tick (no speculation), so they hold for
    # seconds: the request sent once the metrics show both full is refused whatever the
    # machine's load (a burst of requests could drain through the fast tiny pair unrefused).
    slots, queue = LIMITS["max_num_seqs"], LIMITS["max_queue_len"]
    hold = {"max_tokens": LIMITS["max_output_tokens"], "ignore_eos": True,
            "num_speculative_tokens": 0}
    send = lambda i: one(rel_server, "busy", prompt=f"hold {i}", sampling=hold)   # noqa: E731
    with cf.ThreadPoolExecutor(slots + queue) as pool:
        holders = fill_pool_and_queue(rel_server, "busy", pool, send, slots, queue)
        err = error_of(one(rel_server, "busy", prompt="one too many", sampling={"max_tokens": 4}))
        assert err and "server busy" in err and "retry later" in err, err
        held = [h.result() for h in holders]
    for call in held:   # the refusal cost the holders nothing
        assert error_of(call) is None and len(call.ids()) == LIMITS["max_output_tokens"], call
    # Once the pool drains, a retry is served.
    assert error_of(one(rel_server, "busy", prompt="hello", sampling={"max_tokens": 4})) is None


@pytest.mark.parametrize("sampling,needle", [
    ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
    ({"temperature": "nan"}, "temperature must be a finite number"),
    ({"temperature": "inf"}, "temperature must be a finite number"),
    ({"top_p": 0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.01}, "top_p must be in (0, 1]"),
    ({"top_k": -2}, "top_k must be an integer >= 0 (or -1 for off)"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"seed": -1}, "seed must be an integer in [0, 2^63)"),
    ({"seed": 2 ** 63}, "seed must be an integer in [0, 2^63)"),
    ({"stop": [""]}, "stop must be a list of non-empty strings"),
    ({"stop": [1, 2]}, "stop must be a string or a list of strings"),
    ({"stop_token_ids": [-3]}, "stop_token_ids must be a list of non-negative integers"),
    ({"stop": ["a"] * 17}, "stop allows at most 16 strings"),
    ({"stop": ["a" * 257]}, "of at most 256 characters"),
    ({"num_speculative_tokens": -1}, "num_speculative_tokens must be an integer >= 0"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"ignore_eos": "perhaps"}, "ignore_eos must be true or false"),
    ({"beam_width": 4}, "unknown sampling parameter 'beam_width'"),
])
def test_out_of_range_parameter_is_invalid_arg_naming_it(rel_server, sampling, needle):
    err = error_of(one(rel_server, prompt="hello", sampling=sampling))
    assert err and needle in err, f"{sampling}: {err}"


def test_in_range_edges_are_served(rel_server):
    for sampling in ({"temperature": 0.0, "top_p": 1.0, "top_k": -1}, {"top_k": 0, "seed": 0},
                     {"temperature": 5.0, "top_p": 1e-9, "seed": 2 ** 63 - 1},
                     {"top_k": 10 ** 9, "num_speculative_tokens": 10 ** 6},
                     {"stop": ["a" * 256] * 16, "stop_token_ids": [10 ** 9] * 64}):
        call = one(rel_server, prompt="hello", sampling={**sampling, "max_tokens": 4})
        assert error_of(call) is None, f"{sampling}: {call.responses[-1].error}"
