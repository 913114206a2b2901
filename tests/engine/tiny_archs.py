"""Tiny random models of any causal-LM type the pinned transformers ships, built from the
type's own config class with small shapes, and the target-only greedy reference for them.

One set of small values is applied wherever a config has that attribute (and to each of its
sub-configs, e.g. a vision tower), so no type gets a hand-picked config; the few keys below the
common ones only make a type's own dimensions agree with the small ones (rotary and MLA head
dims, MoE groups)."""
from __future__ import annotations

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from transformers import PreTrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from exspec.demo.tiny import _init, noisy_copy

VOCAB = 320
SMALL = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=128, head_dim=16, max_position_embeddings=256,
    sliding_window=4,   # shorter than every test's sequences: sliding layers really slide
    pad_token_id=0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
    vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,   # Gemma 3n / 4
    hidden_size_global=64, encoder_hash_byte_group_vocab=VOCAB,          # BLT
    is_decoder=True,   # BERT-style types are causal LMs only as decoders (their own warning)
    # mixtures of experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, n_shared_experts=1,
    n_group=1, topk_group=1,
    # dimensions that must agree with head_dim 16
    rotary_dim=8, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=16,
    q_lora_rank=32,
    # encoder-decoder types: their decoder at the same small shape
    encoder_layers=1, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=128, decoder_ffn_dim=128, num_encoder_layers=1, num_decoder_layers=2,
)

# Types whose own constraints need one more value (None: keep the type's default); each keeps
# the architecture of the type's default config, only smaller.
OVERRIDES = {
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default",
                                                                   "rope_theta": 10000.0}}},
    "gemma3n_text": {"num_kv_shared_layers": 0, "activation_sparsity_pattern": [0.0, 0.0]},
    "gemma4_text": {"per_layer_config": None},           # per-layer overrides of layers 5, 11, ...
    "gemma4_unified_text": {"per_layer_config": None},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},   # its default pattern, once
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},     # no default; conv as the default
    "mamba2": {"num_heads": 8},                                   # heads x head_dim = 2 x hidden
    "prophetnet": {"num_hidden_layers": None},                    # it sets encoder/decoder layers
    "reformer": {"axial_pos_embds_dim": [32, 32], "axial_pos_shape": [16, 16]},
    "xlnet": {"max_position_embeddings": None, "d_head": 16},     # it has no such limit
    "zaya": {"num_experts_per_tok": 1},
}

MODEL_TYPES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def model_class(model_type: str):
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def _has(config, key: str) -> bool:
    attr = getattr(type(config), config.attribute_map.get(key, key), None)
    if isinstance(attr, property) and attr.fset is None:
        return False   # derived (e.g. Falcon's head_dim): set what it is derived from
    try:
        getattr(config, key)
        return True
    except Exception:   # noqa: BLE001  (per-layer attributes raise their own error types)
        return False


def tiny_config(config_class, base: dict | None = None) -> PreTrainedConfig:
    """`config_class` with the SMALL values it has; `base`: a sub-config's values as its parent
    set them (so a parent's defaults for it survive)."""
    base = dict(base or {})
    default = config_class(**base)
    kwargs = {**base, **{k: v for k, v in SMALL.items() if _has(default, k)}}
    if "kv_lora_rank" in kwargs:   # multi-head latent attention: one key per query head
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    for name in getattr(default, "sub_configs", None) or {}:
        child = getattr(default, name, None)
        if isinstance(child, PreTrainedConfig) and _has(child, "hidden_size"):   # a tower
            kwargs[name] = tiny_config(type(child), child.to_dict()).to_dict()
    for key, value in OVERRIDES.get(default.model_type, {}).items():
        if value is None:
            kwargs.pop(key, None)
        else:
            kwargs[key] = value
    try:
        return config_class(**kwargs)
    except (ValueError, StrictDataclassError):
        if not isinstance(getattr(default, "layer_types", None), list):
            raise
        # a per-layer list sized for the default depth: keep the first layers' pattern
        layers = kwargs["num_hidden_layers"]
        return config_class(**{**kwargs, "layer_types": list(default.layer_types[:layers])})


def build(model_type: str, seed: int = 0, **config):
    """(target, draft): seeded random weights, the draft a noisy copy; `config` overrides."""
    cls = model_class(model_type)
    torch.manual_seed(seed)
    small = tiny_config(cls.config_class)
    for key, value in config.items():
        setattr(small, key, value)
    target = _init(cls(small))
    draft = noisy_copy(target, seed + 1)
    for model in (target, draft):
        if hasattr(model, "set_default_language"):   # X-MOD: one adapter per language
            model.set_default_language(model.config.languages[0])
    return target, draft


@torch.inference_mode()
def greedy_reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Target alone, batch 1, no cache at all: every token from a full forward."""
    ids = list(prompt)
    for _ in range(max_tokens):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]
