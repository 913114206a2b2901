"""Loading the target / draft pair and the tokenizer (design: "Models")."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..config import EngineConfig
from ..errors import ModelLoadError
from ..speculative import METHODS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelPair:
    tokenizer: object
    target: torch.nn.Module
    draft: torch.nn.Module | None
    eos_ids: set[int]
    max_model_len: int
    # (model, CUDA graphs or not) -> its compiled decode forward (compiled.py), made once and
    # shared by every engine on this pair (the benchmark builds several)
    decode_forwards: dict = field(default_factory=dict)
    head: torch.nn.Module | None = None   # a model on the target's hidden states (an EAGLE-3
                                          # head, eagle3.py)


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).expanduser().exists()


def check_source(name: str, what: str) -> str:
    """`name` as the loaders take it: a local path (that must be there) or a Hub id."""
    path = Path(name).expanduser()
    if _looks_local(name) and not path.exists():
        raise ModelLoadError(f"{what} path does not exist: {name}")
    return str(path) if path.exists() else name


def load_model(name: str, config: EngineConfig, what: str, device_map=None):
    """On config.device, or spread over GPUs by `device_map` (then left where it is put)."""
    source = check_source(name, what)
    placement = {} if device_map is None else {"device_map": device_map}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=DTYPES[config.dtype], trust_remote_code=config.trust_remote_code,
            **placement)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load {what} model from {name!r}: {exc}") from exc
    except ImportError as exc:   # device_map needs accelerate
        raise ModelLoadError(f"cannot load {what} model with device_map: {exc}") from exc
    if device_map is None:
        model = model.to(config.device)
    return model.eval().requires_grad_(False)


def check_spread(target, device: str) -> None:
    """A target spread by device_map must keep every weight on a GPU (offloaded layers make
    each step wait on host memory or disk) and start on the engine's device (inputs, the
    draft and sampling live there)."""
    offloaded = sorted(str(d) for d in model_devices(target) if d.type != "cuda")
    if offloaded:
        raise ModelLoadError(f"the target does not fit on the GPUs: device_map left weights on "
                             f"{', '.join(offloaded)} (meta: disk); use more GPUs, a smaller "
                             "dtype or a smaller target")
    home = target.get_input_embeddings().weight.device
    if not same_device(home, torch.device(device)):
        raise ModelLoadError(f"device_map put the target's input embeddings on {home}, but the "
                             f"engine's device is {device}: map them (and the first layers) to "
                             f"{device}, or set device to {home}")


def same_device(a: torch.device, b: torch.device) -> bool:
    """cuda and cuda:0 are the same GPU when 0 is the current one."""
    index = lambda d: d.index if d.index is not None else (   # noqa: E731
        torch.cuda.current_device() if d.type == "cuda" else None)
    return a.type == b.type and index(a) == index(b)


def model_devices(*models) -> set[torch.device]:
    """Every device holding a parameter of these models."""
    return {p.device for m in models if m is not None for p in m.parameters()}


def load_tokenizer(name: str, config: EngineConfig):
    source = check_source(name, "tokenizer")
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


def load_pair(config: EngineConfig) -> ModelPair:
    """The target, its tokenizer and what the speculative method loads of its own (its proposer
    class's `load_draft` and `load_head`, through speculative.METHODS): nothing for
    autoregressive."""
    method = METHODS.get(config.proposer) if config.method != "autoregressive" else None
    # first, so that a device_map policy sees the memory the draft takes
    draft = method.load_draft(config) if method is not None else None
    target = load_model(config.target_model, config, "target", config.device_map)
    if config.device_map is not None:
        check_spread(target, config.device)
    tokenizer = load_tokenizer(config.tokenizer or config.target_model, config)
    limits = [m for m in (_max_positions(target), draft and _max_positions(draft)) if m]
    max_len = min(limits) if limits else 4096
    if config.max_model_len is not None:
        if config.max_model_len > max_len:
            raise ModelLoadError(f"max_model_len {config.max_model_len} exceeds the models' "
                                 f"limit of {max_len} positions")
        max_len = config.max_model_len
    pair = ModelPair(tokenizer, target, draft, _eos_ids(tokenizer, target), max_len)
    if method is not None:
        pair.head = method.load_head(config, target)
    return pair
