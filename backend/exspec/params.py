"""SamplingParams: what one request asks for, validated with messages a person can act on."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .errors import InvalidRequestError
from .sampling.structured_output import StructuredOutput

MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 256, 64
MAX_LOGPROBS = 20   # vLLM's default max_logprobs
MAX_LOGIT_BIAS, MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 1024, 64, 256
# samples per request (n): each is its own sequence in the pool, with its own KV reservation
MAX_N = 16
FLOAT32_MAX = 3.4028234663852886e38   # what a float field must fit: rows' settings go up as float32
MIN_TEMPERATURE = 1e-2   # vLLM's _MAX_TEMP: a lower temperature > 0 is raised to it (NaN-free)


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
    # vLLM's logits processing (logits_processing.py), with vLLM's names, defaults and meanings
    repetition_penalty: float = 1.0     # prompt + output tokens: logit / p if > 0, else logit * p
    frequency_penalty: float = 0.0      # output tokens: minus this times the token's count
    presence_penalty: float = 0.0       # output tokens: minus this once the token has appeared
    min_p: float = 0.0                  # drop tokens below min_p times the top probability
    min_tokens: int = 0                 # EOS and stop_token_ids held back until this many are out
    logit_bias: dict[int, float] | None = None   # token id -> added to its raw logit
    allowed_token_ids: list[int] | None = None   # only these tokens may be chosen
    bad_words: list[str] | None = None  # words never generated (vLLM's tokenisation)
    # vLLM's structured outputs: {json | regex | choice | grammar | json_object} (a dict, its
    # JSON text, or a StructuredOutput); structured_output.py
    structured_outputs: StructuredOutput | dict | str | None = None
    # parallel sampling (parallel_sampling.py): n samples of one prompt, sample i seeded
    # seed + i (vLLM's derivation); best_of only as n (every sample is returned, none ranked)
    n: int = 1
    best_of: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.logit_bias, dict):   # JSON (OpenAI) spells the token ids as strings
            self.logit_bias = {_token_id(k): v for k, v in self.logit_bias.items()} or None
        if self.bad_words == []:   # vLLM's neutral spellings: empty is absent
            self.bad_words = None
        self.structured_outputs = StructuredOutput.parse(self.structured_outputs)
        self.validate()
        if 0 < self.temperature < MIN_TEMPERATURE:   # as vLLM: 1e-40 would overflow the logits
            self.temperature = MIN_TEMPERATURE
        if self.best_of == self.n:   # the only value served, and what absent means
            self.best_of = None

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
        if self.temperature > FLOAT32_MAX:
            bad(f"temperature must fit float32 (<= {FLOAT32_MAX:.4g}), got {self.temperature!r}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0) or _float32(self.top_p) == 0:
            bad(f"top_p must be in (0, 1] and nonzero in float32, got {self.top_p!r}")
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
        self._validate_processing(bad)
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad(f"n must be an integer in [1, {MAX_N}] (samples of the prompt), got {self.n!r}")
        if self.best_of is not None and self.best_of != self.n:
            bad(f"best_of={self.best_of!r} is not supported with n={self.n}: exspec returns every "
                f"sample and ranks none, so best_of may only be absent or equal to n")
        if self.n > 1 and self.seed is not None and self.seed + self.n - 1 >= 2**63:
            bad(f"seed must leave room for the n samples' seeds (seed + i < 2^63), got {self.seed}")
        if self.num_speculative_tokens is not None and (
                not _is_int(self.num_speculative_tokens) or self.num_speculative_tokens < 0):
            bad(f"num_speculative_tokens must be an integer >= 0, got {self.num_speculative_tokens!r}")

    def _validate_processing(self, bad) -> None:
        """vLLM's ranges and, where vLLM has one, its message; token ids against the vocabulary
        are checked by the engine, which knows it."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                bad(f"{name} must be in [-2, 2], got {value!r}.")
        if not _is_real(self.repetition_penalty) or not (
                math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            bad(f"repetition_penalty must be greater than zero, got {self.repetition_penalty!r}.")
        if not 0 < _float32(min(self.repetition_penalty, FLOAT32_MAX)) or self.repetition_penalty > FLOAT32_MAX:
            bad(f"repetition_penalty must fit float32 ({_float32_tiny():.4g} to {FLOAT32_MAX:.4g}), "
                f"got {self.repetition_penalty!r}.")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}.")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            bad(f"min_tokens must be greater than or equal to 0, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}.")
        if self.min_tokens and self.stop:   # refused rather than served unlike vLLM
            bad("min_tokens with stop strings is not supported: vLLM ignores stop strings until "
                "min_tokens tokens are out, exspec would stop at them; send one or the other")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_int(t) and t >= 0 and _is_real(v) and abs(v) <= FLOAT32_MAX
                    for t, v in self.logit_bias.items()):
                bad(f"logit_bias must map token ids (integers >= 0) to finite numbers within "
                    f"float32's range (|bias| <= {FLOAT32_MAX:.4g})")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad(f"logit_bias allows at most {MAX_LOGIT_BIAS} token ids")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not all(
                    _is_int(t) and t >= 0 for t in self.allowed_token_ids):
                bad("allowed_token_ids must be a list of non-negative integers")
            if not self.allowed_token_ids:
                bad("allowed_token_ids is not None and empty!")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                bad("bad_words must be a list of non-empty strings")
            if len(self.bad_words) > MAX_BAD_WORDS or any(len(w) > MAX_BAD_WORD_CHARS for w in self.bad_words):
                bad(f"bad_words allows at most {MAX_BAD_WORDS} words of at most "
                    f"{MAX_BAD_WORD_CHARS} characters each")

    def check_token_ids(self, vocab: int) -> None:
        """Token ids the request names must exist in the model's vocabulary of `vocab` ids."""
        outside = sorted(t for t in (self.logit_bias or {}) if t >= vocab)
        if outside:
            raise InvalidRequestError(f"token_id(s) {outside} in logit_bias contain out-of-vocab "
                                      f"token ids. Vocabulary size: {vocab}")
        if any(t >= vocab for t in self.allowed_token_ids or ()):
            raise InvalidRequestError("allowed_token_ids contains out-of-vocab token id!")


def _token_id(key):
    """A logit_bias key: an int, or its decimal spelling; anything else stays for validate()."""
    if isinstance(key, str) and key.strip().lstrip("+").isdigit():
        return int(key)
    return key


def _float32(value: float) -> float:
    """`value` as it reaches the device (float32)."""
    return float(np.float32(value))


def _float32_tiny() -> float:
    return float(np.finfo(np.float32).smallest_subnormal)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
