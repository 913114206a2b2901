"""EAGLE-3 heads (Li et al., 2025), in vLLM's `llama_eagle3` checkpoint layout (design:
"Proposers").

A head drafts from the target's own hidden states: the inputs of three of the target's decoder
layers (low, middle, high; vLLM's default ids 2, L // 2, L - 3) are concatenated and projected by
`fc` (3 x target hidden -> hidden): a *feature*. One decoder layer reads [its norm of the
token's embedding; its norm of the feature] (its q/k/v take 2 x hidden), then a norm and its own
`lm_head` over a reduced draft vocabulary whose ids map to the target's by `d2t` (target id =
draft id + d2t[draft id]). Drafting feeds the head's own output (before the norm) back as the
next feature.

exspec's layout of the head's cache (spec/eagle3.py): entry e holds (token e, feature of target
position e - 1), the first entry a zero feature, at rotary position e. vLLM keeps (token e + 1,
feature e) at position e: the same pairs shifted by one position, and attention sees relative
positions only, so the two agree except that exspec's cache has one extra entry (the first
token, zero feature). What it buys: an entry depends on the tokens up to its own position alone,
so the head's cache follows the target's rows, blocks and prefix-cache hashes as a draft model's
does.

`load_head` reads a head folder as vLLM's loader does and refuses, naming both sides, a head
made for another target; `save_head` writes one (scripts/train_smollm2_eagle3.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.masking_utils import create_causal_mask
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaMLP,
                                                      LlamaPreTrainedModel, LlamaRMSNorm,
                                                      LlamaRotaryEmbedding)

from ..errors import ModelLoadError

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
WEIGHTS = ("model.safetensors", "pytorch_model.bin")


@dataclass
class HeadOutput:
    logits: torch.Tensor   # [B, keep, target vocabulary]: -inf outside the draft vocabulary
    hidden: torch.Tensor   # [B, keep, hidden]: the output before the norm, the next draft's feature


def default_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default auxiliary layers of a target with `num_layers` decoder layers."""
    return (2, num_layers // 2, num_layers - 3)


class HeadLayer(nn.Module):
    """The head's one decoder layer: a Llama layer whose attention reads [embedding; feature]."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.self_attn = LlamaAttention(config, layer_idx=0)
        attn = self.self_attn
        bias = getattr(config, "attention_bias", False)
        attn.q_proj = nn.Linear(2 * hidden, heads * attn.head_dim, bias=bias)
        attn.k_proj = nn.Linear(2 * hidden, config.num_key_value_heads * attn.head_dim, bias=bias)
        attn.v_proj = nn.Linear(2 * hidden, config.num_key_value_heads * attn.head_dim, bias=bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, features, embeds, attention_mask=None, position_ids=None, cache=None,
                use_cache=None, position_embeddings=None, **kwargs):
        normed = self.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x, _ = self.self_attn(hidden_states=x, attention_mask=attention_mask,
                              position_ids=position_ids, cache=cache, use_cache=use_cache,
                              position_embeddings=position_embeddings, **kwargs)
        x = residual + x
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(LlamaPreTrainedModel):
    """An EAGLE-3 head (module doc). `config.vocab_size` is the target's vocabulary,
    `config.draft_vocab_size` the head's; `layer_ids` the target layers whose inputs it reads."""

    def __init__(self, config: LlamaConfig, layer_ids: tuple[int, ...], target_hidden: int):
        config.num_hidden_layers = 1
        super().__init__(config)
        hidden = config.hidden_size
        self.layer_ids = tuple(layer_ids)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)   # the target's, when shared
        self.fc = nn.Linear(len(self.layer_ids) * target_hidden, hidden, bias=False)
        self.layers = nn.ModuleList([HeadLayer(config)])
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        # draft id -> target id offset (vLLM's d2t); unused when the vocabularies are one
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        # the target id of each draft id (d2t applied once, not per draft forward: map_vocab)
        self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size), persistent=False)
        self.post_init()

    def map_vocab(self) -> None:
        """Derive `draft_ids` from `d2t`, once its values are set."""
        self.draft_ids = torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def get_input_embeddings(self):
        return self.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    @property
    def reduced_vocab(self) -> bool:
        return self.config.draft_vocab_size != self.config.vocab_size

    def project(self, layer_inputs: list[torch.Tensor]) -> torch.Tensor:
        """The feature [B, T, hidden] of the target's layer inputs ([B, T, target hidden] each)."""
        return self.fc(torch.cat([h.to(self.fc.weight.dtype) for h in layer_inputs], dim=-1))

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None,
                use_cache=None, logits_to_keep: int = 0, features=None, **kwargs) -> HeadOutput:
        embeds = self.embed_tokens(input_ids)
        mask = create_causal_mask(config=self.config, inputs_embeds=embeds,
                                  attention_mask=attention_mask, cache=cache,
                                  position_ids=position_ids)
        out = self.layers[0](features, embeds, attention_mask=mask, position_ids=position_ids,
                             cache=cache, use_cache=use_cache,
                             position_embeddings=self.rotary_emb(embeds, position_ids=position_ids))
        hidden = out[:, -logits_to_keep:] if logits_to_keep else out
        return HeadOutput(self.target_logits(self.lm_head(self.norm(hidden))), hidden)

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., draft vocabulary] -> [..., target vocabulary], -inf at ids the head never drafts."""
        if not self.reduced_vocab:
            return logits
        out = logits.new_full(logits.shape[:-1] + (self.config.vocab_size,), float("-inf"))
        out[..., self.draft_ids] = logits
        return out


def head_for(target, layer_ids: tuple[int, ...] | None = None,
             draft_ids: list[int] | None = None) -> Eagle3Head:
    """A new head (random weights) for `target`: its hidden size, heads, MLP width and rotary
    settings, reading `layer_ids` (default: vLLM's), drafting over `draft_ids` (target ids;
    default: all)."""
    hidden, layers, vocab = _target_shape(target)
    cfg = target.config.get_text_config(decoder=True)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=getattr(cfg, "rope_parameters", None), tie_word_embeddings=False,
        num_hidden_layers=1)
    config.draft_vocab_size = vocab if draft_ids is None else len(draft_ids)
    head = Eagle3Head(config, layer_ids or default_layer_ids(layers), hidden)
    if draft_ids is not None:
        head.d2t.copy_(torch.tensor(sorted(draft_ids)) - torch.arange(len(draft_ids)))
        head.map_vocab()
    head.embed_tokens.weight = target.get_input_embeddings().weight
    return head


# -- loading and saving -----------------------------------------------------------------------
def _target_shape(target) -> tuple[int, int, int]:
    cfg = target.config.get_text_config(decoder=True)
    return cfg.hidden_size, cfg.num_hidden_layers, target.get_output_embeddings().weight.shape[0]


def _read_weights(folder: Path, where: str) -> dict[str, torch.Tensor]:
    for name in WEIGHTS:
        path = folder / name
        if path.exists():
            try:
                if name.endswith(".safetensors"):
                    from safetensors.torch import load_file
                    return load_file(str(path))
                return torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:   # each format fails in its own words; the cause is the file
                raise ModelLoadError(f"{where}: {name} cannot be read ({type(exc).__name__}: "
                                     f"{exc}); it is truncated or corrupt: download or save it "
                                     "again") from exc
    raise ModelLoadError(f"{where}: no weights ({' or '.join(WEIGHTS)})")


def _check_values(weights: dict[str, torch.Tensor], where: str) -> None:
    """Floating-point, finite weights (an int8 tensor would be cast silently on load, a NaN
    would spread into every draft); d2t holds integer offsets."""
    for name, tensor in weights.items():
        if name == "d2t":
            if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
                raise ModelLoadError(f"{where}: d2t is {tensor.dtype}; it holds integer offsets "
                                     "(draft id -> target id)")
        elif not tensor.dtype.is_floating_point:
            raise ModelLoadError(f"{where}: weight {name} is {tensor.dtype}, not floating point "
                                 "(a quantized head is not supported): save it in float32, "
                                 "float16 or bfloat16")
        elif not torch.isfinite(tensor).all():
            raise ModelLoadError(f"{where}: weight {name} holds NaN or Inf values: the checkpoint "
                                 "is corrupt or its training diverged")


def _read_config(path: Path, where: str) -> dict:
    """config.json as a dict, its values that would fail deep inside transformers (or load
    and then fail at the first draft) checked here."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except ValueError as exc:   # not JSON, or not UTF-8
        raise ModelLoadError(f"{where}: config.json is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{where}: config.json holds a {type(raw).__name__}; it must be a "
                             "JSON object")
    if not isinstance(raw.get("eagle_config") or {}, dict):
        raise ModelLoadError(f"{where}: config.json's eagle_config must be a JSON object")
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = raw.get(key, 1)   # absent: transformers' default
        if type(value) is not int or value <= 0:
            raise ModelLoadError(f"{where}: config.json's {key} is {value!r}; it must be a "
                                 "positive integer")
    act = raw.get("hidden_act", "silu")
    if act not in ACT2FN:
        raise ModelLoadError(f"{where}: config.json's hidden_act {act!r} is not an activation "
                             f"transformers knows ({', '.join(sorted(ACT2FN))})")
    return raw


def _checkpoint_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM's renames: the decoder layer under `midlayer.` or `layers.0.`, an optional `model.`
    prefix; `t2d` (the inverse map) is not needed."""
    out = {}
    for name, tensor in weights.items():
        name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
        if name != "t2d":
            out[name] = tensor
    return out


def load_head(folder: str, target, dtype: torch.dtype, device) -> Eagle3Head:
    """An EAGLE-3 head for `target` from `folder` (config.json + weights, vLLM's layout); what
    does not fit the target is refused with both sides named. Every failure is one
    ModelLoadError naming the folder and the cause."""
    where = f"EAGLE-3 head {folder}"
    try:
        return _load_head(Path(folder).expanduser(), where, target, dtype, device)
    except ModelLoadError:
        raise
    except Exception as exc:   # whatever the checks do not name is still this folder's fault
        raise ModelLoadError(f"{where} cannot be loaded: {type(exc).__name__}: {exc}") from exc


def _load_head(path: Path, where: str, target, dtype: torch.dtype, device) -> Eagle3Head:
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{where}: no config.json there (method 'eagle3' needs "
                             "speculative_config.model: a head's folder)")
    raw = _read_config(path, where)
    if not set(raw.get("architectures") or ()) & set(ARCHITECTURES):
        raise ModelLoadError(f"{where}: architectures {raw.get('architectures')} is not an EAGLE-3 "
                             f"head ({' or '.join(ARCHITECTURES)})")
    eagle = raw.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise ModelLoadError(f"{where}: eagle_config.use_aux_hidden_state is false (an EAGLE-1/2 "
                             "head on the last layer alone), which exspec does not run")
    hidden, layers, vocab = _target_shape(target)
    head_target_hidden = raw.get("target_hidden_size") or raw.get("hidden_size")
    if head_target_hidden != hidden:
        raise ModelLoadError(f"{where} reads target hidden states of size {head_target_hidden}, "
                             f"the target's are {hidden}: it was made for another target")
    if raw.get("vocab_size") != vocab:
        raise ModelLoadError(f"{where} has a target vocabulary of {raw.get('vocab_size')}, the "
                             f"target has {vocab} logits: it was made for another target")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") or default_layer_ids(layers)
    if (not isinstance(ids, (list, tuple)) or len(ids) != 3
            or any(type(i) is not int or not 0 <= i < layers for i in ids)):
        raise ModelLoadError(f"{where} reads the target's layers {ids}, the target has "
                             f"{layers} (integer ids 0-{layers - 1}, three of them)")
    ids = tuple(ids)
    try:
        config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "eagle_config")})
    except Exception as exc:   # transformers' own type checks of the values
        raise ModelLoadError(f"{where}: config.json's values do not make a Llama config "
                             f"({type(exc).__name__}: {exc})") from exc
    rope = (config.rope_parameters or {}).get("rope_type", "default")
    if rope != "default" and rope not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(f"{where}: config.json's rope type {rope!r} is not one transformers "
                             f"knows (default, {', '.join(ROPE_INIT_FUNCTIONS)})")
    config.draft_vocab_size = raw.get("draft_vocab_size") or vocab
    weights = _checkpoint_names(_read_weights(path, where))
    _check_values(weights, where)
    if config.draft_vocab_size != vocab and "d2t" not in weights:
        raise ModelLoadError(f"{where} drafts over {config.draft_vocab_size} ids of the target's "
                             f"{vocab} but has no d2t (draft id -> target id) in its weights")
    head = Eagle3Head(config, ids, hidden)
    own = head.state_dict()
    shared = "embed_tokens.weight" not in weights
    if shared:
        target_embed = target.get_input_embeddings().weight
        if target_embed.shape != own["embed_tokens.weight"].shape:
            raise ModelLoadError(f"{where} has no embeddings and its hidden size "
                                 f"{config.hidden_size} differs from the target's embeddings "
                                 f"{tuple(target_embed.shape)}")
    missing = sorted(set(own) - set(weights) - ({"embed_tokens.weight"} if shared else set())
                     - ({"d2t"} if not head.reduced_vocab else set()))
    unexpected = sorted(set(weights) - set(own))
    if missing or unexpected:
        raise ModelLoadError(f"{where}: weights do not match vLLM's llama_eagle3 layout "
                             f"(missing {missing}, unexpected {unexpected})")
    wrong = [f"{n} {tuple(t.shape)} (expected {tuple(own[n].shape)})" for n, t in weights.items()
             if t.shape != own[n].shape]
    if wrong:
        raise ModelLoadError(f"{where}: weights of other shapes: {', '.join(wrong)}")
    head.load_state_dict(weights, strict=False)
    head = head.to(dtype=dtype, device=device)
    if shared:   # the target's own tensor: no copy
        head.embed_tokens.weight = target.get_input_embeddings().weight
    head.map_vocab()
    if head.reduced_vocab:
        drafted = head.draft_ids
        if int(drafted.min()) < 0 or int(drafted.max()) >= vocab or drafted.unique().numel() != len(drafted):
            raise ModelLoadError(f"{where}: d2t maps draft ids outside the target's {vocab} ids "
                                 "or two draft ids to one target id")
    return head.eval().requires_grad_(False)


def save_head(head: Eagle3Head, folder: str | Path, dtype: torch.dtype = torch.float16) -> None:
    """Write `head` in vLLM's layout (config.json, model.safetensors; embeddings left out: the
    target's are shared)."""
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = head.config.to_dict()
    for key in ("architectures", "num_hidden_layers", "dtype", "torch_dtype", "transformers_version"):
        config.pop(key, None)
    config.update(architectures=[ARCHITECTURES[0]], num_hidden_layers=1, dtype="float32",
                  target_hidden_size=head.fc.in_features // len(head.layer_ids),
                  eagle_config={"eagle_aux_hidden_state_layer_ids": list(head.layer_ids),
                                "use_aux_hidden_state": True})
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    weights = {}
    for name, tensor in head.state_dict().items():
        if name == "embed_tokens.weight":
            continue
        name = name.replace("layers.0.", "midlayer.")
        weights[name] = tensor.contiguous() if name == "d2t" else tensor.to(dtype).contiguous()
    if head.reduced_vocab:   # the inverse map, as EAGLE's and SpecForge's checkpoints carry it
        t2d = torch.zeros(head.config.vocab_size, dtype=torch.bool)
        t2d[head.draft_ids.cpu()] = True
        weights["t2d"] = t2d
    else:
        weights.pop("d2t")
    save_file(weights, str(folder / "model.safetensors"))
