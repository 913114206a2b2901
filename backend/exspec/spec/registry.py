"""The speculative methods exspec serves, one line each, and the one factory that turns a
configuration into a proposer (design: "Proposers"; vLLM's `init_speculator`).

A method lives in its proposer class: its declaration (`speculative_method`: name, what its
`model` is, its own keys and rule), its loading (`load_draft`, `load_head`) and its building
(`from_config`), besides the interface and capabilities every proposer has (proposer.py). Adding
one = its spec/ (and models/) files and a line in BUILT_IN; nothing in engine/, config.py,
vllm_args.py or models/ changes (tests/engine/test_method_registry.py registers one in a test).

The names are looked up in speculative.METHODS, on the config floor below this one (EngineConfig,
the model.json translation and load_pair validate and load through it); importing this module
fills it, and `import exspec` imports it (through the engine).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

from ..speculative import METHODS
from .draft_model import DraftModelProposer
from .eagle3 import Eagle3Proposer
from .hybrid import DraftModelSuffixProposer, Eagle3SuffixProposer
from .ngram import NgramProposer
from .proposer import Proposer
from .suffix import SuffixProposer

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..models.loading import ModelPair

# vLLM's speculative_config methods exspec runs, in the order its errors list them
BUILT_IN = (DraftModelProposer, Eagle3Proposer, NgramProposer, SuffixProposer, Eagle3SuffixProposer,
            DraftModelSuffixProposer)


def register(proposer: type[Proposer]) -> None:
    """Serve method `proposer.speculative_method.name` with this proposer class."""
    if proposer.speculative_method is None:
        raise ValueError(f"{proposer.__name__} declares no speculative_method")
    METHODS.add(proposer)


def unregister(name: str) -> None:
    METHODS.remove(name)


@contextmanager
def registered(proposer: type[Proposer]):
    """`register` for the duration of a block (a test's method)."""
    register(proposer)
    try:
        yield proposer
    finally:
        unregister(proposer.speculative_method.name)


def proposer_for(config: EngineConfig, pair: ModelPair | None, pad_id: int) -> Proposer:
    """The proposer the config asks for, decided once, at load (proposer.py): its method's, or
    none (autoregressive, k = 0: plain decoding on the method's layout). `pair` may be None for
    a method that loads no model."""
    if not config.speculative:
        return Proposer()
    return METHODS.get(config.proposer).from_config(config.speculative_config, pair, pad_id)


for _proposer in BUILT_IN:
    register(_proposer)
