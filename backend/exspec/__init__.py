"""exspec: output-equivalent batched speculative decoding (EQSPEC / EXSPEC) for Triton.

The engine is plain PyTorch + transformers and never imports Triton; backend/model.py adapts it.
"""
from .config import EngineConfig
from .engine.llm_engine import LLMEngine
from .errors import EngineBusyError, InvalidRequestError, ModelLoadError
from .outputs import CompletionOutput, RequestOutput, TokenLogprob
from .params import SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "TokenLogprob",
           "InvalidRequestError", "EngineBusyError", "ModelLoadError"]
