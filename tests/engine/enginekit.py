"""Tiny seeded model pairs saved in Hugging Face format, and target-only references: greedy
(Hugging Face generate) and seeded sampling (the coupled sampler's definition, re-encoding).

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

from exspec import EngineConfig, LLMEngine, SamplingParams
from exspec.demo.tiny import build_tokenizer, gpt2, llama, noisy_copy
from exspec.sampling.noise import gumbel
from exspec.sampling.sampler import RowSampling, perturbed_scores

GPT2_MAX_POS = 128
TIE_GAP = 1e-4   # a perturbed-score gap below this is a float tie: either token is exact


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


@lru_cache(maxsize=None)
def _seeded_reference(target_path: str, prompt: tuple, temperature: float, top_p: float,
                      top_k: int, seed: int, max_tokens: int, max_len: int) -> tuple:
    model = _load(target_path)
    eos = model.generation_config.eos_token_id
    rows = RowSampling.from_params([SamplingParams(temperature=temperature, top_p=top_p,
                                                   top_k=top_k)], "cpu", [seed])
    tokens, gaps = list(prompt), []
    with torch.no_grad():
        while len(tokens) - len(prompt) < max_tokens and len(tokens) < max_len:
            logits = model(input_ids=torch.tensor([tokens])).logits[:, -1:]
            noise = gumbel(torch.tensor([seed]), torch.tensor([[len(tokens)]]), logits.shape[-1])
            scores = perturbed_scores(logits, rows, noise)[0, 0]
            best, second = scores.topk(2).values.tolist()
            gaps.append(best - second)
            tokens.append(int(scores.argmax()))
            if tokens[-1] == eos:
                break
    return tuple(tokens[len(prompt):]), tuple(gaps)


@pytest.fixture(scope="session")
def seeded_reference():
    """Target-only seeded output at batch size 1: each token argmax(log p + g(seed, position)),
    the whole context re-encoded per token; with the top-2 perturbed-score gap per token."""
    def ref(target_path, prompt, params: SamplingParams, max_len=256):
        tokens, gaps = _seeded_reference(target_path, tuple(prompt), params.temperature,
                                         params.top_p, params.top_k, params.seed,
                                         params.max_tokens, max_len)
        return list(tokens), list(gaps)
    return ref


def make_engine(pairs, arch="llama", draft="noisy", **overrides) -> LLMEngine:
    config = dict(target_model=pairs[arch, "target"], draft_model=pairs[arch, draft],
                  tokenizer=pairs["tokenizer"], method="eqspec", num_speculative_tokens=5,
                  max_batch_size=8, adaptive_k=False)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def first_difference(got: list[int], expected: list[int]) -> int | None:
    if got == expected:
        return None
    return next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b),
                min(len(got), len(expected)))


def assert_equivalent(outs, prompts, max_tokens, reference, target_path, max_len, label=""):
    """Every row equals target-only greedy, token for token; the message says where not."""
    for i, (out, prompt, mt) in enumerate(zip(outs, prompts, max_tokens)):
        expected = reference(target_path, prompt, mt, max_len)
        assert out.error is None, f"{label} row {i}: {out.error}"
        at = first_difference(out.token_ids, expected)
        if at is not None:
            raise AssertionError(
                f"{label} row {i} (prompt len {len(prompt)}, max_tokens {mt}) differs at output "
                f"position {at}: got {out.token_ids[at:at + 5]}, expected {expected[at:at + 5]} "
                f"(lengths {len(out.token_ids)} vs {len(expected)})")


def assert_seeded_equivalent(rows, seeded_reference, target_path, max_len=256, label="") -> int:
    """rows: (request label, prompt, params, tokens, complete). Every row equals the target-only
    seeded output (a prefix of it when not complete, e.g. aborted), except after a float tie
    (reference gap < TIE_GAP) at the first difference; returns how many rows such a tie ended."""
    ties = 0
    for name, prompt, params, tokens, complete in rows:
        expected, gaps = seeded_reference(target_path, prompt, params, max_len)
        at = first_difference(tokens, expected if complete else expected[:len(tokens)])
        if at is None:
            continue
        if at < min(len(tokens), len(expected)) and gaps[at] < TIE_GAP:
            ties += 1
            continue
        raise AssertionError(
            f"{label} {name} (prompt len {len(prompt)}, seed {params.seed}, T={params.temperature}, "
            f"top_p={params.top_p}, top_k={params.top_k}) differs at output position {at}: got "
            f"{tokens[at:at + 5]}, expected {expected[at:at + 5]} (lengths {len(tokens)} vs "
            f"{len(expected)}; reference gap there {gaps[at] if at < len(gaps) else None})")
    return ties


def run_schedule(engine, arrivals, aborts, params):
    """Drive the online API: arrivals[tick] = [(id, prompt)], aborts[tick] = [id]; params is
    one SamplingParams for all, or a dict by request id."""
    outputs, finished, aborted_at = {}, {}, {}
    tick = 0
    while tick <= max(arrivals) or engine.has_unfinished():
        for rid, prompt in arrivals.get(tick, []):
            engine.add_request(rid, prompt, params[rid] if isinstance(params, dict) else params)
        for rid in aborts.get(tick, []):
            engine.abort(rid)
            aborted_at.setdefault(rid, len(outputs.get(rid, [])))
        for out in engine.step():
            assert out.request_id not in finished, f"{out.request_id} got a second final output"
            outputs.setdefault(out.request_id, []).append(out)
            if out.finished:
                finished[out.request_id] = out
        tick += 1
        assert tick < 2000, "the engine stopped making progress"
    return outputs, finished, aborted_at


def bf16_divergence(target, prompt: list[int], got: list[int], max_tokens: int):
    """None when `got` equals the bf16 target's own greedy output (batch 1, on its device);
    else (position, top-2 gap, top logit, near tie by the benchmark's rule) at the first
    difference (design: "Definitions")."""
    from exspec.bench.equivalence import common_prefix, is_near_tie
    device = target.device
    with torch.no_grad():
        ref = target.generate(torch.tensor([prompt], device=device), max_new_tokens=max_tokens,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        n = common_prefix(ref, got)
        if n == len(ref):
            return None
        logits = target(input_ids=torch.tensor([prompt + ref[:n]], device=device)).logits[0, -1].float()
    top, second = logits.topk(2).values.tolist()
    return n, top - second, top, is_near_tie(top, second, float(logits.max() - logits.min()), "bfloat16")

