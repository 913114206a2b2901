"""Which architectures the KV layouts serve exactly, decided when the model loads (design: "Models").

Both layouts (kv.padded.PaddedKV, kv.blocks.BlockKV) keep one cache entry per committed token in
every layer (sliding-window layers too), give every row its own positions through
`position_ids`, and describe what each query may see with an attention mask (EQSPEC's
right-aligned rows: 2D when every layer is full attention; otherwise, and always in EXSPEC's
block store, one 4D mask per layer type built from positions, kv.LayerMasks). A model that
needs anything else would load, report READY and then fail (or, worse, differ) at the first
request; here it is refused instead, with its architecture and the reason. The sweep
test (tests/engine/test_architectures.py) runs every causal-LM type of the pinned transformers
against these rules: each one is exact or refused here.
"""
from __future__ import annotations

import inspect
import logging

import torch
from transformers.models.auto.modeling_auto import (MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
                                                    MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES)

from ..config import FLEX_ATTENTION
from ..errors import ModelLoadError
from ..kv.blocks import BlockStores
from ..kv.in_place import unsupported as unsupported_in_place
from ..kv.in_place import use_in_place
from ..kv.padded import LayerMasks, PaddedKV, cache_layer_classes, uses_alibi
from .compiled import static_shapes_on

log = logging.getLogger("exspec")

ENCODER_DECODER_TYPES = set(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES) | set(
    MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES)
# ALiBi built from the 2D attention mask's cumulative sum: their forward takes no 4D mask, so
# they run on the right-aligned layout under either method (kv_layout). (MPT's ALiBi depends
# on key columns only and serves both layouts.)
ALIBI_FROM_2D_MASK = {"bloom", "falcon"}
# GIT widens a 2D mask over image-patch entries it expects in the cache, even for text only,
# which shifts every padded row of a batch by that many columns.
MASK_REWRITTEN_FOR_IMAGES = {"git"}
# Dory runs its middle layers in loops ("recurrent depth") that read the cache other loops wrote
LOOPS_OVER_CACHE = {"dory"}
# a sliding layer's cache is kept whole (kv.new_cache): its mask does the windowing
SERVED_CACHE_LAYERS = {"DynamicLayer", "DynamicSlidingWindowLayer"}


class Refused(Exception):
    """Internal: the reason one model cannot be served."""


def check_servable(model, role: str, method: str, max_model_len: int | None = None) -> None:
    """Raise ModelLoadError naming the architecture and the reason, or return. `max_model_len`:
    the longest row the engine serves (the target's RoPE is checked against it)."""
    if method == "autoregressive" and role == "draft":
        return
    try:
        _check(model)
        if role == "target" and max_model_len is not None:
            # a draft's batch-dependent tokens cost acceptance, never exactness: the target decides
            _check_rope(model.config.get_text_config(decoder=True), max_model_len)
    except Refused as why:
        cfg = model.config
        raise ModelLoadError(f"the {role} model {type(model).__name__} (model_type "
                             f"{cfg.model_type!r}) cannot be served exactly: {why}") from None


def _check(model) -> None:
    cfg = model.config
    text = cfg.get_text_config(decoder=True)
    params = inspect.signature(model.forward).parameters
    if model.get_output_embeddings() is None:
        raise Refused("it has no causal-LM head (no output embeddings to take logits from)")
    if cfg.is_encoder_decoder or cfg.model_type in ENCODER_DECODER_TYPES or _has_cross_attention(model):
        raise Refused("it is (the decoder of) an encoder-decoder model: its layers attend to an "
                      "encoder's output, which a causal-LM pair does not have")
    recurrent = Refused("it has linear-attention or state-space (recurrent) layers, whose "
                        "state cannot be cut back to a row's accepted tokens")
    if getattr(model, "_is_stateful", False):
        raise recurrent
    if "cache" not in params:
        raise Refused("its forward takes no KV cache (`cache`), so tokens cannot be appended "
                      "to a row")
    try:
        layers = {cls.__name__ for cls in cache_layer_classes(model)}
    except Exception as exc:   # noqa: BLE001  (new_cache would raise the same at a request)
        raise Refused(f"transformers builds no KV cache from its config "
                      f"({type(exc).__name__}: {exc})") from None
    if any("LinearAttention" in name for name in layers):
        raise recurrent
    if "local" in (getattr(text, "attention_layers", None) or []):
        raise Refused("its local attention layers build their window from column indices inside "
                      "attention, not from the mask, so padded or ragged rows get the wrong window")
    if "DynamicIndexedLayer" in layers:
        raise Refused("it has sparse (indexed) attention layers, whose indexer cache the KV "
                      "layouts cannot cut back or realign")
    if "DummyLayer" in layers:
        raise Refused("it has layers that share another layer's KV cache or cache nothing, "
                      "which the KV layouts do not model")
    if layers - SERVED_CACHE_LAYERS:
        raise Refused(f"it has {', '.join(sorted(layers - SERVED_CACHE_LAYERS))} cache layers, "
                      "which the KV layouts cannot cut back or realign")
    try:
        masks = LayerMasks.of(model)
    except ModelLoadError as exc:
        raise Refused(str(exc)) from None
    if cfg.model_type in LOOPS_OVER_CACHE:
        raise Refused("its recurrent-depth loops attend over the cache entries of other loops "
                      "and window them by column, which the KV layouts do not model")
    if cfg.model_type in MASK_REWRITTEN_FOR_IMAGES:
        raise Refused("it widens a 2D attention mask over image-patch cache entries even for "
                      "text-only input, which misaligns padded rows")
    alibi = uses_alibi(cfg)
    if "position_ids" not in params and not alibi:
        raise Refused("its forward takes no position ids: it derives positions from the cache "
                      "length, so the rows of a batch cannot each keep their own (I1)")
    problem = _probe(model, takes_positions="position_ids" in params) or _probe_windows(model, masks)
    if problem:
        raise Refused(problem)


def _check_rope(text, max_model_len: int) -> None:
    """longrope and dynamic NTK choose their frequencies from the longest position in the whole
    forward (transformers' dynamic_rope_update), so past their switch point a short row's tokens
    change when a long row shares its forward. Below it one set of frequencies always applies."""
    params = getattr(text, "rope_parameters", None) or {}
    per_layer = list(params.values()) if params and all(isinstance(v, dict) for v in params.values()) else [params]
    for rope in per_layer:
        rope_type = rope.get("rope_type", "default")
        if rope_type == "longrope":
            key = "original_max_position_embeddings"
            switch = rope.get(key) or getattr(text, key, None)
            what = "switches every row to its long factors"
        elif "dynamic" in rope_type:
            key, switch = "max_position_embeddings", getattr(text, "max_position_embeddings", None)
            what = "rescales its base for every row"
        else:
            continue
        if switch is not None and max_model_len > switch:
            raise Refused(f"its RoPE (rope_type {rope_type!r}) {what} once the longest position "
                          f"in a forward passes {key} ({switch}), so a short row's tokens would "
                          f"depend on a longer row batched with it; set max_model_len to at most "
                          f"{switch} (now {max_model_len}) to serve it exactly")


def kv_layout(config, models):
    """The KV layout a method runs on: EXSPEC's block store (each row's entries at their
    positions, a 4D mask) or EQSPEC's right-aligned PaddedKV. A model that builds ALiBi from a 2D
    mask takes no 4D one, and no 2D mask describes rows at their own offsets, so a pair with
    such a model runs exspec's pool and tick on PaddedKV, each stepped group realigned like
    EQSPEC's batch."""
    if config.method == "exspec" and not any(m is not None and _alibi_from_2d_mask(m.config)
                                             for m in models):
        # admission reserves the same entries in every model's store: each gets its share
        budget, count = config.max_num_kv_tokens, sum(m is not None for m in models)
        in_place = _in_place(config, models)
        # block tables in powers of two only where a graph is per concrete shape (CUDA graphs)
        # and for the read in place (as before): inductor's symbolic graphs take any width, and
        # a bucket gathers up to twice the columns rows hold (suffix decoding at B = 8 on
        # open chat, plain steps: 0.92x the padded layout bucketed, 0.95x not)
        bucketed = not config.enforce_eager and (in_place or static_shapes_on(config.device))
        return BlockStores(config.device, None if budget is None else budget // count,
                           bucketed=bucketed, prefix_caching=_prefix_caching(config, models),
                           in_place=in_place, max_rows=config.max_batch_size)
    _prefix_caching(config, models)   # says why it is off
    return PaddedKV


def _prefix_caching(config, models) -> bool:
    """Whether the block store shares cached prefixes (engine/prefix_caching.py): asked for and exact.
    Not on EQSPEC's PaddedKV (rows realigned every step: no block outlives a step), and not
    for sliding-window or ALiBi models, where this store keeps no proof that a block's entries
    serve another row unchanged. Off with one line in the load log saying why."""
    if not config.enable_prefix_caching:
        return False
    why = None
    if config.method != "exspec":
        why = f"method {config.method} runs on the padded layout, which has no blocks to share"
    for model in (m for m in models if m is not None):
        name = type(model).__name__
        if any(w is not None for w in LayerMasks.of(model).windows.values()):
            why = f"{name} has sliding-window layers"
        elif uses_alibi(model.config):
            why = f"{name} uses ALiBi"
    if why is None:
        return True
    log.warning("exspec: enable_prefix_caching is off: %s", why)
    return False


def _in_place(config, models) -> bool:
    """Whether compiled forwards read the block store in place (attention_backend
    FLEX_ATTENTION, kv/in_place.py): every model's attention switched to the read, or a
    ModelLoadError naming the model whose attention FlexAttention cannot compute as it does."""
    if config.attention_backend != FLEX_ATTENTION:
        return False
    for model in (m for m in models if m is not None):
        why = unsupported_in_place(model)
        if why:
            raise ModelLoadError(f"attention_backend {FLEX_ATTENTION}: {type(model).__name__} "
                                 f"cannot be read in place: {why}; unset attention_backend")
        use_in_place(model)
    return True


def _alibi_from_2d_mask(cfg) -> bool:
    return uses_alibi(cfg) and cfg.model_type in ALIBI_FROM_2D_MASK


def _has_cross_attention(model) -> bool:
    return any(name.endswith(("encoder_attn", "crossattention", "cross_attn"))
               for name, _ in model.named_modules())


@torch.inference_mode()
def _probe(model, takes_positions: bool) -> str | None:
    """One 4-token forward of two rows that differ only in their last token: every earlier
    logit must agree (causal attention), and passing positions 0, 1, 2, 3 explicitly (as the
    layouts do) must change nothing (the model's own positions are 0, 1, 2, ...)."""
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 5]], device=device)
    try:
        logits = model(input_ids=ids, use_cache=False).logits.float()
        if takes_positions:
            positions = torch.arange(4, device=device).expand(2, 4)
            placed = model(input_ids=ids, position_ids=positions, use_cache=False).logits.float()
    except Exception as exc:   # noqa: BLE001  (any failure here would fail every request)
        return f"a 4-token probe forward fails ({type(exc).__name__}: {exc})"
    if not torch.isfinite(logits).all():
        return "its logits are not finite (NaN or inf) on a 4-token probe"
    # a few ulps of the model's dtype at the logits' magnitude: rounding, not a difference
    tolerance = 4 * torch.finfo(model.dtype).eps * float(logits.abs().max())
    if float((logits[0, :3] - logits[1, :3]).abs().max()) > tolerance:
        return ("its attention is bidirectional: a later token changes earlier logits (a "
                "BERT-style model serves as a causal LM only with is_decoder=true)")
    if takes_positions and float((placed - logits).abs().max()) > tolerance:
        return ("its own positions are not 0, 1, 2, ... (RoBERTa-style models count from "
                "padding_idx + 1 and skip pad tokens), so the positions the layouts pass "
                "would change its output")
    return None


@torch.inference_mode()
def _probe_windows(model, masks: LayerMasks) -> str | None:
    """A forward longer than the widest window, once with the model's own masks and once with
    the per-layer-type masks the layouts build: the logits must agree. That proves the model
    takes those masks (a dict by layer type where its layers mix types) and windows by
    transformers' rule. A window the model's context never exceeds needs no probe."""
    windows = [w for w in masks.windows.values() if w is not None]
    length = max(windows, default=0) + 3
    if not windows or length > getattr(model.config.get_text_config(decoder=True),
                                       "max_position_embeddings", length):
        return None
    embeddings = model.get_input_embeddings()
    device = embeddings.weight.device
    positions = torch.arange(length, device=device)[None]
    ids = (positions * 7 + 1) % embeddings.num_embeddings
    try:
        own = model(input_ids=ids, use_cache=False).logits.float()
        given = masks.build(positions, None, positions)
        ours = model(input_ids=ids, attention_mask=given, position_ids=positions,
                     use_cache=False).logits.float()
    except Exception as exc:   # noqa: BLE001  (any failure here would fail every request)
        return f"a forward with per-layer-type masks fails ({type(exc).__name__}: {exc})"
    tolerance = 4 * torch.finfo(model.dtype).eps * float(own.abs().max())
    if float((own - ours).abs().max()) > tolerance:
        return ("its sliding-window layers do not take their window from the mask of their "
                "layer type (it ignores a mask per layer type, or windows by another rule)")
    return None
