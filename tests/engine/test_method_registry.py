"""A speculative method lives in one place (design: "Proposers"): its proposer class declares,
loads and builds it, spec/registry.py lists it, and nothing in the engine, the model loading or
the compiled path names one. These tests keep it so: the modules that build, load and run a
proposer hold no method name (and config.py / vllm_args.py compare none), and a method defined
here, registered through the registry's public API, serves exactly through LLMEngine and
model.json without a line changed in engine/.
"""
from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from exspec import EngineConfig, SamplingParams
from exspec.speculative import METHODS, SPECULATIVE_BOUNDS, SpeculativeConfig, SpeculativeMethod
from exspec.spec.proposer import Proposal, Proposer
from exspec.spec.registry import BUILT_IN, registered
from exspec.demo.tiny import build_tokenizer

from enginekit import assert_equivalent, make_engine
from test_ngram import cyclic_target

PACKAGE = Path(__file__).resolve().parents[2] / "backend" / "exspec"
# never a method name: what builds, loads and runs a proposer
NAMELESS = sorted((PACKAGE / "engine").glob("*.py")) + [PACKAGE / "models" / "compiled.py",
                                                        PACKAGE / "models" / "loading.py"]
# names only as keys and spellings, never compared: what validates and translates the config
COMPARE_NONE = [PACKAGE / "config.py", PACKAGE / "vllm_args.py", PACKAGE / "speculative.py"]


def _docstrings(tree) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def names_anywhere(source: str, names) -> list[str]:
    """Every string constant in the code (docstrings aside) that is a method's name."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    hits = [n for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in names and id(n) not in skip]
    return [f"line {n.lineno}: {n.value!r}" for n in sorted(hits, key=lambda n: (n.lineno, n.col_offset))]


def names_compared(source: str, names) -> list[str]:
    """Comparisons of a value with a method's name: `x == "ngram"`, `x != ...`, `x in
    ("ngram", ...)`. A name on the left of `in` is a key looked up (`"draft_model" in values`)."""
    def named(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(map(named, node.elts))

    found = []
    compares = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Compare)]
    for node in sorted(compares, key=lambda n: (n.lineno, n.col_offset)):
        operands = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, operands, operands[1:]):
            membership = isinstance(op, (ast.In, ast.NotIn))
            if named(right) or (not membership and named(left)):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_that_builds_loads_or_runs_a_proposer_names_a_method():
    names = set(METHODS.names())
    found = {str(p.relative_to(PACKAGE)): names_anywhere(p.read_text(), names) for p in NAMELESS}
    found.update({str(p.relative_to(PACKAGE)): names_compared(p.read_text(), names) for p in COMPARE_NONE})
    found = {path: hits for path, hits in found.items() if hits}
    assert not found, ("method names where a method's registry entry should be asked instead:\n"
                       + "\n".join(f"{path}: {hit}" for path, hits in found.items() for hit in hits))


def test_the_checks_see_a_planted_method_name():
    """Negative control: an identity check, a name tuple and a literal are each reported; a key
    lookup and a docstring are not."""
    names = {"eagle3", "ngram", "draft_model"}
    source = ('"""ngram"""\n'
              'if config.proposer == "eagle3":\n    pass\n'
              'ok = method not in ("draft_model", "x")\n'
              'has = "draft_model" in values\n'
              'kind = "ngram"\n')
    assert names_compared(source, names) == ["line 2: config.proposer == 'eagle3'",
                                             "line 4: method not in ('draft_model', 'x')"]
    assert names_anywhere(source, names) == ["line 2: 'eagle3'", "line 4: 'draft_model'",
                                             "line 5: 'draft_model'", "line 6: 'ngram'"]


def test_the_built_in_methods_are_the_registrys_lines_and_declare_themselves():
    assert METHODS.names() == tuple(p.speculative_method.name for p in BUILT_IN)
    for proposer in BUILT_IN:
        assert METHODS.get(proposer.speculative_method.name) is proposer
        for key in proposer.speculative_method.keys:   # its own keys are the config's
            assert key in {f.name for f in dataclasses.fields(SpeculativeConfig)}, (proposer, key)


def test_engine_config_and_the_speculative_config_share_keys_and_defaults():
    """EngineConfig's flat speculative fields (model.json's keys) are SpeculativeConfig's, with
    the same defaults; every bounded key is one of them."""
    engine = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    spec = {f.name: f.default for f in dataclasses.fields(SpeculativeConfig)}
    renamed = {"method": "proposer", "model": "draft_model"}
    for key, default in spec.items():
        ours = engine[renamed.get(key, key)]
        assert ours == default, f"{key}: EngineConfig's default {ours!r}, SpeculativeConfig's {default!r}"
    assert set(SPECULATIVE_BOUNDS) <= set(spec)


def test_importing_the_config_alone_knows_every_method():
    """The table lives below spec/ and is filled by spec/registry.py: `import exspec` (which
    importing exspec.config runs first) must import it, or a bare EngineConfig would refuse
    every method."""
    code = ("from exspec.config import EngineConfig\n"
            "from exspec.speculative import METHODS\n"
            "print(','.join(METHODS.names()))\n"
            "EngineConfig(target_model='t', proposer='suffix')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == ",".join(p.speculative_method.name for p in BUILT_IN)


# -- a method of the test's own ----------------------------------------------------------------

FIXED = 17   # the token it always proposes


class FixedTokenProposer(Proposer):
    """Proposes FIXED at every draft position: no model, no state; its drafts are made on the
    device after the upload, as a draft model's are."""
    speculative_method = SpeculativeMethod("fixed_token", usage="by a fixed token (method 'fixed_token')")
    proposes = True

    def propose(self, runner, state, seqs, plan, staged, sent, step) -> Proposal:
        tokens = torch.full((len(seqs), plan.width), FIXED, dtype=torch.long, device=runner.device)
        return Proposal(plan.width, tokens, masks=step.masks)


@pytest.fixture(scope="module")
def cyclic(tmp_path_factory):
    path = tmp_path_factory.mktemp("cyclic") / "target"
    return str(path), cyclic_target(path, len(build_tokenizer()))


def cycle_walks(successor, start: int, count: int) -> list[list[int]]:
    """Prompts walking FIXED's cycle from different points: the target's output goes on round
    it, so FIXED is the right next token once every cycle."""
    walks, token = [], start
    for i in range(count):
        walk = [token]
        for _ in range(4 + i):
            walk.append(successor[walk[-1]])
        walks.append(walk)
        token = successor[token]
    return walks


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_a_method_registered_in_a_test_serves_through_the_engine_exactly(pairs, cyclic, reference, method):
    target, successor = cyclic
    prompts = cycle_walks(successor, FIXED, 4)
    with registered(FixedTokenProposer):
        engine = make_engine(pairs, target_model=target, draft_model=None, proposer="fixed_token",
                             method=method, num_speculative_tokens=2, max_batch_size=4)
        assert isinstance(engine.runner.proposer, FixedTokenProposer)
        outs = engine.generate(prompts, SamplingParams(max_tokens=14, ignore_eos=True))
    assert_equivalent(outs, prompts, [14] * len(prompts), reference, target, 256, label=method)
    stats = engine.stats()
    assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] > 0, stats
    with pytest.raises(ValueError, match="unknown proposer 'fixed_token'"):   # gone with the block
        EngineConfig(target_model=target, proposer="fixed_token")


def test_a_registered_method_is_a_vllm_speculative_config_method():
    """model.json's translation knows it too: its name as speculative_config.method, refused a
    model it does not take, and listed among the methods when another is refused."""
    with registered(FixedTokenProposer):
        config = EngineConfig.from_dict({"model": "t", "speculative_config": {
            "method": "fixed_token", "num_speculative_tokens": 3}})
        assert (config.method, config.proposer, config.draft_model,
                config.num_speculative_tokens) == ("exspec", "fixed_token", None, 3)
        with pytest.raises(ValueError, match="method 'fixed_token' proposes without a draft model"):
            EngineConfig.from_dict({"model": "t", "speculative_config": {"method": "fixed_token",
                                                                         "model": "x"}})
        with pytest.raises(ValueError, match=r"or by a fixed token \(method 'fixed_token'\)"):
            EngineConfig.from_dict({"model": "t", "speculative_config": {"method": "medusa"}})
