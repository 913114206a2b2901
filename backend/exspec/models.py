"""Loading the target / draft pair and the tokenizer (DESIGN §3.6)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .config import EngineConfig
from .errors import ModelLoadError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelPair:
    tokenizer: object
    target: torch.nn.Module
    draft: torch.nn.Module | None
    eos_ids: set[int]
    max_model_len: int


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).expanduser().exists()


def _check_source(name: str, what: str) -> str:
    path = Path(name).expanduser()
    if _looks_local(name) and not path.exists():
        raise ModelLoadError(f"{what} path does not exist: {name}")
    return str(path) if path.exists() else name


def load_model(name: str, config: EngineConfig, what: str):
    source = _check_source(name, what)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=DTYPES[config.dtype], trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load {what} model from {name!r}: {exc}") from exc
    return model.to(config.device).eval().requires_grad_(False)


def load_tokenizer(name: str, config: EngineConfig):
    source = _check_source(name, "tokenizer")
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load tokenizer from {name!r}: {exc}") from exc


def _max_positions(model) -> int | None:
    cfg = model.config.get_text_config(decoder=True)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _eos_ids(tokenizer, model) -> set[int]:
    """The model's EOS set (generation config, then model config); the tokenizer's EOS only
    when the model names none, as Hugging Face generate does."""
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            return {value}
        if isinstance(value, (list, tuple)) and value:
            return {int(v) for v in value}
    return set()


def check_vocabularies(target, draft) -> None:
    """Draft and target may differ in every shape but the vocabulary (the logit rows)."""
    vt = target.get_output_embeddings().weight.shape[0]
    vd = draft.get_output_embeddings().weight.shape[0]
    if vt != vd:
        raise ModelLoadError(f"draft and target vocabularies differ: target has {vt} logits, "
                             f"draft has {vd}; speculative decoding needs one shared tokenizer")


def load_pair(config: EngineConfig) -> ModelPair:
    target = load_model(config.target_model, config, "target")
    draft = None
    if config.method != "autoregressive" and config.draft_model:
        draft = load_model(config.draft_model, config, "draft")
        check_vocabularies(target, draft)
    tokenizer = load_tokenizer(config.tokenizer or config.target_model, config)
    limits = [m for m in (_max_positions(target), draft and _max_positions(draft)) if m]
    max_len = min(limits) if limits else 4096
    if config.max_model_len is not None:
        if config.max_model_len > max_len:
            raise ModelLoadError(f"max_model_len {config.max_model_len} exceeds the models' "
                                 f"limit of {max_len} positions")
        max_len = config.max_model_len
    return ModelPair(tokenizer, target, draft, _eos_ids(tokenizer, target), max_len)
