"""n > 1 through a real tritonserver, as Triton's vLLM backend returns it: one response whose
text_output (and finish_reason, num_output_tokens, cumulative_logprob) holds one element per
sample; sample i is the in-process engine's sample i (seed + i); streamed, each response carries
one sample's delta at its position; cancelling ends every sample; bad n / best_of get INVALID_ARG.
"""
from __future__ import annotations

from clients import first_response_then_cancel, generate, grpc_inputs, grpc_one, http_infer
from serverkit import scrape, wait_for

PROMPT = "def add(a, b):"
SEEDED = {"n": 2, "max_tokens": 10, "temperature": 1.0, "seed": 11, "ignore_eos": True}
FLAGS = dict(return_finish_reason=True, return_num_output_tokens=True,
             return_cumulative_logprob=True)


def texts(response) -> list[str]:
    return [t.decode("utf-8") for t in response.outputs["text_output"].reshape(-1)]


def engine_samples(engine, sampling: dict) -> list:
    from exspec import SamplingParams
    return engine.generate([PROMPT], [SamplingParams(**sampling)])


def test_n_2_returns_both_samples_in_one_response(server, engine):
    call = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, sampling=SEEDED, stream=False,
                    exclude_input_in_output=True, **FLAGS)
    [response] = call.responses
    assert response.error is None and response.final, response.error
    expected = engine_samples(engine, SEEDED)
    assert texts(response) == [s.text for s in expected], "served samples differ from the engine's"
    assert response.ids() == expected[0].token_ids + expected[1].token_ids
    assert [s.decode() for s in response.outputs["finish_reason"]] == ["length", "length"]
    assert response.outputs["num_output_tokens"].tolist() == [10, 10]
    assert response.outputs["cumulative_logprob"].shape == (2,)
    assert texts(response)[0] != texts(response)[1], "seeds seed + i gave the same sample"


def test_seeded_samples_are_reproducible_and_each_a_lone_request_with_seed_plus_i(server):
    url = server.urls["grpc"]
    first, again = (grpc_one(url, "exspec", prompt=PROMPT, sampling=SEEDED, stream=False,
                             exclude_input_in_output=True).responses[0] for _ in range(2))
    assert texts(first) == texts(again), "the same seeded n = 2 request gave other samples"
    lone = [grpc_one(url, "exspec", prompt=PROMPT, stream=False, exclude_input_in_output=True,
                     sampling={**SEEDED, "n": 1, "seed": SEEDED["seed"] + i}).responses[0]
            for i in range(2)]
    assert texts(first) == [texts(r)[0] for r in lone]


def test_prompt_is_prepended_to_every_sample_and_http_generate_lists_them(server):
    status, body = generate(server.urls["http"], "exspec",
                            {"text_input": PROMPT, **SEEDED, "exclude_input_in_output": False})
    assert status == 200, body
    assert isinstance(body["text_output"], list) and len(body["text_output"]) == 2, body
    assert all(t.startswith(PROMPT) and len(t) > len(PROMPT) for t in body["text_output"]), body


def test_unary_front_model_returns_the_same_samples(server):
    """exspec_unary forwards through BLS: its one response holds both samples, the prompt
    prepended (unary never excludes it by default)."""
    result = http_infer(server.urls["http"], "exspec_unary", PROMPT, parameters=SEEDED)
    unary = [t.decode("utf-8") for t in result.as_numpy("text_output").reshape(-1)]
    whole = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, sampling=SEEDED, stream=False,
                     exclude_input_in_output=True).responses[0]
    assert unary == [PROMPT + text for text in texts(whole)]


def test_streamed_samples_arrive_at_their_positions_and_join_to_the_whole(server):
    url = server.urls["grpc"]
    whole = grpc_one(url, "exspec", prompt=PROMPT, sampling=SEEDED, stream=False,
                     exclude_input_in_output=True).responses[0]
    call = grpc_one(url, "exspec", prompt=PROMPT, sampling=SEEDED, stream=True,
                    return_finish_reason=True)
    assert [r.final for r in call.responses].count(True) == 1 and call.responses[-1].final
    joined, reasons = ["", ""], [[], []]
    for r in call.responses:
        assert r.error is None, r.error
        parts = texts(r)
        assert len(parts) == 2, f"a streamed response holds {len(parts)} samples"
        counts = [len(p) > 0 for p in parts]
        assert sum(counts) <= 1, f"a streamed response carries two samples' text: {parts}"
        for i, part in enumerate(parts):
            joined[i] += part
            reasons[i].append(r.outputs["finish_reason"][i].decode())
    assert joined == texts(whole)
    for i, rs in enumerate(reasons):   # a sample's reason once, on its last delta; else "None"
        assert rs.count("length") == 1 and set(rs) == {"length", "None"}, f"sample {i}: {rs}"


def test_cancelling_ends_every_sample(server):
    cancelled = scrape(server, "exspec:requests_total", model="exspec", outcome="cancelled")
    tokens_before = scrape(server, "exspec:generation_tokens_total", model="exspec")
    result = first_response_then_cancel(server.urls["grpc"], "exspec", grpc_inputs(
        prompt="hello", stream=True,
        sampling={"n": 3, "max_tokens": 480, "ignore_eos": True, "temperature": 1.0}))
    assert result.as_numpy("text_output").shape == (3,)
    wait_for(lambda: scrape(server, "exspec:requests_total", model="exspec",
                            outcome="cancelled") == cancelled + 1,
             what="the cancelled n = 3 request to be counted once")
    wait_for(lambda: scrape(server, "exspec:num_requests_running", model="exspec") == 0,
             what="every sample to leave the pool")
    generated = scrape(server, "exspec:generation_tokens_total", model="exspec") - tokens_before
    assert generated < 3 * 480, f"the samples ran to the end ({generated} tokens)"
    call = grpc_one(server.urls["grpc"], "exspec", prompt="hello", sampling={"max_tokens": 4})
    assert call.responses[-1].final and len(call.ids()) == 4, "the server did not carry on"


def test_bad_n_and_best_of_get_invalid_arg_naming_them(server):
    for sampling, needle in [({"n": 0}, "n must be an integer in [1, 16]"),
                             ({"n": 17}, "n must be an integer in [1, 16]"),
                             ({"n": 2, "best_of": 3}, "best_of=3 is not supported with n=2"),
                             ({"n": "two"}, "n must be an integer")]:
        [response] = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT,
                              sampling=sampling).responses
        assert response.final and needle in (response.error or ""), f"{sampling}: {response}"
        status, body = generate(server.urls["http"], "exspec", {"text_input": PROMPT, **sampling})
        assert status == 400 and needle in body["error"], (sampling, status, body)


def test_metrics_count_the_request_once_with_its_n_and_every_samples_tokens(server):
    """tokenwise publishes the vLLM backend's vllm: families: vllm:request_params_n observes the
    request's n once; the generation counters take both samples' tokens."""
    def now():   # one scrape per name: the request counter first, as the server counts it last,
        # so a request it shows is already in every later scrape of the others
        return {name: scrape(server, name, model="tokenwise") for name in (
            "exspec:requests_total", "vllm:request_params_n_count", "vllm:request_params_n_sum",
            "vllm:generation_tokens_total")}

    before = now()
    call = grpc_one(server.urls["grpc"], "tokenwise", prompt=PROMPT, sampling=SEEDED, stream=False,
                    exclude_input_in_output=True)
    assert call.responses[-1].error is None, call.responses[-1].error
    after = wait_for(lambda: (lambda m: m if m["exspec:requests_total"] > before[
        "exspec:requests_total"] else None)(now()), what="the request to be counted")
    delta = {name: after[name] - before[name] for name in after}
    assert delta == {"vllm:request_params_n_count": 1, "vllm:request_params_n_sum": 2,
                     "vllm:generation_tokens_total": 2 * SEEDED["max_tokens"],
                     "exspec:requests_total": 1}, delta
