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
import threading
import sys
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidRequestError

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
            value = _loads(value, where)
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


def _too_deep(where: str) -> str:
    return (f"{where} is nested too deeply (past Python's recursion limit of "
            f"{sys.getrecursionlimit()} levels): flatten it, e.g. with $defs and $ref")


def _loads(text: str, where: str):
    """JSON text; a bad or too deeply nested text is the request's fault."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{where} is not valid JSON ({exc.msg} at position {exc.pos})") from None
    except RecursionError:   # json's parser recurses once per level
        raise InvalidRequestError(_too_deep(where)) from None


def _text(kind: str, spec, where: str) -> str:
    """A spec as text, checked for its type; a schema given as an object is serialised in its
    own key order (never sorted)."""
    if kind == "json":
        if isinstance(spec, str):
            spec = _loads(spec, f"{where}.json")
        if not isinstance(spec, (dict, bool)):
            raise InvalidRequestError(f"{where}.json must be a JSON schema (an object), got {spec!r}")
        try:
            return json.dumps(spec)
        except RecursionError:
            raise InvalidRequestError(_too_deep(f"{where}.json")) from None
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
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:   # the adapter admits requests on several threads; built once
            if self._tokenizer is None:
                import llguidance.hf
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab, eos_token=self.eos_ids or None)
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
        row = RowGrammar(matcher, self.vocab)
        if not row.start_mask().any() or matcher.is_error():   # e.g. the regex [^\s\S]
            raise InvalidRequestError(f"structured_outputs.{constraint.kind} admits no output: "
                                      f"no token can start it ({matcher.get_error() or 'empty mask'})")
        return row


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

    def start_mask(self) -> np.ndarray:
        """The bitmask (int32 words) of the tokens allowed in the matcher's current state."""
        words = np.zeros(self.words, dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        return words

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many of `drafts` the grammar accepts in a row from here."""
        return self.matcher.validate_tokens(drafts) if drafts else 0

    @property
    def error(self) -> str:
        """Why llguidance gave up on this row ('' while it has not): a limit it hit, e.g. "too
        many expressions constructed". Its masks then allow nothing, so the row ends with "no
        token is allowed"; this is the reason to add. The first line only: the rest dumps the
        parser's state."""
        return self.matcher.get_error().strip().split("\n", 1)[0]


_llg_executor = None   # llguidance's executor: fills many matchers' masks, the GIL released


def fill_masks(grammars: list[RowGrammar], drafts: list[list[int]], positions: int,
               first: int = 0) -> np.ndarray:
    """[R, positions - first, words] int32 bitmasks: row r's at position j (first <= j <
    positions) is that of its grammar's state after drafts[r][:j]. Past a draft the grammar
    refuses a row allows everything (that draft is rejected there: nothing later is committed);
    a grammar that has ended keeps its mask (EOS alone) to the last position, as it would over
    the steps of a target-only run (an `ignore_eos` row). The matchers end where they began."""
    global _llg_executor
    if _llg_executor is None:
        import llguidance
        _llg_executor = llguidance.LLExecutor()
    words = grammars[0].words
    span = positions - first
    masks = np.full((len(grammars), span, words), -1, dtype=np.int32)
    jobs, consumed, ended = [], [], []
    for r, (grammar, own) in enumerate(zip(grammars, drafts)):
        matcher, own = grammar.matcher, own[:positions - 1]
        if matcher.is_error():   # nothing is allowed: the runner ends the row with an error
            masks[r] = 0         # (a matcher that masked nothing would let any token through)
            consumed.append(0)
            ended.append(None)
            continue
        valid = matcher.validate_tokens(own) if own else 0   # the state after own[:valid] is the last
        if valid:
            matcher.consume_tokens(own[:valid])
        stops = matcher.is_stopped()
        at = min(first, valid)   # the executor starts at position `at`: keep own[:at] consumed
        if valid > at:
            matcher.rollback(valid - at)
        consumed.append(at)
        if valid >= first:
            jobs.append((matcher, r * span, own[first:valid]))
            ended.append(valid - first if stops else None)
        elif stops:   # ended before `first`: its end's mask from `first` on
            jobs.append((matcher, r * span, []))
            ended.append(0)
        else:         # refused a draft before `first`: never committed there
            ended.append(None)
    # one executor call for the rows with drafts, one for those without (it wants drafts there)
    with_drafts = [job for job in jobs if job[2]]
    if with_drafts:
        _llg_executor.unsafe_compute_mask_ptr_with_draft_token(with_drafts, masks.ctypes.data,
                                                                words * 4, masks.shape[0] * span)
    alone = [job[:2] for job in jobs if not job[2]]
    if alone:
        _llg_executor.unsafe_compute_mask_ptr(alone, masks.ctypes.data, words * 4, masks.shape[0] * span)
    for r, (grammar, count, end) in enumerate(zip(grammars, consumed, ended)):
        if count:
            grammar.matcher.rollback(count)
        if end is not None:
            masks[r, end + 1:] = masks[r, end]
    return masks


_mask_thread = None   # fills masks while the main thread runs a forward (llguidance drops the GIL)


class StepMasks:
    """The constrained rows' masks at the positions of one step (or prefill), made on the
    grammar thread while the forwards run: a part is started as soon as its drafts are known
    (`start`, `extend`), filled by llguidance and unpacked there into a [B, T, V] bool of the
    forbidden tokens, and waited for only when a token is picked under it (`forbidden`). A
    part goes up in its own copy (no wait for the device): the step's upload has left by then.
    Only the copy and a masked_fill are left on the step's thread."""

    def __init__(self, seqs, transfers, vocab: int):
        self.rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        self.grammars = [seqs[i].grammar for i in self.rows]
        self.batch, self.transfers, self.vocab = len(seqs), transfers, vocab
        # per part: its first position, its count and its masks (a future of the host array,
        # then the device tensor)
        self.parts: list[list] = []
        self.positions = 0   # positions started

    @classmethod
    def start(cls, seqs, transfers, vocab: int, drafts: list[list[int]] | None,
              positions: int) -> "StepMasks | None":
        """Start positions 0 .. positions - 1 (drafts[i]: row i's drafts; None: the state's own
        mask); None when no row is constrained."""
        masks = cls(seqs, transfers, vocab)
        if not masks.rows:
            return None
        masks.extend(drafts, positions)
        return masks

    def extend(self, drafts: list[list[int]] | None, positions: int) -> None:
        """Start the positions from the first not started yet up to positions - 1."""
        global _mask_thread
        if _mask_thread is None:
            from concurrent.futures import ThreadPoolExecutor
            _mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="exspec-grammar")
        own = [[] if drafts is None else list(drafts[i]) for i in self.rows]
        future = _mask_thread.submit(self._forbidden, own, positions, self.positions)
        self.parts.append([self.positions, positions - self.positions, future])
        self.positions = positions

    def _forbidden(self, own: list[list[int]], positions: int, first: int) -> np.ndarray:
        """[B, positions - first, V] bool (on the grammar thread): True where a row's grammar
        forbids the token; never for a free row."""
        words = fill_masks(self.grammars, own, positions, first)
        bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[..., :self.vocab]
        out = np.zeros((self.batch, positions - first, self.vocab), dtype=np.bool_)
        out[self.rows] = bits == 0
        return out

    def forbidden(self, first: int = 0, end: int | None = None) -> torch.Tensor:
        """[B, end - first, V] bool on the device for positions first .. end - 1 (end: every
        started one), waiting for the parts that hold them and only those."""
        end = self.positions if end is None else end
        parts = [p for p in self.parts if p[0] < end and p[0] + p[1] > first]
        for part in parts:
            if not isinstance(part[2], torch.Tensor):
                part[2] = self.transfers.to_device(torch.from_numpy(part[2].result()))
        held = parts[0][2] if len(parts) == 1 else torch.cat([p[2] for p in parts], dim=1)
        return held[:, first - parts[0][0]:end - parts[0][0]]


def apply_masks(scores: torch.Tensor, masks: "StepMasks | None", first: int = 0) -> torch.Tensor:
    """-inf where the grammar forbids, at positions first .. first + T - 1 of `masks`;
    scores [B, T, V]."""
    if masks is None:
        return scores
    positions, vocab = scores.shape[1:]
    return scores.masked_fill(masks.forbidden(first, first + positions)[..., :vocab], float("-inf"))
