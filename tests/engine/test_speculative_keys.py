"""Every speculative key finite and within its bound at load (config.SPECULATIVE_BOUNDS), refused
with an error naming the key, its value and the bound: set on EngineConfig, and in a vLLM
model.json's speculative_config as Python's json reads it (NaN and Infinity included)."""
from __future__ import annotations

import json

import pytest

from exspec import EngineConfig

# (proposer, key, value, the bound the error names): each end of each bound, NaN and infinities
OUT_OF_BOUNDS = [
    ("ngram", "num_speculative_tokens", -1, "[0, 64]"),
    ("ngram", "num_speculative_tokens", 65, "[0, 64]"),
    ("ngram", "prompt_lookup_min", 0, "[1, 16]"),
    ("ngram", "prompt_lookup_max", 17, "[1, 16]"),
    ("suffix", "suffix_decoding_max_tree_depth", 0, "[1, 64]"),
    ("suffix", "suffix_decoding_max_tree_depth", 65, "[1, 64]"),
    ("suffix", "suffix_decoding_max_cached_requests", -1, "[0, 1000000]"),
    ("suffix", "suffix_decoding_max_cached_requests", 1_000_001, "[0, 1000000]"),
    ("suffix", "suffix_decoding_max_cached_tokens", -1, "[0, 100000000]"),
    ("suffix", "suffix_decoding_max_cached_tokens", 100_000_001, "[0, 100000000]"),
    ("suffix", "suffix_decoding_max_spec_factor", 0, "(0, 64]"),
    ("suffix", "suffix_decoding_max_spec_factor", 64.5, "(0, 64]"),
    ("suffix", "suffix_decoding_max_spec_factor", float("nan"), "(0, 64]"),
    ("suffix", "suffix_decoding_max_spec_factor", float("inf"), "(0, 64]"),
    ("suffix", "suffix_decoding_min_token_prob", -0.1, "[0, 1]"),
    ("suffix", "suffix_decoding_min_token_prob", 1.5, "[0, 1]"),
    ("suffix", "suffix_decoding_min_token_prob", float("nan"), "[0, 1]"),
    ("suffix", "suffix_decoding_min_token_prob", float("-inf"), "[0, 1]"),
]


def expected(key, value, bound) -> str:
    return f"{key} must be a finite number in {bound}, got {value!r}"


@pytest.mark.parametrize("proposer, key, value, bound", OUT_OF_BOUNDS)
def test_a_speculative_key_out_of_bounds_is_refused_by_engine_config(proposer, key, value, bound):
    with pytest.raises(ValueError) as refused:
        EngineConfig(target_model="t", proposer=proposer, **{key: value})
    assert expected(key, value, bound) in str(refused.value)


@pytest.mark.parametrize("proposer, key, value, bound", OUT_OF_BOUNDS)
def test_a_speculative_key_out_of_bounds_is_refused_from_a_vllm_model_json(proposer, key, value, bound):
    """model.json as the Triton model reads it: json.loads turns NaN and Infinity into floats."""
    text = json.dumps({"model": "t", "speculative_config": {"method": proposer, key: value}})
    assert ("NaN" in text or "Infinity" in text) == (value != value or abs(value) == float("inf"))
    with pytest.raises(ValueError) as refused:
        EngineConfig.from_dict(json.loads(text))
    assert expected(key, value, bound) in str(refused.value)


def test_a_suffix_tree_deeper_than_k_allows_is_refused_naming_the_depth():
    """vLLM's suffix method without num_speculative_tokens proposes up to the tree's depth: the
    error names the depth, the key the user set, not the k derived from it."""
    with pytest.raises(ValueError, match="suffix_decoding_max_tree_depth must be"):
        EngineConfig.from_dict({"model": "t", "speculative_config": {
            "method": "suffix", "suffix_decoding_max_tree_depth": 100}})


def test_each_bound_itself_is_accepted():
    EngineConfig(target_model="t", proposer="ngram", num_speculative_tokens=64,
                 prompt_lookup_min=16, prompt_lookup_max=16)
    EngineConfig(target_model="t", proposer="suffix", suffix_decoding_max_tree_depth=64,
                 suffix_decoding_max_cached_requests=0, suffix_decoding_max_cached_tokens=0,
                 suffix_decoding_max_spec_factor=64, suffix_decoding_min_token_prob=1.0)
