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
