"""What the engine hands back: per-tick deltas (RequestOutput) and whole completions."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """One output token under the target's raw logits (vLLM's default logprobs mode): its
    logprob, its rank (1 = the most likely; ties count as vLLM counts them) and, when the request
    asked for N, the N most likely tokens as (token id, logprob), the most likely first."""
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]           # committed this tick, after stop truncation
    text_delta: str                    # held back while UTF-8 is partial or a stop string may start
    finished: bool
    finish_reason: str | None          # stop | length | abort | error (None while running)
    error: str | None
    num_prompt_tokens: int
    num_output_tokens: int             # cumulative
    num_draft_tokens: int              # cumulative, proposed for this request
    num_accepted_draft_tokens: int     # cumulative
    new_logprobs: list[TokenLogprob] | None = None  # one per new token, when params.logprobs is set
    token_texts: list[str] | None = None   # one per new token (joined: text_delta), when asked for
    # which of the request's n samples this is (0 when n = 1; parallel_sampling.py). With n > 1,
    # finish_reason is set on a sample's last output and `finished` only on the request's last
    index: int = 0
    # the prompt as the engine tokenized it (a chat after its template), on a sample's last output
    prompt_token_ids: list[int] | None = None


@dataclass
class CompletionOutput:
    request_id: str
    token_ids: list[int] = field(default_factory=list)  # ends with the EOS id when EOS stopped it
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    index: int = 0                     # the sample, for a request with n > 1
