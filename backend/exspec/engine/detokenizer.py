"""Incremental detokenisation with stop strings (I5) for streaming.

Streamed deltas must join to exactly the final text, so a delta never includes an incomplete
UTF-8 character (decoded as U+FFFD) or anything that could be the start of a stop string.

Each update decodes only a short window, not the whole output (which made every step O(output
length) per row, and with stop strings every token): the tokens not yet settled plus the last
settled ones as context, so that tokenizers whose text depends on the neighbour (SentencePiece's
leading spaces, byte-level characters split across tokens) decode exactly as in a full decode.
Text is settled once it ends on a complete character. Stop strings are searched only where a
new match can be.
"""
from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str], start: int = 0):
        """`start`: where the output begins in the token lists passed to `update`."""
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.text = ""          # output text so far, cut before a matched stop string
        self.num_emitted = 0    # characters of self.text already handed out as deltas
        self.stopped = False
        self._start = start
        self._context = start   # first token of the decode window (settled, for context only)
        self._settled = start   # tokens whose text is final in self._settled_text
        self._settled_text = ""
        self._context_text = ""  # decode(tokens[_context:_settled])

    def update(self, tokens: list[int]) -> bool:
        """Decode the output so far (tokens[start:]); True when a stop string has just matched."""
        if self.stopped:
            return False
        window = self._decode(tokens[self._context:])
        search_from = max(0, len(self._settled_text) - max((len(s) for s in self.stop), default=1) + 1)
        if window.startswith(self._context_text):
            tail = window[len(self._context_text):]
            text = self._settled_text + tail
            if tail and not tail.endswith("\ufffd"):   # ends on a whole character: settle it
                self._context, self._settled = self._settled, len(tokens)
                self._context_text = self._decode(tokens[self._context:self._settled])
                self._settled_text = text
        else:   # the context decodes differently now (rare): decode all of it once
            text = self._decode(tokens[self._start:])
            self._context = self._settled = len(tokens)
            self._context_text, self._settled_text, search_from = "", text, 0
        cut = min((i for i in (text.find(s, search_from) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return True
        self.text = text
        return False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

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
