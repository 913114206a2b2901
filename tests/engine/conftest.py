"""Tiny seeded model pairs saved in Hugging Face format, and target-only greedy references.

Two target architectures (Llama: RoPE; GPT-2: learned absolute positions) and four drafts each:
a noisy copy, independent weights, another shape, another architecture on the same vocabulary.
"""
from __future__ import annotations

import random
from collections import Counter
from functools import lru_cache

import pytest
import torch
from transformers import AutoModelForCausalLM

from exspec import EngineConfig, LLMEngine
from exspec.demo.tiny import build_tokenizer, gpt2, llama, noisy_copy

GPT2_MAX_POS = 128


def make_prompts(vocab: int, eos: int | None, seed: int = 0, count: int = 16, max_len: int = 40):
    rng = random.Random(seed)
    lengths = [1, 2, 3, 5, 8, 13, 21, max_len] + [rng.randint(1, max_len) for _ in range(count - 8)]
    return [[rng.choice([t for t in range(1, vocab) if t != eos]) for _ in range(n)]
            for n in lengths[:count]]


def _set_eos(model, eos: int):
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos


def _pick_eos(target, prompts) -> int:
    """A token the target emits early for some prompts but not all: EOS then stops mid-run."""
    seen = Counter()
    with torch.no_grad():
        for p in prompts:
            out = target.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            seen.update(set(out[2:]))
    return next(t for t, n in seen.most_common() if n < len(prompts) // 2)


def _build(root):
    tok = build_tokenizer()
    vocab = len(tok)
    probe = make_prompts(vocab, None)
    targets = {
        "llama": llama(vocab, seed=1, layers=2, hidden=64, heads=4, kv_heads=2, max_positions=256),
        "gpt2": gpt2(vocab, seed=2, layers=2, hidden=64, heads=4, max_positions=GPT2_MAX_POS),
    }
    drafts = {
        "llama": {
            "noisy": lambda t: noisy_copy(t, 3, scale=0.02),
            "independent": lambda t: llama(vocab, seed=11, layers=1, hidden=64, max_positions=256),
            "othershape": lambda t: llama(vocab, seed=12, layers=3, hidden=32, heads=2, kv_heads=1,
                                          max_positions=256),
            "otherarch": lambda t: gpt2(vocab, seed=13, layers=1, hidden=32, heads=2, max_positions=256),
        },
        "gpt2": {
            "noisy": lambda t: noisy_copy(t, 4, scale=0.02),
            "independent": lambda t: gpt2(vocab, seed=21, layers=1, hidden=64, max_positions=GPT2_MAX_POS),
            "othershape": lambda t: gpt2(vocab, seed=22, layers=3, hidden=32, heads=2,
                                         max_positions=GPT2_MAX_POS),
            "otherarch": lambda t: llama(vocab, seed=23, layers=1, hidden=32, heads=2, kv_heads=1,
                                         max_positions=GPT2_MAX_POS),
        },
    }
    tok.save_pretrained(root / "tokenizer")
    paths = {"tokenizer": str(root / "tokenizer")}
    for arch, target in targets.items():
        eos = _pick_eos(target, probe)
        _set_eos(target, eos)
        target.save_pretrained(root / arch / "target")
        paths[arch, "target"] = str(root / arch / "target")
        paths[arch, "eos"] = eos
        for name, make in drafts[arch].items():
            draft = make(target)
            _set_eos(draft, eos)
            draft.save_pretrained(root / arch / name)
            paths[arch, name] = str(root / arch / name)
        # identical twin: every draft must be accepted
        target.save_pretrained(root / arch / "twin")
        paths[arch, "twin"] = str(root / arch / "twin")
    return paths


@pytest.fixture(scope="session")
def pairs(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("pairs"))


@lru_cache(maxsize=None)
def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@lru_cache(maxsize=None)
def _reference(target_path: str, prompt: tuple, max_tokens: int, max_len: int) -> tuple:
    model = _load(target_path)
    budget = min(max_tokens, max_len - len(prompt))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=budget, do_sample=False)
    return tuple(out[0, len(prompt):].tolist())


@pytest.fixture(scope="session")
def reference():
    """Target-only greedy continuation at batch size 1 (Hugging Face generate)."""
    def ref(target_path, prompt, max_tokens, max_len=256):
        return list(_reference(target_path, tuple(prompt), max_tokens, max_len))
    return ref


def make_engine(pairs, arch="llama", draft="noisy", **overrides) -> LLMEngine:
    config = dict(target_model=pairs[arch, "target"], draft_model=pairs[arch, draft],
                  tokenizer=pairs["tokenizer"], method="eqspec", num_speculative_tokens=5,
                  max_batch_size=8, adaptive_k=False)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def assert_equivalent(outs, prompts, max_tokens, reference, target_path, max_len, label=""):
    """Every row equals target-only greedy, token for token; the message says where not."""
    for i, (out, prompt, mt) in enumerate(zip(outs, prompts, max_tokens)):
        expected = reference(target_path, prompt, mt, max_len)
        assert out.error is None, f"{label} row {i}: {out.error}"
        if out.token_ids != expected:
            at = next((j for j, (a, b) in enumerate(zip(out.token_ids, expected)) if a != b),
                      min(len(out.token_ids), len(expected)))
            raise AssertionError(
                f"{label} row {i} (prompt len {len(prompt)}, max_tokens {mt}) differs at output "
                f"position {at}: got {out.token_ids[at:at + 5]}, expected {expected[at:at + 5]} "
                f"(lengths {len(out.token_ids)} vs {len(expected)})")
