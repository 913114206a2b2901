"""Structured outputs (vLLM's `structured_outputs`): JSON schema, regex, choice, Lark/EBNF
grammar or any JSON object, exact under speculation (design: "Structured outputs").

A request's constraint compiles once, at admission, into an llguidance matcher that the
sequence owns (`RowGrammar`) and advances by every committed token. A step needs the grammar's
token mask at every position it chooses a token: at verification position j that is the mask of
the state after the drafts before j, exactly what a target-only run has there, so the
speculative output stays the target-only output; the draft proposes under the same masks.
Masks travel as llguidance's bitmasks (one bit per token, int32 words) in the step's upload and
are unpacked on the device (`allowed`). JSON allows free whitespace between tokens, as vLLM's
default; `disable_any_whitespace: true` (vLLM's field) makes it compact.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch

from .errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's StructuredOutputsParams / GuidedDecodingParams fields besides KINDS: the backend is
# ignored (the engine's is llguidance), disable_any_whitespace is served, the others are
# accepted only at their neutral value
IGNORED = {"backend": None, "whitespace_pattern": None, "structural_tag": None,
           "disable_fallback": False, "disable_any_whitespace": False,
           "disable_additional_properties": False, "backend_was_auto": False}


@dataclass(frozen=True)
class StructuredOutput:
    """One request's constraint: its kind and its text (a schema as the client wrote it, key
    order kept: JSON schema property order decides the output's key order)."""
    kind: str
    text: str
    compact: bool = False   # vLLM's disable_any_whitespace: JSON without free whitespace

    @staticmethod
    def parse(value, where: str = "structured_outputs") -> "StructuredOutput | None":
        """vLLM's `structured_outputs` (or `guided_decoding`): a dict or its JSON text with
        exactly one of KINDS set; None when every field is null or absent."""
        if isinstance(value, StructuredOutput) or value is None:
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"{where} is not valid JSON ({exc.msg} at position {exc.pos})") from None
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{where} must be a JSON object with one of {', '.join(KINDS)}")
        unknown = sorted(set(value) - set(KINDS) - set(IGNORED))
        if unknown:
            raise InvalidRequestError(f"{where} has unknown field(s) {unknown}; known: "
                                      f"{', '.join(KINDS)} (and {', '.join(IGNORED)})")
        for key, neutral in IGNORED.items():
            if key not in ("backend", "disable_any_whitespace") and value.get(key) not in (None, neutral):
                raise InvalidRequestError(f"{where}.{key} is not supported (only {json.dumps(neutral)})")
        given = {k: v for k, v in value.items() if k in KINDS and v not in (None, False)}
        if not given:
            return None
        if len(given) > 1:
            raise InvalidRequestError(f"{where} sets {sorted(given)}; give exactly one of {', '.join(KINDS)}")
        (kind, spec), = given.items()
        compact = value.get("disable_any_whitespace") or False
        if not isinstance(compact, bool):
            raise InvalidRequestError(f"{where}.disable_any_whitespace must be true or false")
        return StructuredOutput(kind, _text(kind, spec, where), compact)

    def grammar(self) -> str:
        """The llguidance grammar (raises InvalidRequestError on a bad spec)."""
        import llguidance
        from llguidance.gbnf_to_lark import any_to_lark
        try:
            if self.kind in ("json", "json_object"):
                return llguidance.LLMatcher.grammar_from_json_schema(
                    self.text if self.kind == "json" else '{"type": "object"}',
                    defaults={"whitespace_flexible": not self.compact})
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.text)
            if self.kind == "choice":
                choices = json.loads(self.text)
                return llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in choices))
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(self.text))
        except (ValueError, RuntimeError, TypeError) as exc:
            raise InvalidRequestError(f"structured_outputs.{self.kind} is invalid: {exc}") from None


def _text(kind: str, spec, where: str) -> str:
    """A spec as text, checked for its type; a schema given as an object is serialised in its
    own key order (never sorted)."""
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"{where}.json is not valid JSON ({exc.msg})") from None
        if not isinstance(spec, (dict, bool)):
            raise InvalidRequestError(f"{where}.json must be a JSON schema (an object), got {spec!r}")
        return json.dumps(spec)
    if kind == "json_object":
        if spec is not True:
            raise InvalidRequestError(f"{where}.json_object must be true, got {spec!r}")
        return ""
    if kind == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise InvalidRequestError(f"{where}.choice must be a non-empty list of non-empty strings")
        return json.dumps(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidRequestError(f"{where}.{kind} must be a non-empty string")
    return spec


class Grammars:
    """Compiles requests' constraints against one tokenizer (its llguidance tokenizer is built
    once, on the first constrained request: ~1 s at a 49k vocabulary)."""

    def __init__(self, tokenizer, eos_ids: set[int], vocab: int):
        self.hf_tokenizer = tokenizer
        self.eos_ids = sorted(eos_ids)
        self.vocab = vocab   # the logits' width: masks cover it
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf
            self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab,
                                                           eos_token=self.eos_ids or None)
        return self._tokenizer

    def compile(self, constraint: StructuredOutput) -> "RowGrammar":
        import llguidance
        grammar = constraint.grammar()
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InvalidRequestError(f"structured_outputs.{constraint.kind} is invalid: {error}")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"structured_outputs.{constraint.kind} is invalid: "
                                      f"{matcher.get_error()}")
        return RowGrammar(matcher, self.vocab)


class RowGrammar:
    """One sequence's matcher: at the state of its committed output tokens between steps."""

    def __init__(self, matcher, vocab: int):
        self.matcher = matcher
        self.words = (vocab + 31) // 32

    def consume(self, tokens: list[int]) -> None:
        """Committed tokens. Every one was chosen under this grammar's mask; once the grammar
        has ended (EOS consumed) nothing more is consumed and its mask stays EOS alone (an
        `ignore_eos` row runs on EOS tokens to max_tokens)."""
        for token in tokens:
            if self.matcher.is_stopped():
                return
            self.matcher.consume_token(token)

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many of `drafts` the grammar accepts in a row from here."""
        return self.matcher.validate_tokens(drafts) if drafts else 0

    def masks(self, drafts: list[int], out: np.ndarray, first: int = 0) -> None:
        """Fill out[j - first] with position j's int32 bitmask for j in first .. len(drafts):
        the mask of the state after drafts[:j]. Drafts are consumed tentatively and rolled back;
        positions after a draft the grammar refuses are left as they are (that draft is
        rejected there, so nothing later is committed)."""
        consumed = 0
        for j in range(len(drafts) + 1):
            if j >= first:
                self._fill(out[j - first])
            if j == len(drafts) or self.matcher.is_stopped() or not self.matcher.try_consume_tokens([drafts[j]]):
                break
            consumed += 1
        if consumed:
            self.matcher.rollback(consumed)

    def _fill(self, row: np.ndarray) -> None:
        if self.matcher.is_error():   # unreachable (only masked tokens are committed): no mask,
            row[:] = -1               # rather than an all -inf row that sampling cannot normalise
            return
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.size * 4)


def stage_masks(upload, seqs, drafts: list[list[int]] | None, positions: int,
                first: int = 0) -> tuple | None:
    """The constrained rows' masks at verified positions first .. positions - 1, as sections of
    `upload`: (rows, masks [R, positions - first, words]), or None when no row is constrained.
    drafts[i]: row i's drafts (none: the state's own mask); positions past a row's own drafts
    allow everything (never committed)."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return None
    words = seqs[rows[0]].grammar.words
    masks = np.full((len(rows), positions - first, words), -1, dtype=np.int32)
    for at, row in enumerate(rows):
        own = [] if drafts is None else drafts[row][:positions - 1]
        seqs[row].grammar.masks(own, masks[at], first)
    return (upload.add(rows, len(rows)),
            upload.add(torch.from_numpy(masks), len(rows), positions - first, words))


def allowed(sent: list[torch.Tensor], staged: tuple, batch: int, vocab: int) -> torch.Tensor:
    """[B, T, V] bool from `stage_masks`' sections (True for every token of a row it left out)."""
    rows, words = sent[staged[0]], sent[staged[1]]
    bits = (words[..., None] >> torch.arange(32, device=words.device)) & 1
    unpacked = bits.bool().flatten(-2)[..., :vocab]
    out = torch.ones(batch, words.shape[1], vocab, dtype=torch.bool, device=words.device)
    out[rows] = unpacked
    return out


def apply_masks(scores: torch.Tensor, mask: torch.Tensor | None, first: int = 0) -> torch.Tensor:
    """-inf where the grammar forbids; scores [B, T, V], mask [B, >= first + T, V']."""
    if mask is None:
        return scores
    positions, vocab = scores.shape[1:]
    keep = mask[:, first:first + positions, :vocab]
    return scores.masked_fill(~keep, float("-inf"))
