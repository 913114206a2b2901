"""A target larger than one GPU: `device_map` spreads it over GPUs, the draft and the sampling
stay on `device` beside the target's first layers, and each layer's KV cache lives on its
layer's GPU. Validation runs everywhere; the engine runs on one GPU (accelerate's placement
path) and on two (layers on different GPUs) where they exist, else those tests are skipped."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from exspec import EngineConfig, SamplingParams
from exspec.errors import ModelLoadError
from exspec.models.loading import check_spread

from enginekit import assert_equivalent, make_engine, make_prompts

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("device_map", ["auto", "balanced", {"model.layers.0": 0, "lm_head": "cuda:1"}])
def test_device_map_is_accepted_with_a_gpu_device(device_map):
    EngineConfig(target_model="t", draft_model="d", device="cuda:0", device_map=device_map)


@pytest.mark.parametrize("device, device_map, says", [
    ("cpu", "auto", "needs device 'cuda"),
    ("cuda", "everywhere", "must be one of auto"),
    ("cuda", {}, "non-empty map"),
    ("cuda", {"lm_head": "cpu"}, "cpu and disk offload are not supported"),
    ("cuda", {"lm_head": "disk"}, "cpu and disk offload are not supported"),
    ("cuda", {"lm_head": -1}, "must be a GPU id"),
    ("cuda", {"lm_head": True}, "must be a GPU id"),
    ("cuda", ["model.layers.0"], "policy name or a non-empty map"),
])
def test_bad_device_maps_are_refused_with_the_reason(device, device_map, says):
    with pytest.raises(ValueError, match=says):
        EngineConfig(target_model="t", draft_model="d", device=device, device_map=device_map)


def test_a_target_placed_on_the_host_is_refused(pairs):
    """What device_map="auto" does when the GPUs are too small: weights land on the host.
    Loaded here through transformers' own device_map path (accelerate), as the engine loads it."""
    target = AutoModelForCausalLM.from_pretrained(pairs["llama", "target"], device_map={"": "cpu"})
    with pytest.raises(ModelLoadError, match="does not fit on the GPUs: device_map left weights on cpu"):
        check_spread(target, "cuda:0")


def _engine(pairs, method, device_map):
    return make_engine(pairs, "llama", "noisy", method=method, num_speculative_tokens=4,
                       max_batch_size=4, device="cuda:0", device_map=device_map)


def _assert_greedy_matches_target(engine, pairs, reference, label):
    eos = pairs["llama", "eos"]
    prompts = make_prompts(320, eos, seed=5, count=12)
    max_tokens = [24] * len(prompts)
    outs = engine.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    # the reference is HF generate on the CPU in float32: a GPU float32 matmul can only
    # differ at a true tie (design: "Definitions"), which these seeded tiny models do not have
    assert_equivalent(outs, prompts, max_tokens, reference, pairs["llama", "target"], 256, label=label)


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["exspec", "eqspec"])
def test_device_map_on_one_gpu_matches_target_greedy(pairs, reference, method):
    engine = _engine(pairs, method, "auto")
    assert set(engine.target.hf_device_map.values()) == {0}
    _assert_greedy_matches_target(engine, pairs, reference, f"{method} device_map=auto")


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("method", ["exspec", "eqspec"])
def test_target_split_over_two_gpus_matches_target_greedy(pairs, reference, method):
    split = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0,
             "model.layers.1": 1, "model.norm": 1, "lm_head": 1}
    with pytest.raises(ModelLoadError, match="input embeddings on cuda:1"):
        _engine(pairs, method, {**split, "model.embed_tokens": 1})
    engine = _engine(pairs, method, split)
    assert engine.draft.device == torch.device("cuda:0")
    engine.add_request("probe", make_prompts(320, None, seed=9, count=8)[5], SamplingParams(max_tokens=8))
    engine.step()   # the prefill: each layer's cache is now where its layer is
    layers = engine.pool.groups[0].target_kv.cache.layers
    assert [layer.keys.device for layer in layers] == [torch.device("cuda:0"), torch.device("cuda:1")]
    while engine.has_unfinished():
        engine.step()
    _assert_greedy_matches_target(engine, pairs, reference, f"{method} split over 2 GPUs")
