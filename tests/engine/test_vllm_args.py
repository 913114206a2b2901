"""vLLM's engine arguments in model.json: mapped, ignored with a log line, or refused by name."""
import logging

import pytest
import torch

from exspec import EngineConfig, LLMEngine, SamplingParams
from exspec.engine import llm_engine as engine_module
from exspec.spec.ngram import NgramProposer
from exspec.spec.suffix import SuffixProposer

from enginekit import make_prompts

# Triton's vLLM backend sample model.json, with our tiny pair's paths in it.
VLLM_SAMPLE = {"disable_log_requests": True, "gpu_memory_utilization": 0.5, "enforce_eager": True}


def vllm_json(pairs, **extra) -> dict:
    return {"model": pairs["llama", "target"], "tokenizer": pairs["tokenizer"], **VLLM_SAMPLE, **extra}


def test_the_vllm_sample_loads_as_the_target_alone_and_logs_what_it_ignores(pairs, caplog):
    with caplog.at_level(logging.WARNING, logger="exspec"):
        config = EngineConfig.from_dict(vllm_json(pairs, disable_log_stats=True))
    assert config.target_model == pairs["llama", "target"]
    assert config.method == "autoregressive" and config.draft_model is None
    assert config.gpu_memory_utilization == 0.5 and config.enforce_eager is True
    logged = caplog.text
    assert "disable_log_requests = True: ignored" in logged
    assert "disable_log_stats = True: the vllm: metric families off" in logged


def test_speculative_config_names_the_draft_and_k(pairs):
    config = EngineConfig.from_dict(vllm_json(pairs, speculative_config={
        "model": pairs["llama", "noisy"], "num_speculative_tokens": 3}))
    assert config.method == "exspec"
    assert config.draft_model == pairs["llama", "noisy"] and config.num_speculative_tokens == 3
    # vLLM's explicit method name for a draft model is the same thing
    again = EngineConfig.from_dict(vllm_json(pairs, speculative_config={
        "method": "draft_model", "model": pairs["llama", "noisy"]}))
    assert again.draft_model == pairs["llama", "noisy"] and again.num_speculative_tokens == 5


def test_speculative_config_ngram_proposes_without_a_draft_model(pairs):
    config = EngineConfig.from_dict(vllm_json(pairs, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5,
        "prompt_lookup_min": 1}))
    assert (config.method, config.proposer, config.draft_model) == ("exspec", "ngram", None)
    assert (config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min) == (3, 5, 1)
    engine = LLMEngine(config)
    assert engine.draft is None and isinstance(engine.runner.proposer, NgramProposer)


def test_speculative_config_suffix_takes_vllms_keys_and_defaults(pairs):
    """vLLM's suffix keys and defaults; without num_speculative_tokens, up to the tree's depth."""
    config = EngineConfig.from_dict(vllm_json(pairs, speculative_config={"method": "suffix"}))
    assert (config.method, config.proposer, config.draft_model) == ("exspec", "suffix", None)
    assert (config.num_speculative_tokens, config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_cached_requests, config.suffix_decoding_max_spec_factor,
            config.suffix_decoding_min_token_prob) == (24, 24, 10000, 1.0, 0.1)
    config = EngineConfig.from_dict(vllm_json(pairs, speculative_config={
        "method": "suffix", "suffix_decoding_max_tree_depth": 12, "num_speculative_tokens": 6,
        "suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 2.0,
        "suffix_decoding_min_token_prob": 0.2, "suffix_decoding_max_cached_tokens": 5000}))
    engine = LLMEngine(config)
    proposer = engine.runner.proposer
    assert engine.draft is None and isinstance(proposer, SuffixProposer)
    assert (config.num_speculative_tokens, proposer.max_tree_depth, proposer.max_cached_requests,
            proposer.max_spec_factor, proposer.min_token_prob,
            proposer.max_cached_tokens) == (6, 12, 0, 2.0, 0.2, 5000)


@pytest.mark.parametrize("key, value, message", [
    ("speculative_config", {"method": "suffix", "model": "x"}, "proposes without a draft model"),
    ("speculative_config", {"method": "suffix", "prompt_lookup_max": 3}, "only for method 'ngram'"),
    ("speculative_config", {"method": "ngram", "suffix_decoding_max_tree_depth": 3},
     "only for method 'suffix'"),
    ("speculative_config", {"method": "suffix", "suffix_decoding_min_token_prob": -0.1},
     r"suffix_decoding_min_token_prob must be a finite number in \[0, 1\], got -0.1"),
    ("speculative_config", {"method": "suffix", "suffix_decoding_max_tree_depth": 2.0},
     "suffix_decoding_max_tree_depth"),
    ("tensor_parallel_size", 2, "tensor_parallel_size = 2 is not supported"),
    ("quantization", "awq", "quantization = 'awq' is not supported"),
    ("enable_lora", True, "enable_lora = True is not supported"),
    ("kv_cache_dtype", "fp8", "kv_cache_dtype = 'fp8' is not supported"),
    ("speculative_config", {"method": "eagle", "model": "x"}, "method 'eagle' is not supported"),
    ("speculative_config", {"model": "x", "acceptance_method": "typical"},
     "speculative_config keys not supported by exspec: acceptance_method"),
    ("speculative_config", {"num_speculative_tokens": 3}, "speculative_config needs 'model'"),
    ("speculative_config", {"method": "ngram", "model": "x"}, "proposes without a draft model"),
    ("speculative_config", {"model": "x", "prompt_lookup_max": 3}, "only for method 'ngram'"),
    ("speculative_config", {"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "1 <= min <= max"),
    ("target_model", "x", "sets both 'model'"),
    ("gpu_memory_utilization", 1.5, r"gpu_memory_utilization must be a number in \(0, 1\]"),
    ("colour", "blue", "unknown engine config keys: colour"),
])
def test_values_exspec_cannot_honour_are_refused_by_name(pairs, key, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_dict(vllm_json(pairs, **{key: value}))


def test_neutral_values_and_vllm_spellings_are_accepted(pairs):
    config = EngineConfig.from_dict(vllm_json(pairs, tensor_parallel_size=1, quantization=None,
                                              kv_cache_dtype="auto", dtype="float", seed=3,
                                              max_model_len=200, max_num_seqs=16))
    assert (config.dtype, config.seed, config.max_model_len, config.max_num_seqs) == ("float32", 3, 200, 16)
    assert EngineConfig.from_dict(vllm_json(pairs, dtype="auto")).dtype == "float32"
    assert EngineConfig.from_dict(vllm_json(pairs, dtype="half")).dtype == "float16"


def test_a_vllm_model_json_serves_the_same_tokens_as_the_native_one(pairs):
    """The translation changes names only: the vLLM spelling and exspec's own generate alike."""
    common = dict(max_batch_size=4, adaptive_k=False, num_speculative_tokens=3)
    native = LLMEngine(EngineConfig.from_dict({
        "target_model": pairs["llama", "target"], "draft_model": pairs["llama", "noisy"],
        "tokenizer": pairs["tokenizer"], **common}))
    vllm = LLMEngine(EngineConfig.from_dict(vllm_json(pairs, max_batch_size=4, adaptive_k=False,
        speculative_config={"model": pairs["llama", "noisy"], "num_speculative_tokens": 3})))
    plain = LLMEngine(EngineConfig.from_dict(vllm_json(pairs, max_batch_size=4)))
    prompts = make_prompts(320, None, seed=4, count=4, max_len=20)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in native.generate(prompts, params)]
    assert [o.token_ids for o in vllm.generate(prompts, params)] == expected
    assert [o.token_ids for o in plain.generate(prompts, params)] == expected
    assert vllm.stats()["draft_tokens"] > 0 and plain.stats()["draft_tokens"] == 0


def test_gpu_memory_utilization_caps_the_kv_budget_at_that_share_of_the_gpu(monkeypatch):
    """vLLM's meaning: this engine may hold that share of the device's memory in all; the KV
    budget is what the weights already held leave of it (the device's own numbers, patched:
    this machine has no GPU)."""
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (70 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 10 * gib)
    device = torch.device("cuda", 0)
    assert engine_module._free_memory(device) == 70 * gib                     # free
    assert engine_module._free_memory(device, utilization=0.5) == 30 * gib    # 40 GiB share - 10
    assert engine_module._free_memory(device, utilization=0.1) == -2 * gib    # weights past it


def test_vllm_path_keys_resolve_against_model_json_like_exspecs(tmp_path):
    """`model` and `speculative_config.model` are paths next to model.json as `target_model`
    and `draft_model` are (else a relative path would resolve against the server's cwd)."""
    from exspec.config import resolve_model_paths
    for name in ("target", "draft"):
        (tmp_path / name).mkdir()
    values = resolve_model_paths({"model": "./target", "tokenizer": "target", "max_num_seqs": 8,
                                  "speculative_config": {"model": "draft", "num_speculative_tokens": 3}},
                                 tmp_path)
    assert values["model"] == values["tokenizer"] == str(tmp_path / "target")
    assert values["speculative_config"] == {"model": str(tmp_path / "draft"), "num_speculative_tokens": 3}
    assert resolve_model_paths({"model": "org/hub-id"}, tmp_path) == {"model": "org/hub-id"}


@pytest.mark.parametrize("key, value, words", [
    ("prompt_lookup_min", 2.0, "prompt_lookup_min must be an integer, got 2.0"),
    ("max_num_seqs", "8", "max_num_seqs must be an integer"),
    ("adaptive_k", 1, "adaptive_k must be true or false"),
    ("tick_timeout_s", "5", "tick_timeout_s must be a number"),
    ("dtype", None, "dtype must be a string"),
])
def test_config_values_of_the_wrong_type_are_refused_at_load(pairs, key, value, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig.from_dict({**vllm_json(pairs), key: value})


def test_a_vllm_style_model_json_gets_vllms_default_max_tokens(pairs):
    """vLLM's backend answers a request without max_tokens with 16 tokens (vLLM's default);
    exspec's own model.json keeps its 256, and an explicit default_max_tokens wins."""
    assert EngineConfig.from_dict(vllm_json(pairs)).default_max_tokens == 16
    assert EngineConfig.from_dict(vllm_json(pairs, default_max_tokens=40)).default_max_tokens == 40
    assert EngineConfig.from_dict({"target_model": pairs["llama", "target"],
                                   "method": "autoregressive"}).default_max_tokens == 256
