"""The drop-in contract with Triton's vLLM backend (design: "The Triton adapter") on the real server: vLLM's
neutral sampling values and Triton's transport parameters, logprobs in vLLM's format and
meaning, its error text for streaming with the prompt, the streaming granularity, its vllm:
metric families under REPORT_CUSTOM_METRICS, and the unary model's max_tokens input."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient

from clients import generate, grpc_one, grpc_stream
from serverkit import SCRIPT, scrape, wait_for

PROMPT = "def add(a, b):"
# What the vLLM backend answers, word for word (its CI test matches the whole message).
VLLM_STREAM_ERROR = ("Error generating stream: When streaming, `exclude_input_in_output` = False "
                     "is not allowed.")


def _reference_logprobs(hf_target, prompt: str, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: the target's raw log-probabilities at each output position."""
    model, tokenizer = hf_target
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1:-1]
    return torch.log_softmax(logits.float(), -1)


def _token_entries(call) -> list[dict]:
    return [token for r in call.responses for token in json.loads(r.outputs["logprobs"][0])]


# -- 1. neutral values and transport parameters ----------------------------------------------------
def test_openai_frontend_sampling_keys_are_served_like_plain_ones(server):
    # What Triton's OpenAI frontend sends for a completion left at its defaults (older
    # releases also best_of), as the sampling_parameters JSON.
    openai = {"frequency_penalty": 0, "ignore_eos": False, "n": 1, "presence_penalty": 0,
              "temperature": 0, "top_p": 1, "max_tokens": 8, "best_of": 1, "min_tokens": 0,
              "repetition_penalty": 1.0}
    served = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, sampling=openai, stream=False,
                      exclude_input_in_output=True, return_logprobs=False,
                      return_num_input_tokens=True, return_num_output_tokens=True)
    plain = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, sampling={"max_tokens": 8},
                     stream=False, exclude_input_in_output=True)
    assert served.responses[0].error is None, served.responses[0].error
    assert served.ids() == plain.ids() and len(plain.ids()) == 8


@pytest.mark.parametrize("key,value", [("best_of", 3), ("length_penalty", 0.5),
                                       ("use_beam_search", "true"), ("lora_name", "sql-lora")])
def test_other_values_of_vllm_keys_are_refused_by_name(server, key, value):
    status, body = generate(server.urls["http"], "exspec", {"text_input": PROMPT, key: value})
    assert status == 400, body
    assert f"{key}={value!r} is not supported" in body["error"], body


def test_logits_processing_keys_are_served_as_the_engine_runs_them(server, engine):
    """vLLM's penalties, min_tokens, logit_bias and bad_words through the sampling_parameters
    JSON: the served tokens are the in-process engine's, and differ from the plain request's
    (logit_bias bans the plain output's third token)."""
    from exspec import SamplingParams
    plain = {"max_tokens": 12, "temperature": 0.8, "seed": 3}

    def served(sampling):
        call = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, sampling=sampling,
                        stream=True, exclude_input_in_output=True)
        assert call.responses[-1].error is None, call.responses[-1].error
        return call.ids()

    plain_ids = served(plain)
    processed = {**plain, "frequency_penalty": 1.5, "presence_penalty": 0.5,
                 "repetition_penalty": 1.3, "min_tokens": 12, "logit_bias": {str(plain_ids[2]): -100},
                 "bad_words": ["the"]}
    expected = engine.generate([PROMPT], [SamplingParams(**processed)])[0].token_ids
    assert served(processed) == expected
    assert plain_ids != expected, "the processing keys changed nothing"


def test_generate_body_id_is_not_a_sampling_parameter(server):
    status, body = generate(server.urls["http"], "exspec",
                            {"text_input": PROMPT, "id": "42", "max_tokens": 4})
    assert status == 200, body
    assert body["id"] == "42"


# -- 3. streaming with the prompt: vLLM's error -------------------------------------------------------
def test_exclude_input_false_while_streaming_has_vllm_error_text(server):
    call = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, stream=True,
                    exclude_input_in_output=False)
    assert len(call.responses) == 1 and call.responses[0].final
    assert call.responses[0].error == VLLM_STREAM_ERROR


# -- 2. logprobs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_n_gives_vllm_top_n_per_token(server, hf_target, stream):
    n, tokenizer = 3, hf_target[1]
    call = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, stream=stream,
                    exclude_input_in_output=True, sampling={"max_tokens": 8, "logprobs": n},
                    return_logprobs=True, return_cumulative_logprob=True)
    ids, tokens = call.ids(), _token_entries(call)
    assert len(ids) == len(tokens) == 8, (ids, tokens)
    reference = _reference_logprobs(hf_target, PROMPT, ids)
    for pos, (chosen, entries) in enumerate(zip(ids, tokens)):
        top = reference[pos].topk(n).indices.tolist()
        assert list(entries)[0] == str(chosen), f"position {pos}: the chosen token is not first"
        assert set(entries) == {str(chosen), *map(str, top)}, f"position {pos}: {entries}"
        for key, entry in entries.items():
            expected = reference[pos, int(key)]
            assert entry["logprob"] == pytest.approx(float(expected), abs=1e-4), (pos, key)
            assert entry["rank"] == int((reference[pos] >= expected).sum()), (pos, key)
            assert entry["decoded_token"] == tokenizer.decode([int(key)]), (pos, key)
        assert entries[str(chosen)]["rank"] == 1, f"greedy chose rank {entries[str(chosen)]}"
    chosen = [entries[str(t)]["logprob"] for t, entries in zip(ids, tokens)]
    running = [float(r.outputs["cumulative_logprob"][0]) for r in call.responses]
    sizes = np.cumsum([len(r.ids()) for r in call.responses])
    assert running == pytest.approx([sum(chosen[:s]) for s in sizes], abs=1e-3)


def test_logprobs_are_raw_under_sampling(server, hf_target):
    """vLLM's default logprobs mode (raw_logprobs): the model's distribution, not the
    temperature-scaled one sampled from; the sampled token's rank says how likely it was."""
    call = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, stream=False,
                    exclude_input_in_output=True, return_logprobs=True,
                    sampling={"max_tokens": 16, "logprobs": 0, "temperature": 2.0, "seed": 5,
                              "ignore_eos": True})
    ids, tokens = call.ids(), _token_entries(call)
    reference = _reference_logprobs(hf_target, PROMPT, ids)
    ranks = []
    for pos, (chosen, entries) in enumerate(zip(ids, tokens)):
        assert list(entries) == [str(chosen)], f"logprobs 0: only the chosen token, got {entries}"
        entry = entries[str(chosen)]
        assert entry["logprob"] == pytest.approx(float(reference[pos, chosen]), abs=1e-4), pos
        assert entry["rank"] == int((reference[pos] >= reference[pos, chosen]).sum()), pos
        ranks.append(entry["rank"])
    assert max(ranks) > 1, f"temperature 2 never sampled below the top token: {ranks}"


@pytest.mark.parametrize("stream", [False, True])
def test_return_logprobs_without_logprobs_is_null(server, stream):
    call = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, stream=stream,
                    exclude_input_in_output=True, sampling={"max_tokens": 4}, return_logprobs=True)
    values = [json.loads(r.outputs["logprobs"][0]) for r in call.responses]
    assert values and values == [None] * len(values)


# -- 4. streaming granularity ----------------------------------------------------------------------------
def test_default_streams_one_response_per_engine_step(server):
    # as vLLM's own backend streams when vLLM speculates: a response per engine step, carrying
    # every token the step committed; the first token, from the prefill, in a response of its own
    # on the scripted model (fixed k, a draft that agrees): steps commit several tokens
    sampling = {"max_tokens": 24, "ignore_eos": True}
    call = grpc_one(server.urls["grpc"], "scripted", prompt=PROMPT, stream=True, sampling=sampling)
    whole = grpc_one(server.urls["grpc"], "scripted", prompt=PROMPT, stream=False,
                     exclude_input_in_output=True, sampling=sampling)
    sizes = [len(r.ids()) for r in call.responses]
    assert sum(sizes) == 24 and max(sizes) > 1, f"no step committed several tokens: {sizes}"
    assert sizes[0] == 1, f"the prefill token did not go out in a response of its own: {sizes}"
    assert call.ids() == whole.ids() and call.text() == whole.text()


def test_token_granularity_streams_one_response_per_token(server):
    sampling = {"max_tokens": 12, "ignore_eos": True}
    call = grpc_one(server.urls["grpc"], "tokenwise", prompt=PROMPT, stream=True, sampling=sampling)
    per_step = grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, stream=True, sampling=sampling)
    assert [len(r.ids()) for r in call.responses] == [1] * 12
    assert call.ids() == per_step.ids() and call.text() == per_step.text()


# -- 5. vllm: metric families ---------------------------------------------------------------------------
VLLM_COUNTS = ["vllm:prompt_tokens_total", "vllm:generation_tokens_total",
               "vllm:time_to_first_token_seconds_count", "vllm:time_per_output_token_seconds_count",
               "vllm:e2e_request_latency_seconds_count", "vllm:request_prompt_tokens_count",
               "vllm:request_prompt_tokens_sum", "vllm:request_generation_tokens_count",
               "vllm:request_generation_tokens_sum", "vllm:request_params_n_count"]


def _vllm_counts(server) -> dict:
    return {name: scrape(server, name, model="tokenwise") for name in VLLM_COUNTS}


def test_vllm_metrics_follow_the_vllm_backend(server, hf_target):
    prompts = ["The most dangerous animal is", "The capital of France is", "The future of AI is"]
    prompt_tokens = sum(len(hf_target[1](p, add_special_tokens=False).input_ids) for p in prompts)
    before = _vllm_counts(server)
    calls = grpc_stream(server.urls["grpc"], "tokenwise", [
        {"prompt": p, "stream": False, "sampling": {"max_tokens": 16, "ignore_eos": True}}
        for p in prompts])
    assert all(len(c.ids()) == 16 for c in calls), [c.responses for c in calls]
    wait_for(lambda: scrape(server, "vllm:e2e_request_latency_seconds_count", model="tokenwise")
             >= before["vllm:e2e_request_latency_seconds_count"] + 3, what="the requests' metrics")
    after = _vllm_counts(server)
    delta = {name: after[name] - before[name] for name in VLLM_COUNTS}
    assert delta == {
        "vllm:prompt_tokens_total": prompt_tokens, "vllm:generation_tokens_total": 48,
        "vllm:time_to_first_token_seconds_count": 3,
        "vllm:time_per_output_token_seconds_count": 45,   # one per token after the first
        "vllm:e2e_request_latency_seconds_count": 3, "vllm:request_prompt_tokens_count": 3,
        "vllm:request_prompt_tokens_sum": prompt_tokens, "vllm:request_generation_tokens_count": 3,
        "vllm:request_generation_tokens_sum": 48, "vllm:request_params_n_count": 3}
    # vLLM's bucket boundaries, so its dashboards' quantile queries keep working
    assert scrape(server, "vllm:time_to_first_token_seconds_bucket", model="tokenwise", le="+Inf") \
        == after["vllm:time_to_first_token_seconds_count"]
    scrape(server, "vllm:time_to_first_token_seconds_bucket", model="tokenwise", le="7.5")
    scrape(server, "vllm:e2e_request_latency_seconds_bucket", model="tokenwise", le="40")
    assert scrape(server, "exspec:requests_total", model="tokenwise") >= 3   # ours stay


PREFIX_CACHE_COUNTS = ["vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                       "exspec:prefix_cache_queries_total", "exspec:prefix_cache_hits_total"]


def test_prefix_cache_counters_count_prompt_tokens_as_vllm_does(server, hf_target):
    """Queries: every admitted prompt token; hits: those whose KV came from the cache (the
    second request finds the first one's full blocks, all but the block of its last token)."""
    prompt = "Prefix caching counts tokens: the quick brown fox jumps over the lazy dog, twice."
    n = len(hf_target[1](prompt, add_special_tokens=False).input_ids)
    before = {name: scrape(server, name, model="tokenwise") for name in PREFIX_CACHE_COUNTS}
    for _ in range(2):   # one after the other
        call = grpc_one(server.urls["grpc"], "tokenwise", prompt=prompt, sampling={"max_tokens": 2})
        assert len(call.ids()) == 2, call.responses
    wait_for(lambda: scrape(server, "exspec:prefix_cache_queries_total", model="tokenwise")
             >= before["exspec:prefix_cache_queries_total"] + 2 * n, what="the lookups' metrics")
    delta = {name: scrape(server, name, model="tokenwise") - before[name] for name in PREFIX_CACHE_COUNTS}
    hits = (n - 1) // 16 * 16
    assert n > 32 and delta == {"vllm:prefix_cache_queries_total": 2 * n, "vllm:prefix_cache_hits_total": hits,
                                "exspec:prefix_cache_queries_total": 2 * n,
                                "exspec:prefix_cache_hits_total": hits}, (n, delta)


def test_vllm_families_only_with_report_custom_metrics(server):
    grpc_one(server.urls["grpc"], "exspec", prompt=PROMPT, sampling={"max_tokens": 2})
    wait_for(lambda: scrape(server, "exspec:requests_total", model="exspec"), what="a request")
    with pytest.raises(AssertionError, match="not in the scrape"):
        scrape(server, "vllm:generation_tokens_total", model="exspec")


# -- the unary model's max_tokens input (LiteLLM's unary path) -------------------------------------------
def _unary(server, max_tokens: int, parameters: dict | None = None):
    client = httpclient.InferenceServerClient(server.urls["http"].replace("http://", ""))
    text = httpclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))
    limit = httpclient.InferInput("max_tokens", [1], "INT32")
    limit.set_data_from_numpy(np.array([max_tokens], dtype=np.int32))
    try:
        return client.infer("exspec_unary", [text, limit], parameters=parameters)
    finally:
        client.close()


def test_unary_max_tokens_input_limits_the_output(server):
    assert len(_unary(server, 5).as_numpy("output_ids")) == 5
    assert len(_unary(server, 3, {"max_tokens": 3}).as_numpy("output_ids")) == 3


def test_unary_max_tokens_input_and_parameter_must_agree(server):
    from tritonclient.utils import InferenceServerException
    with pytest.raises(InferenceServerException, match="max_tokens given twice"):
        _unary(server, 5, {"max_tokens": 7})


# -- model.json in vLLM's own words ------------------------------------------------------------------
@pytest.mark.parametrize("model", ["vllm_plain", "vllm_spec"])
def test_a_vllm_model_json_serves_the_target_s_own_tokens(server, model):
    """The vLLM backend's sample model.json (and with a speculative_config) loads and serves the
    same greedy tokens as exspec's own model.json on the same pair; only the one with a
    speculative_config drafts."""
    def served(name):
        call = grpc_one(server.urls["grpc"], name, prompt=PROMPT, stream=False,
                        sampling={"max_tokens": 12, "ignore_eos": True}, exclude_input_in_output=True)
        assert call.responses[0].error is None, call.responses[0].error
        return call
    vllm = served(model)
    assert vllm.ids() == served("exspec").ids() and len(vllm.ids()) == 12
    drafted = int(vllm.responses[-1].outputs["total_draft_tokens"][0])
    assert (drafted > 0) == (model == "vllm_spec"), drafted
    log = (server.log_path.read_text() if server.log_path else "")
    assert "disable_log_requests = True: ignored" in log


def test_a_vllm_ngram_model_json_serves_the_target_s_own_tokens(server):
    """speculative_config method "ngram": no draft model is loaded, prompt lookup proposes, and
    the served greedy tokens are the target's own (the scripted model, same target, drafting
    with its draft model)."""
    prompt = SCRIPT + SCRIPT[:4]

    def served(name):
        call = grpc_one(server.urls["grpc"], name, prompt=prompt, stream=False,
                        sampling={"max_tokens": 24, "ignore_eos": True}, exclude_input_in_output=True)
        assert call.responses[0].error is None, call.responses[0].error
        return call
    ngram = served("vllm_ngram")
    assert ngram.ids() == served("scripted").ids() and len(ngram.ids()) == 24
    outputs = ngram.responses[-1].outputs
    assert int(outputs["total_accepted_draft_tokens"][0]) > 0, "no proposal was accepted"
    log = (server.log_path.read_text() if server.log_path else "")
    assert "speculative_config: the proposer and num_speculative_tokens set from it" in log
