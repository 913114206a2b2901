"""Sequence: one request's whole state, as explicit counters (design: "State").

Padding is never inferred from token values and EOS is never searched for in the prompt: each
sequence knows how many of its tokens each model has cached, and stops by the rules of I5.
"""
from __future__ import annotations

import torch

from ..outputs import TokenLogprob
from ..params import SamplingParams
from ..sampling.structured_output import RowGrammar
from .detokenizer import Detokenizer


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 max_tokens: int, max_model_len: int, eos_ids: set[int], detokenizer: Detokenizer,
                 seed: int, coupling: str = "gumbel", bad_words_ids: list[list[int]] = (),
                 grammar: RowGrammar | None = None):
        self.request_id = request_id
        self.params = params
        self.tokens: list[int] = list(prompt_ids)   # prompt + committed output
        self.num_prompt_tokens = len(prompt_ids)
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
        self.bad_words_ids = list(bad_words_ids)   # params.bad_words as token sequences
        self.detokenizer = detokenizer
        self.grammar = grammar   # params.structured_outputs compiled: advanced by every commit
        # Entries the target's KV cache holds for this sequence (I3: all but the pending token).
        # A proposer's cache keeps its own count (proposer.KVState).
        self.num_cached_target = 0
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.skipped_ticks = 0
        # re-admitted after a prefill or step it shared with other rows raised: prefilled and
        # stepped in a group of its own until a step succeeds (pool.py, "Failure isolation")
        self.isolated = False
        # Per-draft-token acceptance, estimated from decayed counts of accepted drafts and of
        # rejections (a step with a < k drafts accepted ends in exactly one rejection).
        self.recent_accepted = 0.0
        self.recent_rejections = 0.0
        self.logprobs: list[TokenLogprob] = []
        self.token_texts: list[str] = []     # per-token text deltas not yet emitted (text_per_token)
        # The request's seed (the engine draws one when it gave none): the key of its Gumbel
        # noise, or the seed of its own generator under rejection sampling.
        self.seed = seed
        self.generator = (torch.Generator().manual_seed(seed)
                          if coupling == "rejection" and not params.greedy else None)

    # -- derived quantities -------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]

    @property
    def num_to_prefill(self) -> int:
        """Tokens the target caches before the row can step: its prompt (whose last token's
        logits give the first output token), or, re-admitted with output already (isolated),
        every token but the pending one."""
        return self.num_tokens - 1 if self.output_ids else self.num_prompt_tokens

    @property
    def pending_token(self) -> int:
        return self.tokens[-1]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    # -- the one method that changes the token list ---------------------------------------
    def append(self, new_tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> list[int]:
        """Commit tokens in order, stopping at the first stop condition (I5).

        Returns the tokens actually committed; anything after the stop point is dropped.
        With params.text_per_token, each committed token's text delta goes to token_texts.
        """
        committed = []
        per_token = self.params.text_per_token
        decode_each = per_token or bool(self.detokenizer.stop)
        for i, token in enumerate(new_tokens):
            self.tokens.append(token)
            committed.append(token)
            if logprobs is not None:
                self.logprobs.append(logprobs[i])
            if token in self.stop_ids:
                self.finish_reason = "stop"
            elif decode_each and self.detokenizer.update(self.tokens):
                self.finish_reason = "stop"   # a stop string matched; later tokens are dropped
            elif self.num_output_tokens >= self.max_tokens or self.num_tokens >= self.max_model_len:
                self.finish_reason = "length"
            if per_token:
                self.token_texts.append(self.detokenizer.take_delta(final=self.finished))
            if self.finished:
                break
        if self.grammar is not None:
            self.grammar.consume(committed)
        if not decode_each or self.finished:
            self.detokenizer.update(self.tokens)
        return committed

    def take_token_texts(self) -> list[str]:
        texts, self.token_texts = self.token_texts, []
        return texts

    @property
    def tokens_left(self) -> int:
        """Tokens the row may still commit before max_tokens or max_model_len ends it."""
        return min(self.max_tokens - self.num_output_tokens, self.max_model_len - self.num_tokens)

    def drafts_at(self, k: int) -> int:
        """Drafts this row may have verified in a step at k: its own num_speculative_tokens caps
        it, and so do the tokens it has left (a draft past them could never be committed)."""
        cap = self.params.num_speculative_tokens
        return max(0, min(k, self.tokens_left) if cap is None else min(k, cap, self.tokens_left))

    def count_drafts(self, proposed: int, accepted: int) -> None:
        """A step's drafts as the output shows them: of those verified, the ones at positions the
        output reached, and of those accepted, the ones committed (a stop or the length inside
        an accepted run truncates both with the output). The request's counters, and the
        engine's draft_tokens / accepted_tokens, count these."""
        self.num_draft_tokens += proposed
        self.num_accepted_draft_tokens += accepted

    def observe_acceptance(self, accepted: int, proposed: int, decay: float = 0.8) -> None:
        """A step's verification (before any stop truncation): the acceptance estimate's input."""
        self.recent_accepted = decay * self.recent_accepted + accepted
        self.recent_rejections = decay * self.recent_rejections + (accepted < proposed)

    @property
    def acceptance_estimate(self) -> float | None:
        seen = self.recent_accepted + self.recent_rejections
        return self.recent_accepted / seen if seen else None

    def finish(self, reason: str, error: str | None = None) -> None:
        if not self.finished:
            self.finish_reason = reason
            self.error = error
