"""The speculative configuration: vLLM's `speculative_config` as data (keys, defaults, bounds,
validation), and the table of the methods that serve it (design: "Proposers").

A method lives in one place: its proposer class (spec/<method>.py) declares what the
configuration holds for it (`SpeculativeMethod`: its name, what its `model` is, the keys only it
reads, its own rule), loads its own weights and builds itself; spec/registry.py lists the classes,
one line each, and is the one factory. This module sits on the config floor, below spec/, so that
EngineConfig, the model.json translation (vllm_args.py) and the pair's loading (models/loading.py)
can look a method up by name without importing spec/: spec/registry.py fills `METHODS` when it is
imported, which `import exspec` does (its __init__ imports the engine, which imports the registry).
Nothing here names a method except `DEFAULT_METHOD`, vLLM's default.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Protocol

# vLLM's speculative_config without a method: a draft model (its `model`)
DEFAULT_METHOD = "draft_model"

# The speculative keys' bounds, inclusive (the suffix factor's low end excluded: > 0). Beyond
# them a key costs the engine thread more than it can pay back: adaptive k's per-length tables
# grow as k^2 (1.7 ms a step at k = 64 on the 2-core CPU, 19 ms at 256), a suffix tree's first
# proposal as its depth (20 s at depth 512 for a 16k-token prompt), an n-gram index as
# prompt_lookup_max^2 (11 s and 1.2 GiB for one 16k-token prompt at 128).
SPECULATIVE_BOUNDS = {   # k last: vLLM's suffix method defaults k to the tree's depth
    "prompt_lookup_min": (1, 16),
    "prompt_lookup_max": (1, 16),
    "suffix_decoding_max_tree_depth": (1, 64),
    "suffix_decoding_max_cached_requests": (0, 1_000_000),
    "suffix_decoding_max_cached_tokens": (0, 100_000_000),
    "suffix_decoding_max_spec_factor": (0, 64),
    "suffix_decoding_min_token_prob": (0, 1),
    "num_speculative_tokens": (0, 64),
}
OPEN_LOW = ("suffix_decoding_max_spec_factor",)   # 0 would propose nothing


@dataclass(frozen=True)
class SpeculativeMethod:
    """What the configuration holds for one method, declared by its proposer class."""
    name: str                        # EngineConfig.proposer; vLLM's speculative_config.method
    usage: str                       # how it is asked for, in vLLM's "not supported" error
    model: str | None = None         # what its `model` (EngineConfig.draft_model) names; None: it
                                     # proposes without one
    keys: tuple[str, ...] = ()       # the speculative keys only it reads (vLLM's names)
    k_from: str | None = None        # vLLM: without num_speculative_tokens, k is this key's value
    check: Callable[["SpeculativeConfig"], None] | None = None   # its rule across its own keys
    head: bool = False               # its model is a head on the target's hidden states (an
                                     # EAGLE-3 head, load_head), not an LLM of its own


class MethodEntry(Protocol):
    """What the table holds per method: its proposer class (spec/proposer.py), as the floors
    below spec/ see it: its declaration and how it loads its weights (models/loading.py)."""
    speculative_method: SpeculativeMethod

    @classmethod
    def load_draft(cls, config) -> object | None: ...
    @classmethod
    def load_head(cls, config, target) -> object | None: ...


class MethodTable:
    """name -> the proposer class that serves it, in registration order (spec/registry.py
    registers; everything else looks up)."""

    def __init__(self):
        self._entries: dict[str, MethodEntry] = {}

    def add(self, entry: MethodEntry) -> None:
        name = entry.speculative_method.name
        if name in self._entries:
            raise ValueError(f"speculative method {name!r} is already registered")
        self._entries[name] = entry

    def remove(self, name: str) -> None:
        del self._entries[name]

    def __contains__(self, name) -> bool:
        return name in self._entries

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def get(self, name: str) -> MethodEntry:
        """The proposer class of method `name`; a ValueError naming the known ones if none."""
        if name not in self._entries:
            raise ValueError(f"unknown proposer {name!r}; expected one of {', '.join(self._entries)}")
        return self._entries[name]

    def declared(self, name: str) -> SpeculativeMethod:
        return self.get(name).speculative_method

    def declarations(self) -> list[SpeculativeMethod]:
        return [entry.speculative_method for entry in self._entries.values()]


METHODS = MethodTable()


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config keys, with exspec's defaults (EngineConfig's, whose flat fields
    it is built from: EngineConfig.speculative_config). Data only: what a method's proposer is
    built from. Validated at construction, each error naming the key."""
    method: str = DEFAULT_METHOD
    model: str | None = None
    num_speculative_tokens: int = 5
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_cached_tokens: int = 1_000_000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self):
        declared = METHODS.declared(self.method)
        if declared.model is None and self.model:
            raise ValueError(f"proposer {self.method!r} proposes without a draft model; drop "
                             "draft_model")
        self._check_bounds()
        if declared.check is not None:
            declared.check(self)

    def _check_bounds(self) -> None:
        """Every speculative key finite and within SPECULATIVE_BOUNDS, whatever the method (a
        NaN passes every comparison: `nan < 0` is false; Python's json reads NaN and Infinity)."""
        for name, (low, high) in SPECULATIVE_BOUNDS.items():
            value = getattr(self, name)
            open_low = name in OPEN_LOW
            inside = low < value <= high if open_low else low <= value <= high
            if not (math.isfinite(value) and inside):
                bound = f"{'(' if open_low else '['}{low}, {high}]"
                raise ValueError(f"{name} must be a finite number in {bound}, got {value!r}")

    @classmethod
    def default(cls, key: str):
        """The default of one of its keys."""
        return next(f.default for f in dataclasses.fields(cls) if f.name == key)
