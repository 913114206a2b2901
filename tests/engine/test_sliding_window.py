"""Sliding-window layers are exact while the window really slides (design: "Models").

The window (5) is shorter than what every row grows to, so each row's window starts moving in
the middle of generation, at a different step for each row (the prompts differ in length); the
draft is a noisy copy of the target, so rows of one step accept different numbers of drafts
(checked) and their caches are cut back by different amounts. Three shapes: Gemma 3 (sliding
layers around a full one, a dict of masks by layer type), Gemma 2 (alternating) and Mistral
(every layer sliding, one mask). Negative control: the same run with full attention in the
sliding layers must differ from the target alone.
"""
from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from exspec import EngineConfig, LLMEngine, SamplingParams
from exspec.models import compiled
from exspec.kv import padded as kv_module
from exspec.models.loading import ModelPair

from test_architectures import tokenizer
from tiny_archs import build, greedy_reference

WINDOW = 5
SHAPES = {
    "gemma3_text": dict(num_hidden_layers=3,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "gemma2": dict(layer_types=["sliding_attention", "full_attention"]),
    "mistral": {},
}
PROMPTS = [[5, 9, 17, 33, 2, 8], [40], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [100, 3],
           [60, 61, 62, 63], [250, 251, 252, 253, 254, 255, 256, 257]]
MAX_TOKENS = 20


@lru_cache(maxsize=3)
def shaped(model_type: str):
    target, draft = build(model_type, seed=3, sliding_window=WINDOW, **SHAPES[model_type])
    expected = [greedy_reference(target, p, MAX_TOKENS) for p in PROMPTS]
    return ModelPair(tokenizer(), target, draft, set(), 256), expected


def engine_for(model_type: str, method: str, **config) -> LLMEngine:
    pair, _ = shaped(model_type)
    assert WINDOW in kv_module.LayerMasks.of(pair.target).windows.values(), model_type
    return LLMEngine(EngineConfig(target_model=model_type, draft_model=model_type, method=method,
                                  num_speculative_tokens=3, max_batch_size=4, adaptive_k=False,
                                  **config), pair=pair)


def recorded_steps(engine: LLMEngine) -> list[list[int]]:
    """Accepted drafts per row of every step the engine takes from now on."""
    accepted, step = [], engine.runner.step

    def recording(group, k, *args):
        result = step(group, k, *args)
        accepted.append(result.num_accepted)
        return result
    engine.runner.step = recording
    return accepted


def run(engine: LLMEngine):
    """(outputs, accepted drafts per row of every step) for all PROMPTS."""
    accepted = recorded_steps(engine)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return outs, accepted


def assert_exact_while_it_slides(model_type, method, outs, accepted):
    _, expected = shaped(model_type)
    assert min(map(len, PROMPTS)) + MAX_TOKENS > WINDOW
    for i, (out, want) in enumerate(zip(outs, expected)):
        assert out.error is None, f"{model_type} {method} row {i}: {out.error}"
        assert out.token_ids == want, (f"{model_type} {method} row {i}: got {out.token_ids}, "
                                       f"target alone {want}")
    assert any(len(set(step)) > 1 for step in accepted), \
        f"{model_type} {method}: no step where rows accepted different numbers of drafts"


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
@pytest.mark.parametrize("model_type", list(SHAPES))
def test_sliding_window_is_exact_while_it_slides(model_type, method):
    assert_exact_while_it_slides(model_type, method, *run(engine_for(model_type, method)))


@pytest.mark.parametrize("model_type, method", [
    ("gemma3_text", "exspec"), ("gemma2", "eqspec"),     # make test: one per layout
    pytest.param("gemma2", "exspec", marks=pytest.mark.slow),
    pytest.param("mistral", "exspec", marks=pytest.mark.slow)])
def test_sliding_window_on_the_compiled_path(model_type, method, monkeypatch):
    """enforce_eager false: the compiled forwards take the dict of masks by layer type like one
    mask; exact, and on EXSPEC's block store nothing recompiles or breaks the graph after the
    warm-up (Dynamo's own counters; the eager backend, as in test_compiled.py). EQSPEC's
    PaddedKV recompiles on its DynamicCache tensors whatever the mask (a limit of that layout), so
    there only exactness is held."""
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    try:
        engine = engine_for(model_type, method, enforce_eager=False)
        assert engine.warm_up.graphs > 0 and engine.warm_up.graph_breaks == 0, engine.warm_up
        before = compiled.dynamo_counts()
        assert_exact_while_it_slides(model_type, method, *run(engine))
        if method == "exspec":
            assert compiled.dynamo_counts() == before, (before, compiled.dynamo_counts())
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
@pytest.mark.parametrize("model_type", list(SHAPES))
def test_full_attention_in_sliding_layers_is_caught(model_type, method, monkeypatch):
    """Negative control: the engine loads as usual, then every mask it builds treats the
    sliding layers as full attention; that run must differ from the target alone."""
    real = kv_module.LayerMasks.build

    def windowless(masks, *args):
        return real(kv_module.LayerMasks(dict.fromkeys(masks.windows), masks.dtype), *args)
    engine = engine_for(model_type, method)
    monkeypatch.setattr(kv_module.LayerMasks, "build", windowless)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert all(o.error is None for o in outs)
    assert [o.token_ids for o in outs] != shaped(model_type)[1], \
        f"{model_type} {method}: full attention in sliding layers went unnoticed"


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_draft_and_target_with_different_windows(method):
    """Each model's caches mask by its own layer types and window: a Gemma 2 target (window 5)
    with a Mistral draft of window 3 is exact; given the draft's masks, the target would not be."""
    pair, expected = shaped("gemma2")
    _, draft = build("mistral", seed=4, sliding_window=3)
    mixed = ModelPair(tokenizer(), pair.target, draft, set(), 256)
    engine = LLMEngine(EngineConfig(target_model="g", draft_model="m", method=method,
                                    num_speculative_tokens=3, max_batch_size=4, adaptive_k=False),
                       pair=mixed)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [o.token_ids for o in outs] == expected


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_an_eagle3_head_on_a_sliding_window_target_is_exact(method, tmp_path):
    """An EAGLE-3 head (full attention, its own cache) drafting for a Mistral target whose every
    layer slides (window 5): exact while the window slides, with rows keeping different numbers
    of drafts (the head is trained here on the target's continuations of these prompts)."""
    from exspec.models.eagle3 import load_head
    from eagle3kit import train_head
    pair, _ = shaped("mistral")
    folder = train_head(pair.target, str(tmp_path / "head"), (0, 1, 1), PROMPTS, batches=200)
    head = load_head(folder, pair.target, torch.float32, "cpu")
    with_head = ModelPair(pair.tokenizer, pair.target, None, set(), 256, head=head)
    engine = LLMEngine(EngineConfig(target_model="m", draft_model=folder, proposer="eagle3",
                                    method=method, num_speculative_tokens=3, max_batch_size=4,
                                    adaptive_k=False), pair=with_head)
    assert_exact_while_it_slides("mistral", method, *run(engine))
