"""KV memory of sliding-window layers over a long generation (design: "Models").

The layouts keep every entry of a sliding layer, out of the window or not (kv.new_cache), and
mask the old ones out. This measures what that costs: a Gemma 3-shaped tiny pair (five sliding
layers to one full one, random weights) generates `--max-tokens` tokens per request, and after
every tick it records the KV bytes the pool's caches hold, split into full and sliding layers,
next to what a layout that freed out-of-window entries would need at least (a sliding layer
holding min(tokens, window) entries per row). The ratio carries over to a real model of the
same layer pattern and window/length ratio: bytes per entry scale alike in every layer.

    PYTHONPATH=backend python -m exspec.bench.window_memory --method exspec --max-tokens 1024
"""
from __future__ import annotations

import argparse
import json

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from .. import EngineConfig, LLMEngine, SamplingParams
from ..demo.tiny import _init, build_tokenizer, noisy_copy
from ..kv.padded import LayerMasks
from ..models.loading import ModelPair


def tiny_gemma3(window: int, layers: int, seed: int = 0):
    config = Gemma3TextConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=layers, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, sliding_window=window,
                              max_position_embeddings=8192, pad_token_id=0, bos_token_id=0,
                              eos_token_id=[], tie_word_embeddings=False)
    torch.manual_seed(seed)
    target = _init(Gemma3ForCausalLM(config))
    return target, noisy_copy(target, seed + 1)


def held_bytes(engine: LLMEngine, model, role: str) -> dict[str, int]:
    """KV bytes of `model`'s caches in the pool, by layer type, as allocated (each buffer once:
    EXSPEC's groups share one store)."""
    types = model.config.layer_types
    held, seen = dict.fromkeys(set(types), 0), set()
    for group in engine.pool.groups:
        kv = getattr(group, f"{role}_kv")
        for kind, layer in zip(types, kv.cache.layers):
            if layer.is_initialized and layer.keys.data_ptr() not in seen:
                seen.add(layer.keys.data_ptr())
                held[kind] += layer.keys.nbytes + layer.values.nbytes
    return held


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="exspec", choices=["exspec", "eqspec"])
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft = tiny_gemma3(args.window, args.layers)
    pair = ModelPair(build_tokenizer(), target, draft, set(), 8192)
    engine = LLMEngine(EngineConfig(target_model="g", draft_model="g", method=args.method,
                                    num_speculative_tokens=3, max_batch_size=args.requests,
                                    adaptive_k=False, max_model_len=8192,
                                    max_output_tokens=args.max_tokens,
                                    torch_threads=args.threads), pair=pair)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(f"r{i}", [1 + (i * 7 + j) % 300 for j in range(args.prompt_tokens + i)],
                           params)
    types = target.config.layer_types
    per_entry = 2 * 2 * 16 * target.dtype.itemsize   # keys + values, 2 KV heads x 16 per layer
    peak = {"held": 0, "full": 0, "sliding": 0, "windowed_floor": 0, "tokens": 0}
    while engine.has_unfinished():
        engine.step()
        held = held_bytes(engine, target, "target")
        total = sum(held.values())
        if total > peak["held"]:
            rows = [s.num_cached_target for g in engine.pool.groups for s in g.seqs]
            floor = sum(per_entry * (n if kind == "full_attention" else min(n, args.window))
                        for n in rows for kind in types)
            peak = {"held": total, "full": held.get("full_attention", 0),
                    "sliding": held.get("sliding_attention", 0),
                    "kept_entries": per_entry * len(types) * sum(rows),   # held minus headroom
                    "windowed_floor": floor, "tokens": sum(rows)}
    stats = engine.stats()
    report = {"method": args.method, "window": args.window, "layer_types": " ".join(types),
              "requests": args.requests, "max_tokens": args.max_tokens,
              "threads": torch.get_num_threads(), "windows": LayerMasks.of(target).windows,
              "target_kv_at_peak": peak,
              "held_over_floor": round(peak["held"] / peak["windowed_floor"], 2),
              "kept_over_floor": round(peak["kept_entries"] / peak["windowed_floor"], 2),
              "acceptance_rate": stats["acceptance_rate"]}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
