"""One in-flight request as the adapter holds it: who to answer, what was asked, and the
totals and timings its responses and metrics need, per sample when it asked for n > 1. Owned by
the send thread once registered."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from exspec import RequestOutput
from exspec_request import ParsedRequest


@dataclass
class Sample:
    """One of the request's n samples (the only one when n = 1): its totals so far."""
    texts: list = field(default_factory=list)       # when not streaming
    ids: list = field(default_factory=list)         # when not streaming, or recording traffic
    logprobs: list = field(default_factory=list)    # when not streaming
    cumulative_logprob: float = 0.0                 # up to the last token sent or collected
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0


@dataclass
class Stream:
    request_id: str
    sender: object
    req: ParsedRequest
    prompt_text: str | None              # for prepending when not streaming
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    samples: list[Sample] = field(default_factory=list)   # by index, n of them
    cancelled: bool = False              # the client went away; we asked the engine to abort
    shutting_down: bool = False          # the drain deadline passed and the drain aborted it
    tag_error_codes: bool = False        # forwarded by the unary front model (see exspec_request)
    record: bool = False                 # model.json's record_traffic is on: keep the ids
    prompt_ids: list[int] | None = None  # the prompt as the engine tokenized it, once a sample ends

    def __post_init__(self):
        self.samples = self.samples or [Sample() for _ in range(self.req.params.n)]

    def observe(self, out: RequestOutput):
        """Every output: its sample's counters and finish reason."""
        sample = self.samples[out.index]
        sample.num_output_tokens = out.num_output_tokens
        sample.num_draft_tokens = out.num_draft_tokens
        sample.num_accepted_draft_tokens = out.num_accepted_draft_tokens
        sample.finish_reason = out.finish_reason or sample.finish_reason
        if self.record:
            self.prompt_ids = out.prompt_token_ids or self.prompt_ids
            if self.req.stream:   # not streaming, `collect` keeps them
                sample.ids += out.new_token_ids

    def collect(self, out: RequestOutput):
        """Not streaming: the totals the one response will carry."""
        sample = self.samples[out.index]
        sample.texts.append(out.text_delta)
        sample.ids += out.new_token_ids
        sample.logprobs += out.new_logprobs or []
        sample.cumulative_logprob += sum(lp.logprob for lp in out.new_logprobs or [])

    @property
    def num_output_tokens(self) -> int:
        return sum(s.num_output_tokens for s in self.samples)

    def totals(self, out: RequestOutput) -> RequestOutput:
        """`out` with the speculation counters of all samples (the whole request's)."""
        if len(self.samples) == 1:
            return out
        return dataclasses.replace(
            out, num_draft_tokens=sum(s.num_draft_tokens for s in self.samples),
            num_accepted_draft_tokens=sum(s.num_accepted_draft_tokens for s in self.samples))


def pieces(out: RequestOutput) -> list[RequestOutput]:
    """A streamed output as responses: one per token (stream_granularity "token", the
    engine gave each token's text) or the whole step; none when it committed nothing. Only the
    last piece keeps the sample's finish_reason."""
    if not out.new_token_ids:
        return []
    if out.token_texts is None or len(out.new_token_ids) == 1:
        return [out]
    last = len(out.new_token_ids) - 1
    return [dataclasses.replace(out, new_token_ids=[token], text_delta=text, token_texts=[text],
                                new_logprobs=out.new_logprobs and [out.new_logprobs[i]],
                                finish_reason=out.finish_reason if i == last else None)
            for i, (token, text) in enumerate(zip(out.new_token_ids, out.token_texts))]
