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
from exspec.models.loading import ModelPair

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
    from exspec.kv.padded import PaddedKV
    from exspec.kv.blocks import BlockStores
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


# -- RoPE types: a long row beside a short one ------------------------------------------------
# Every rope_type of the pinned transformers (ROPE_INIT_FUNCTIONS, plus "default"), each with the
# keys it needs and its switch point (original_max_position_embeddings, or for dynamic NTK
# max_position_embeddings) at 16: a 35-token row passes it, a 2-token row beside it does not.
# longrope and dynamic choose their frequencies from the longest position of the whole forward
# (transformers' dynamic_rope_update), so a short row's tokens change when a long row shares it:
# refused at load unless max_model_len keeps every position below the switch.
SWITCH = 16
ROPE_PARAMETERS = {
    "default": {},
    "linear": {"factor": 2.0},
    "dynamic": {"factor": 4.0},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": SWITCH},
    "longrope": {"short_factor": [1.0] * 8, "long_factor": [1.0 + i for i in range(8)],
                 "original_max_position_embeddings": SWITCH},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": SWITCH},
    "proportional": {"factor": 2.0, "partial_rotary_factor": 0.5},
}
ROPE_REFUSED = {"longrope": "original_max_position_embeddings", "dynamic": "max_position_embeddings"}
LONG_AND_SHORT = [list(range(1, 36)), [40, 41]]


def rope_models(model_type: str, rope_type: str):
    extra = {"max_position_embeddings": SWITCH} if rope_type == "dynamic" else {}
    if model_type == "phi3":   # Phi-3 copies its top-level original_max_position_embeddings in
        extra["original_max_position_embeddings"] = SWITCH
    return build(model_type, rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0,
                                              **ROPE_PARAMETERS[rope_type]}, **extra)


def test_rope_sweep_covers_every_rope_type_of_the_pinned_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    assert set(ROPE_PARAMETERS) == {"default", *ROPE_INIT_FUNCTIONS}


@pytest.mark.parametrize("model_type, rope_type",
                         [("llama", t) for t in ROPE_PARAMETERS] + [("phi3", "longrope")])
def test_rope_type_is_exact_beside_a_long_row_or_refused(model_type, rope_type):
    target, draft = rope_models(model_type, rope_type)
    assert target.config.rope_parameters["rope_type"] == rope_type

    def served(max_model_len, method):
        return LLMEngine(EngineConfig(target_model="r", draft_model="r", method=method,
                                      num_speculative_tokens=3, max_batch_size=4, adaptive_k=False),
                         pair=ModelPair(tokenizer(), target, draft, set(), max_model_len))

    def assert_exact_on(engine, prompts, label):
        outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        for i, (out, p) in enumerate(zip(outs, prompts)):
            want = greedy_reference(target, p, MAX_TOKENS)
            assert out.token_ids == want, f"{model_type} {rope_type} {label} row {i}: got {out.token_ids}, alone {want}"

    # the hazard itself, in the model's own forward: does the short row change beside the long?
    long, short = LONG_AND_SHORT
    with torch.inference_mode():
        alone = target(input_ids=torch.tensor([short])).logits[0]
        ids = torch.tensor([long, [0] * (len(long) - len(short)) + short])
        mask = (torch.arange(len(long)) >= len(long) - len(short)).long().expand(2, -1).clone()
        mask[0] = 1
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        beside = target(input_ids=ids, attention_mask=mask, position_ids=pos).logits[1, -len(short):]
    batch_dependent = float((beside - alone).abs().max()) > 1e-4
    assert batch_dependent == (rope_type in ROPE_REFUSED), (
        f"{rope_type}: the short row {'changes' if batch_dependent else 'does not change'} beside a long one")
    for method in ("eqspec", "exspec"):
        if rope_type in ROPE_REFUSED:
            with pytest.raises(ModelLoadError) as caught:
                served(256, method)
            message = str(caught.value)
            assert rope_type in message and ROPE_REFUSED[rope_type] in message, message
            # with max_model_len at the switch, one set of frequencies always applies: exact
            assert_exact_on(served(SWITCH, method), [[5, 9, 17], [40, 41], [3] * 9], f"{method} capped")
        else:
            assert_exact_on(served(256, method), LONG_AND_SHORT, method)
