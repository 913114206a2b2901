"""Every causal-LM type the pinned transformers ships is exact, or refused when it loads.

The types come from transformers' own MODEL_FOR_CAUSAL_LM_MAPPING_NAMES (196 in 5.24.0), not
from a list picked here. Each gets a tiny seeded random target of its own modeling code and a
noisy copy as the draft (tests/engine/tiny_archs.py) and ends in exactly one of:
- exact: eqspec and exspec (batch 4, k = 3) equal target-only greedy at batch 1 on every prompt;
- refused at load: the engine's constructor raises ModelLoadError naming the architecture and
  one of the reasons in REFUSED (architecture.py);
- in COULD_NOT_BUILD: the test cannot build a tiny model of it (the reason is checked too).
Anything else fails: a crash, a wrong token, an unexpected refusal or reason. The full
method x batch x k matrix runs on a handful of exact types only.
"""
from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from exspec import EngineConfig, LLMEngine, ModelLoadError, SamplingParams
from exspec.demo.tiny import build_tokenizer
from exspec.models import ModelPair

from tiny_archs import MODEL_TYPES, build, greedy_reference

PROMPTS = [[5, 9, 17, 33, 2], [40], [7, 8, 9, 10, 11, 12, 13, 14, 15], [100, 3]]
MAX_TOKENS = 6

REASONS = {   # a phrase of each refusal message (architecture.py)
    "local-columns": "local attention layers build their window from column indices",
    "chunked": "'chunked_attention' layers cannot be masked",
    "loops": "recurrent-depth loops attend over the cache entries of other loops",
    "window-rule": "do not take their window from the mask of their layer type",
    "recurrent": "linear-attention or state-space (recurrent) layers",
    "indexed": "sparse (indexed) attention layers",
    "encoder-decoder": "encoder-decoder model",
    "no-cache": "takes no KV cache",
    "no-cache-config": "builds no KV cache from its config",
    "no-positions": "takes no position ids",
    "positions-offset": "own positions are not 0, 1, 2",
    "bidirectional": "attention is bidirectional",
    "image-mask": "image-patch cache entries",
}

REFUSED: dict[str, str] = {}        # model type -> REASONS key; filled below
for reason, types in {
    "local-columns": "gpt_neo",
    "chunked": "llama4 llama4_text",
    "loops": "dory",
    "window-rule": "moshi",   # its eager/SDPA forward ignores its own sliding_window
    "recurrent": "bailing_hybrid bamba deepseek_v4 falcon_h1 falcon_mamba granitemoehybrid "
                 "inkling2_loop_text inkling2_text inkling_text jamba kimi_linear lara_mini "
                 "lfm2_moe lfm3 mamba mamba2 minimax nemotron_h olmo_hybrid qwen3_5 qwen3_5_moe "
                 "qwen3_5_moe_text qwen3_5_text qwen3_next qwen4_exp qwen4_exp_text "
                 "recurrent_gemma rwkv xlstm zamba zamba2 zaya",
    "indexed": "axk2 deepseek_v32 dots3_note dots3_note_text glm_moe_dsa hy_v4",
    "encoder-decoder": "bart bigbird_pegasus blenderbot blenderbot-small marian mbart "
                       "moss_transcribe_diarize musicgen mvp pegasus plbart prophetnet trocr "
                       "whisper",
    "no-cache": "openai-gpt reformer xlnet",
    "no-cache-config": "blt",
    "no-positions": "cpmant musicgen_melody roformer",
    "positions-offset": "camembert data2vec-text roberta roberta-prelayernorm xlm-roberta xmod "
                        "xlm-roberta-xl",
    "bidirectional": "xlm",
    "image-mask": "git",
}.items():
    REFUSED.update(dict.fromkeys(types.split(), reason))

COULD_NOT_BUILD = {   # model type -> (what building it raises, or "" when not tried; why)
    "dbrx": ("has no attribute 'rope_theta'", "its default attention sub-config has no "
             "rope_theta in transformers 5.24.0 (and given one, its FFN keeps hidden size 2048)"),
    "gemma3n": ("requires the timm library", "its vision tower needs timm, which is not a "
                                             "dependency"),
    "gemma4_assistant": ("hidden_size_per_layer_input must be 0", "its own default config fails "
                                                                  "transformers' validation"),
    "gemma4_unified_assistant": ("set of layer types producing a cache", "its KV-sharing "
                                 "pattern does not fit in a two-layer config"),
}


@lru_cache(maxsize=1)
def tokenizer():
    return build_tokenizer()


@lru_cache(maxsize=4)
def pair(model_type: str):
    target, draft = build(model_type)
    return ModelPair(tokenizer(), target, draft, set(), 256)


@lru_cache(maxsize=4)
def reference(model_type: str, prompts: tuple, max_tokens: int) -> list[list[int]]:
    return [greedy_reference(pair(model_type).target, list(p), max_tokens) for p in prompts]


def engine(model_type: str, method: str, k: int = 3, batch: int = 4) -> LLMEngine:
    return LLMEngine(EngineConfig(target_model=model_type, draft_model=model_type, method=method,
                                  num_speculative_tokens=k, max_batch_size=batch,
                                  adaptive_k=False), pair=pair(model_type))


def assert_exact(model_type, method, prompts, max_tokens, k=3, batch=4):
    outs = engine(model_type, method, k, batch).generate(
        prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    expected = reference(model_type, tuple(map(tuple, prompts)), max_tokens)
    for i, (out, want) in enumerate(zip(outs, expected)):
        assert out.error is None, f"{model_type} {method} row {i}: {out.error}"
        assert out.token_ids == want, (f"{model_type} {method} k={k} B={batch} row {i}: got "
                                       f"{out.token_ids}, target alone {want}")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_model_type_is_exact_or_refused_when_it_loads(model_type):
    if model_type in COULD_NOT_BUILD:
        raises, why = COULD_NOT_BUILD[model_type]
        if raises:   # still true? (else the entry is stale and the type belongs in the sweep)
            with pytest.raises(Exception, match=raises):
                build(model_type)[0](input_ids=torch.tensor([[1, 2, 3]]))
        pytest.skip(f"could not build a tiny {model_type}: {why}")
    for method in ("eqspec", "exspec"):
        if model_type in REFUSED:
            with pytest.raises(ModelLoadError) as caught:
                engine(model_type, method)
            message = str(caught.value)
            assert type(pair(model_type).target).__name__ in message, message
            assert REASONS[REFUSED[model_type]] in message, f"{model_type} {method}: {message}"
        else:
            assert_exact(model_type, method, PROMPTS, MAX_TOKENS)


MATRIX_TYPES = ["qwen3", "mixtral", "gpt_neox", "falcon", "mpt"]
MATRIX_PROMPTS = [[5, 9, 17, 33, 2], [40], [7, 8, 9, 10, 11, 12, 13, 14, 15], [100, 3],
                  [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
                  [250, 251], [60, 61, 62], [9] * 7]


@pytest.mark.parametrize("model_type", MATRIX_TYPES)
@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_method_batch_and_k_matrix_is_exact(model_type, method):
    for batch in (1, 3, 8):
        for k in (1, 2, 5):
            assert_exact(model_type, method, MATRIX_PROMPTS, 10, k=k, batch=batch)


def test_sweep_covers_every_causal_lm_type_of_the_pinned_transformers():
    import transformers
    assert transformers.__version__ == "5.24.0"
    assert not set(REFUSED) & set(COULD_NOT_BUILD), set(REFUSED) & set(COULD_NOT_BUILD)
    listed = set(REFUSED) | set(COULD_NOT_BUILD)
    assert listed <= set(MODEL_TYPES), f"not causal-LM types: {sorted(listed - set(MODEL_TYPES))}"
    exact = [t for t in MODEL_TYPES if t not in listed]
    assert len(MODEL_TYPES) > 150 and len(exact) > 60, (len(MODEL_TYPES), len(exact))


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_mistral_without_a_window_is_exact(method):
    """Most checkpoints of Mistral, Qwen2 and Phi-3 ship without a window (sliding_window
    null): every layer is full attention, and EQSPEC passes its plain 2D mask."""
    target, draft = build("mistral", sliding_window=None)
    assert target.config.sliding_window is None
    served = LLMEngine(EngineConfig(target_model="m", draft_model="m", method=method,
                                    num_speculative_tokens=3, max_batch_size=4, adaptive_k=False),
                       pair=ModelPair(tokenizer(), target, draft, set(), 256))
    outs = served.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [o.token_ids for o in outs] == [greedy_reference(target, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("model_type, config", [("bloom", {}), ("falcon", {"alibi": True})])
def test_alibi_from_a_2d_mask_runs_exspec_on_the_right_aligned_layout(model_type, config):
    """Bloom (and Falcon with `alibi: true`) build ALiBi from the 2D mask's cumulative sum and
    take no 4D mask (exspec's own layout crashed them at the first request): exspec runs them
    on EQSPEC's right-aligned layout, realigning each stepped group, exactly; other models keep
    the block store."""
    from exspec.kv import PaddedKV
    from exspec.kv_blocks import BlockStores
    target, draft = build(model_type, **config)
    loaded = ModelPair(tokenizer(), target, draft, set(), 256)
    served = LLMEngine(EngineConfig(target_model="a", draft_model="a", method="exspec",
                                    num_speculative_tokens=3, max_batch_size=4, adaptive_k=False),
                       pair=loaded)
    assert served.runner.kv_layout is PaddedKV
    assert isinstance(engine("llama", "exspec").runner.kv_layout, BlockStores)
    prompts = MATRIX_PROMPTS
    outs = served.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    assert [o.token_ids for o in outs] == [greedy_reference(target, p, 10) for p in prompts]
    assert served.stats()["realign_steps"] > 0   # ragged groups were realigned, not refused
