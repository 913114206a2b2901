"""SamplingParams: what one request asks for, validated with messages a person can act on."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import InvalidRequestError

MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 256, 64
MAX_LOGPROBS = 20   # vLLM's default max_logprobs


@dataclass
class SamplingParams:
    max_tokens: int | None = None       # None: the engine's default_max_tokens
    temperature: float = 0.0            # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                      # 0 (or -1) = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    num_speculative_tokens: int | None = None  # per-request cap on k; 0 = no speculation
    # vLLM's meaning: None = no logprobs; N >= 0 = each output token's logprob and rank under
    # the target (raw, before temperature / top-k / top-p), plus its N most likely tokens
    logprobs: int | None = None
    text_per_token: bool = False        # RequestOutput.token_texts: each new token's own text

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(msg):
            raise InvalidRequestError(msg)

        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad(f"top_k must be an integer >= 0 (or -1 for off), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed < 2**63)):
            bad(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            bad(f"stop allows at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                "characters each")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be a list of non-negative integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad(f"stop_token_ids allows at most {MAX_STOP_TOKEN_IDS} ids")
        if not isinstance(self.ignore_eos, bool):
            bad(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (how many of the most likely "
                f"tokens to return beside the chosen one), got {self.logprobs!r}")
        if self.num_speculative_tokens is not None and (
                not _is_int(self.num_speculative_tokens) or self.num_speculative_tokens < 0):
            bad(f"num_speculative_tokens must be an integer >= 0, got {self.num_speculative_tokens!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
