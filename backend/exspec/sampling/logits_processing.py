"""vLLM's per-request logits processing, exact under speculation (design: "Logits processing").

In vLLM's order: allowed_token_ids, bad_words, min_tokens and logit_bias on the raw logits, then
repetition_penalty (prompt + output tokens: positive logits divided, negative multiplied),
frequency_penalty (minus the count of each output token) and presence_penalty (minus once per
output token seen), then min_p on the temperature-scaled distribution. Temperature, top-k and
top-p stay in sampler.py, which takes these logits as its input.

Every position is processed with its own history: at verification position j that is the
prompt, the committed tokens and the drafts before j, exactly what a target-only run has there,
so the speculative output stays the target-only output; the draft proposes under the same rule.
The state lives on the device ([B, V] output token counts, the last tokens a bad word may start
with), is built from the host's token lists when a group changes and is advanced after each step
by the tokens the device itself committed: no host round trip per step.
"""
from __future__ import annotations

import math

import torch

from ..utils.transfer import Upload, float_bits, floats_from_bits

NEG_INF = float("-inf")
NO_TOKEN = -2   # a tail slot before the row's first token: matches no bad word's prefix
ANY_TOKEN = -1  # a bad word prefix slot left of a shorter word's prefix: matches anything


def processes_logits(params) -> bool:
    """Does a request ask for any processing here (vLLM's non-neutral values)?"""
    return bool(params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty
                or params.min_p or params.min_tokens or params.logit_bias
                or params.allowed_token_ids or params.bad_words)


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokenisation of bad_words: each word as written (left-stripped) and, where that
    differs, as it reads after a space ("Paris" and " Paris" are different tokens)."""
    sequences = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if plain:
            sequences.append(plain)
        if spaced and len(spaced) == len(plain) and spaced[0] != plain[0]:
            sequences.append(spaced)
    return sequences


class RowProcessing:
    """A group's processing settings and history state, on the device (one row per sequence).
    Built from sections of the step's (or prefill's) one upload: `stage` adds the rows' settings
    and their histories as sparse (row, token) entries, the constructor scatters them into the
    dense [B, V] state on the device."""

    SETTINGS = 8   # per row: 5 floats (as bits), min_tokens, output length, restricted to a list

    @staticmethod
    def stage(upload: Upload, seqs, width: int) -> dict:
        """Stage the rows' processing in `upload`; returns the sections' indices by name."""
        params = [s.params for s in seqs]
        staged = {"settings": upload.add(
            float_bits([p.repetition_penalty for p in params] + [p.frequency_penalty for p in params]
                       + [p.presence_penalty for p in params]
                       + [1.0 if p.greedy else p.temperature for p in params]
                       + [_log_min_p(p) for p in params])
            + [p.min_tokens for p in params] + [s.num_output_tokens for s in seqs]
            + [int(bool(p.allowed_token_ids)) for p in params], RowProcessing.SETTINGS, len(seqs))}

        def entries(name: str, pairs: list[tuple]) -> None:
            """(row, token[, value bits]) entries as one section of columns, if any."""
            if pairs:
                staged[name] = upload.add([v for column in zip(*pairs) for v in column],
                                          len(pairs[0]), len(pairs))
        entries("allowed", [(r, t) for r, p in enumerate(params) for t in p.allowed_token_ids or ()])
        entries("bias", [(r, t, bits) for r, p in enumerate(params) if p.logit_bias
                         for t, bits in zip(p.logit_bias, float_bits(list(p.logit_bias.values())))])
        entries("stop", [(r, t) for r, s in enumerate(seqs) for t in sorted(s.stop_ids) if t < width])
        entries("prompt", [(r, t) for r, s in enumerate(seqs)
                           for t in sorted(set(s.tokens[:s.num_prompt_tokens]))])
        entries("output", [(r, t) for r, s in enumerate(seqs) for t in s.output_ids])
        words = [(row, ids) for row, s in enumerate(seqs) for ids in s.bad_words_ids]
        if words:
            span = max(len(ids) for _, ids in words) - 1
            # a word's prefix is matched on generated tokens only, as vLLM matches it: a prompt
            # that ends with "New" does not ban " York" as the first output token
            tails = [([NO_TOKEN] * span + s.output_ids)[len(s.output_ids):] if span else [] for s in seqs]
            prefixes = [[ANY_TOKEN] * (span - len(ids) + 1) + ids[:-1] for _, ids in words]
            staged["bad_words"] = (upload.add([t for tail in tails for t in tail], len(seqs), span),
                                   upload.add([row for row, _ in words] + [ids[-1] for _, ids in words],
                                              2, len(words)),
                                   upload.add([t for prefix in prefixes for t in prefix], len(words), span))
        return staged

    def __init__(self, sent: list[torch.Tensor], staged: dict, seqs, width: int):
        rows = len(seqs)
        params = [s.params for s in seqs]
        self.lengths = [s.num_tokens for s in seqs]   # what the device state has seen, per row
        self.width = width
        settings = sent[staged["settings"]]
        device = settings.device
        (self.repetition, self.frequency, self.presence, self.temperature,
         self.log_min_p) = floats_from_bits(settings[:5])
        self.min_tokens, self.output_len, restricted = settings[5], settings[6], settings[7].bool()
        self.bias = torch.zeros(rows, width, device=device)
        if "allowed" in staged:   # only the listed tokens: every other one -inf
            row, token = sent[staged["allowed"]]
            self.bias.masked_fill_(restricted[:, None], NEG_INF)
            self.bias[row, token] = torch.zeros_like(row, dtype=self.bias.dtype)
        if "bias" in staged:
            row, token, bits = sent[staged["bias"]]
            self.bias.index_put_((row, token), floats_from_bits(bits), accumulate=True)
        self.stop_mask = self._marks(sent, staged, "stop", rows, width)
        self.prompt_seen = self._marks(sent, staged, "prompt", rows, width)
        self.counts = torch.zeros(rows, width, device=device)
        if "output" in staged:
            row, token = sent[staged["output"]]
            self.counts.index_put_((row, token), torch.ones_like(row, dtype=self.counts.dtype), accumulate=True)
        self.uses_bias = any(p.logit_bias or p.allowed_token_ids for p in params)
        self.uses_min_tokens = any(p.min_tokens for p in params)
        self.uses_repetition = any(p.repetition_penalty != 1.0 for p in params)
        self.uses_counts = any(p.frequency_penalty or p.presence_penalty for p in params)
        self.uses_min_p = any(p.min_p for p in params)
        self.bad_rows = None
        if "bad_words" in staged:
            tail, words, prefix = (sent[at] for at in staged["bad_words"])
            self.span, self.tail, self.bad_prefix = tail.shape[1], tail, prefix
            self.bad_rows, self.bad_last = words

    @staticmethod
    def _marks(sent, staged, name: str, rows: int, width: int) -> torch.Tensor:
        """[B, V] bool, True at the section's (row, token) entries."""
        marks = torch.zeros(rows, width, dtype=torch.bool, device=sent[staged["settings"]].device)
        if name in staged:
            row, token = sent[staged[name]]
            marks[row, token] = torch.ones_like(row, dtype=torch.bool)   # a device fill, no scalar copied up
        return marks

    def apply(self, logits: torch.Tensor, drafts: torch.Tensor | None = None, first: int = 0) -> torch.Tensor:
        """[B, T, V] logits -> processed float32 logits. Position t's history is the row's
        tokens followed by drafts[:, :first + t] (drafts [B, D], first + T - 1 <= D)."""
        positions, vocab = logits.shape[1:]
        x = logits.float()
        if self.uses_bias:
            x = x + self.bias[:, None, :vocab]
        if self.bad_rows is not None:
            x = self._ban_bad_words(x, drafts, first)
        if self.uses_min_tokens:   # stop tokens held back while fewer than min_tokens are out
            emitted = self.output_len[:, None] + first + torch.arange(positions, device=x.device)
            held = (emitted < self.min_tokens[:, None])[..., None] & self.stop_mask[:, None, :vocab]
            x = x.masked_fill(held, NEG_INF)
        if self.uses_repetition or self.uses_counts:
            counts = self._counts(drafts, first, positions, vocab)
            used = counts > 0
        if self.uses_repetition:
            rep = self.repetition[:, None, None]
            x = torch.where(self.prompt_seen[:, None, :vocab] | used, torch.where(x > 0, x / rep, x * rep), x)
        if self.uses_counts:
            x = x - self.frequency[:, None, None] * counts - self.presence[:, None, None] * used
        if self.uses_min_p:   # p / p_max < min_p after temperature: the gap in scaled logits
            gap = (x - x.amax(-1, keepdim=True)) / self.temperature[:, None, None]
            x = x.masked_fill(gap < self.log_min_p[:, None, None], NEG_INF)
        return x

    def _counts(self, drafts, first: int, positions: int, vocab: int) -> torch.Tensor:
        """[B, T, V] output token counts at each position: the committed ones plus the drafts
        before it (one scatter up to the first position, a cumulative sum after it)."""
        counts = self.counts
        if first:
            counts = counts.scatter_add(1, drafts[:, :first], torch.ones_like(drafts[:, :first], dtype=counts.dtype))
        if positions == 1:
            return counts[:, None, :vocab]
        later = torch.zeros(counts.shape[0], positions, self.width, device=counts.device)
        later[:, 1:].scatter_(2, drafts[:, first:first + positions - 1, None], 1.0)
        return (counts[:, None] + later.cumsum(1))[..., :vocab]

    def _ban_bad_words(self, x: torch.Tensor, drafts, first: int) -> torch.Tensor:
        """-inf at the last token of every bad word whose prefix ends the history (added, so a
        token two words ban is simply banned twice)."""
        count, positions = self.bad_rows.shape[0], x.shape[1]
        at = torch.arange(positions, device=x.device)
        if self.span:
            history = self.tail if drafts is None else torch.cat([self.tail, drafts], dim=1)
            windows = history.unfold(1, self.span, 1)[self.bad_rows, first:first + positions]
            prefix = self.bad_prefix[:, None, :]
            match = ((windows == prefix) | (prefix == ANY_TOKEN)).all(-1)     # [N, T]
        else:
            match = torch.ones(count, positions, dtype=torch.bool, device=x.device)
        index = (self.bad_rows[:, None].expand(count, positions), at.expand(count, positions),
                 self.bad_last[:, None].expand(count, positions))
        return x.index_put(index, torch.where(match, NEG_INF, 0.0), accumulate=True)

    def advance(self, tokens: torch.Tensor, kept: torch.Tensor, lengths: list[int]) -> None:
        """After a step: row b committed tokens[b, :kept[b] + 1] (on the device); `lengths`
        are the host's row lengths that this state now matches."""
        committed = torch.arange(tokens.shape[1], device=tokens.device) <= kept[:, None]
        self.counts.scatter_add_(1, tokens, committed.float())
        self.output_len = self.output_len + kept + 1
        if self.bad_rows is not None and self.span:
            history = torch.cat([self.tail, tokens], dim=1)
            self.tail = history.gather(1, (kept + 1)[:, None] + torch.arange(self.span, device=tokens.device))
        self.lengths = lengths


def _log_min_p(params) -> float:
    """min_p as a bound on log(p / p_max); -inf (nothing dropped) when off or greedy."""
    if params.greedy or not params.min_p:
        return NEG_INF
    return math.log(params.min_p)
