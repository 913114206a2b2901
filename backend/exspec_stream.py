"""One in-flight request as the adapter holds it: who to answer, what was asked, and the
totals and timings its responses and metrics need. Owned by the send thread once registered."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from exspec import RequestOutput
from exspec_request import ParsedRequest


@dataclass
class Stream:
    request_id: str
    sender: object
    req: ParsedRequest
    prompt_text: str | None              # for prepending when not streaming
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    texts: list = field(default_factory=list)       # totals, when not streaming
    ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    cumulative_logprob: float = 0.0
    cancelled: bool = False              # the client went away; we asked the engine to abort
    shutting_down: bool = False          # the drain deadline passed and the drain aborted it
    tag_error_codes: bool = False        # forwarded by the unary front model (see exspec_request)

    def collect(self, out: RequestOutput):
        """Not streaming: the totals the one response will carry."""
        self.texts.append(out.text_delta)
        self.ids += out.new_token_ids
        self.logprobs += out.new_logprobs or []
        self.cumulative_logprob += sum(lp.logprob for lp in out.new_logprobs or [])


def pieces(out: RequestOutput) -> list[RequestOutput]:
    """A streamed output as responses: one per token (stream_granularity "token", the
    engine gave each token's text) or the whole step; none when it committed nothing."""
    if not out.new_token_ids:
        return []
    if out.token_texts is None or len(out.new_token_ids) == 1:
        return [out]
    return [dataclasses.replace(out, new_token_ids=[token], text_delta=text, token_texts=[text],
                                new_logprobs=out.new_logprobs and [out.new_logprobs[i]])
            for i, (token, text) in enumerate(zip(out.new_token_ids, out.token_texts))]
