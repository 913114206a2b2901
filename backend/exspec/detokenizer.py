"""Incremental detokenisation with stop strings (I5) for streaming.

Streamed deltas must join to exactly the final text, so a delta never includes an incomplete
UTF-8 character (decoded as U+FFFD) or anything that could be the start of a stop string.
"""
from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.text = ""          # output text so far, cut before a matched stop string
        self.num_emitted = 0    # characters of self.text already handed out as deltas
        self.stopped = False

    def update(self, output_ids: list[int]) -> bool:
        """Decode the output so far; returns True when a stop string has just matched."""
        if self.stopped:
            return False
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return True
        self.text = text
        return False

    def take_delta(self, final: bool) -> str:
        """The text that is safe to stream now; at the end, everything left."""
        end = len(self.text) if final or self.stopped else self._safe_end()
        delta = self.text[self.num_emitted:end]
        self.num_emitted = max(self.num_emitted, end)
        return delta

    def _safe_end(self) -> int:
        end = len(self.text)
        while end > self.num_emitted and self.text[end - 1] == "\ufffd":
            end -= 1  # a multi-byte character still arriving
        held = 0
        for s in self.stop:  # the longest tail that a stop string could still start with
            for n in range(min(len(s) - 1, end), held, -1):
                if self.text[end - n:end] == s[:n]:
                    held = n
                    break
        return max(self.num_emitted, end - held)
