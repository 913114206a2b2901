"""The KV budget on a GPU under real memory pressure (`make gpu-check`; skipped without CUDA):
the process is capped (torch.cuda.set_per_process_memory_fraction) to what the tiny models
hold plus a few MiB, the engine sizes its pool from what the cap leaves, and a burst whose
max_tokens together far exceed it completes with no request failing and no allocation past the
cap. (The longer soak beside it: load_tests/soak.py against a server with a small
max_num_kv_tokens, not run here.)"""
from __future__ import annotations

import pytest
import torch

from exspec import EngineConfig, LLMEngine, SamplingParams

from enginekit import make_prompts

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

HEADROOM_MIB = 8      # what the cap leaves beside the loaded models
MAX_TOKENS = 200


def test_a_burst_completes_within_a_capped_gpu(pairs):
    config = dict(target_model=pairs["llama", "target"], draft_model=pairs["llama", "noisy"],
                  tokenizer=pairs["tokenizer"], method="exspec", num_speculative_tokens=4,
                  max_batch_size=8, max_num_seqs=64, adaptive_k=False, device="cuda",
                  max_num_kv_tokens=1)
    loaded = LLMEngine(EngineConfig(**config))   # only to load the pair onto the GPU
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    cap = torch.cuda.memory_reserved() + HEADROOM_MIB * 2**20
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        torch.cuda.reset_peak_memory_stats()
        engine = LLMEngine(EngineConfig(**{**config, "max_num_kv_tokens": None}), pair=loaded.pair)
        budget = engine.config.max_num_kv_tokens
        prompts = make_prompts(320, pairs["llama", "eos"], seed=61, count=64)
        need = sum(2 * (len(p) + MAX_TOKENS) for p in prompts)
        assert need > 2 * budget, f"the cap does not bind: budget {budget}, burst {need}"
        outs, peak_reserved = [], 0
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished]
            peak_reserved = max(peak_reserved, engine.stats()["pool_kv_tokens_reserved"])
        failed = [(o.request_id, o.error) for o in outs if o.finish_reason != "length"]
        assert not failed, failed[:3]
        assert len(outs) == len(prompts)
        assert peak_reserved <= budget
        assert torch.cuda.max_memory_reserved() <= cap, "allocations went past the cap"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_block_stores_take_their_share_at_load_and_never_grow(pairs):
    """On CUDA the budget comes from the memory free after loading, and each block store takes
    its whole share at the warm-up (the compiled path, CUDA graphs) and keeps the same buffers
    through a burst: no doubling, no second buffer alive, no graph recaptured for a new one.
    (Unverified here: written without a GPU.)"""
    from exspec.kv import blocks as kv_blocks
    from exspec.engine.llm_engine import kv_bytes_per_entry
    engine = LLMEngine(EngineConfig(
        target_model=pairs["llama", "target"], draft_model=pairs["llama", "noisy"],
        tokenizer=pairs["tokenizer"], method="exspec", num_speculative_tokens=4, max_batch_size=8,
        max_num_seqs=32, adaptive_k=False, device="cuda", enforce_eager=False,
        gpu_memory_utilization=0.05))
    budget = engine.config.max_num_kv_tokens
    stores = {id(m): engine.runner.kv_layout.stores[id(m)] for m in (engine.target, engine.draft)}
    buffers = {key: [layer.keys.data_ptr() for layer in s.cache.layers] for key, s in stores.items()}
    for model in (engine.target, engine.draft):
        store = stores[id(model)]
        assert not store.grows and store.num_blocks == budget // 2 // kv_blocks.BLOCK_SIZE
        held = sum(t.untyped_storage().nbytes() for layer in store.cache.layers
                   for t in (layer.keys, layer.values))
        assert held <= budget // 2 * kv_bytes_per_entry(model), (held, budget)
    for i, p in enumerate(make_prompts(320, pairs["llama", "eos"], seed=62, count=32)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs][:3]
    assert buffers == {key: [layer.keys.data_ptr() for layer in s.cache.layers]
                       for key, s in stores.items()}, "a store grew (new buffers)"
