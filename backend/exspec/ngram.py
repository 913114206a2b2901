"""NgramProposer: speculation without a draft model (prompt lookup; vLLM's "ngram" method).

A row's proposal is what followed the most recent earlier occurrence of its last n tokens in
its own prompt + output, n from prompt_lookup_max down to prompt_lookup_min, up to k tokens.
No model, no KV cache, no forward: it pays where outputs repeat their input (edits, answers from
a passage) and proposes nothing elsewhere. A proposal is only a proposal: the target verifies
it as it verifies a draft model's (design: "Proposers").
"""
from __future__ import annotations


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the longest suffix of
        `tokens` (n from max_n down to min_n); [] when none matches or k is 0."""
        if k <= 0:
            return []
        last = len(tokens)
        for n in range(min(self.max_n, last - 1), self.min_n - 1, -1):
            suffix = tokens[last - n:]
            # a match must end before the suffix does, so that something follows it
            for start in range(last - n - 1, -1, -1):
                if tokens[start + n - 1] == suffix[-1] and tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + k]
        return []
