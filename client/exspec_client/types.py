"""What a generation yields (Delta), what it ends with (Result), and the errors it raises."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

# What `make serve` serves (SmolLM2-135M-Instruct); the tests' toy pair is model "exspec".
DEFAULT_MODEL = "smollm2"


class ExspecError(RuntimeError):
    """The server refused or failed a request; `message` is the server's own text and
    `status` its code where the protocol carries one (gRPC status name or HTTP status)."""

    def __init__(self, message: str, status: str | int | None = None):
        super().__init__(message if status is None else f"[{status}] {message}")
        self.message = message
        self.status = status


class ExspecTimeout(ExspecError, TimeoutError):
    """No final response within the caller's timeout; the request was cancelled."""


@dataclass
class Delta:
    """One streamed response: the text and tokens committed since the previous one."""
    text: str
    token_ids: list[int]
    time_s: float                          # since the request was sent
    finish_reason: str | None = None       # stop | length on the last delta, else None
    num_input_tokens: int | None = None
    draft_tokens: int | None = None        # cumulative for the request
    accepted_draft_tokens: int | None = None


@dataclass
class Result:
    """A finished generation with the numbers people read off a serving run."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    ttft_s: float | None = None            # send -> first response that carried tokens
    latency_s: float | None = None         # send -> final response
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    chunks: list[tuple[float, int]] = field(default_factory=list)   # (time_s, tokens) per delta

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted ÷ proposed draft tokens; None when nothing was drafted (k = 0)."""
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def tokens_per_s(self) -> float | None:
        """Output tokens ÷ end-to-end latency."""
        return self.num_output_tokens / self.latency_s if self.latency_s else None

    def inter_token_latencies(self) -> list[float]:
        """Per token after the first response: the gap to the previous response ÷ the tokens the
        later response carried (speculation delivers several tokens at once)."""
        out, previous = [], None
        for t, n in self.chunks:
            if previous is not None and n > 0:
                out += [(t - previous) / n] * n
            if n > 0:
                previous = t
        return out

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.chunks.append((delta.time_s, len(delta.token_ids)))
        if delta.token_ids and self.ttft_s is None:
            self.ttft_s = delta.time_s
        if delta.finish_reason:
            self.finish_reason = delta.finish_reason
        if delta.num_input_tokens is not None:
            self.num_input_tokens = delta.num_input_tokens
        if delta.draft_tokens is not None:
            self.draft_tokens = delta.draft_tokens
        if delta.accepted_draft_tokens is not None:
            self.accepted_draft_tokens = delta.accepted_draft_tokens

    def summary(self) -> str:
        ttft = "-" if self.ttft_s is None else f"{self.ttft_s * 1000:.0f} ms"
        rate = "-" if self.tokens_per_s is None else f"{self.tokens_per_s:.1f}"
        acc = "-" if self.acceptance_rate is None else f"{self.acceptance_rate:.2f}"
        return (f"{self.num_output_tokens} tokens, finish {self.finish_reason}, TTFT {ttft}, "
                f"{rate} tokens/s, acceptance {acc} "
                f"({self.accepted_draft_tokens}/{self.draft_tokens} drafts)")

    def as_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "num_input_tokens": self.num_input_tokens,
                "num_output_tokens": self.num_output_tokens, "ttft_s": self.ttft_s,
                "latency_s": self.latency_s, "tokens_per_s": self.tokens_per_s,
                "draft_tokens": self.draft_tokens,
                "accepted_draft_tokens": self.accepted_draft_tokens,
                "acceptance_rate": self.acceptance_rate}


def sampling_json(max_tokens: int | None = None, temperature: float | None = None,
                  **more) -> str:
    """The sampling_parameters JSON string (design: "The Triton adapter"): only the keys that were given.
    One generation is one sample: n > 1 is refused here (the server would return n texts that a
    Result cannot hold); send n requests with seeds seed, seed + 1, ... for the same samples."""
    if more.get("n") not in (None, 1) or more.get("best_of") not in (None, 1):
        raise ValueError(f"exspec-client returns one sample per generation; got n={more.get('n')!r}"
                         f" best_of={more.get('best_of')!r}. Send n generations instead (with "
                         "seeds seed + i they are the server's n samples), or call tritonclient "
                         "directly: text_output then holds one element per sample")
    values = {"max_tokens": max_tokens, "temperature": temperature, **more}
    return json.dumps({k: v for k, v in values.items() if v is not None})


class Clock:
    """Seconds since the request was sent, and the caller's deadline."""

    def __init__(self, timeout_s: float | None):
        self.start = time.perf_counter()
        self.deadline = None if timeout_s is None else self.start + timeout_s

    def now(self) -> float:
        return time.perf_counter() - self.start

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.perf_counter()
