"""The compiled decode path (DESIGN §3.5a): the step's forwards through torch.compile, warmed up
before the engine is ready.

What is compiled: every forward of a step (the draft's first forward of 1-2 tokens per row, its
later one-token forwards, its catch-up forward, and the verification of k + 1 tokens); a
prefill stays eager (its widths are the prompts'). One compile per model with symbolic shapes
(`dynamic=True`): batch, query width and cache width are symbols, so a step with more rows,
another k or longer rows reuses the same graph. Torch still specialises a size of 1 (one row,
one query token, one kept logit), so the warm-up runs each model at 1 and 2 rows through a
fixed schedule of steps that meets every forward kind once: afterwards nothing recompiles
(tests/engine/test_compiled.py counts it with Dynamo's own counters).

Nothing that varies per step reaches the graph as a Python int: the KV layouts hand the model
device tensors (EXSPEC's block tables, slots and masks, kv_blocks.py; EQSPEC's 2D mask, or its
4D masks by layer type for sliding-window models, built outside the graph: a window never
reaches it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch._dynamo.utils

from .params import SamplingParams

# "inductor" generates C++ (CPU) or Triton (GPU) kernels. Dynamo's guards, hence recompiles and
# graph breaks, do not depend on the backend, so tests use "eager" or "aot_eager" (no C++).
COMPILE_BACKEND = "inductor"


class CompiledForward:
    """A model's forward through torch.compile with symbolic sizes (one graph for every batch,
    query width and cache width, apart from torch's own specialisation of sizes 0 and 1)."""

    # Graphs per model: {1, more} rows x {1, more} query tokens; a target and a draft of one
    # class share their forward's code object, whose cache torch caps at 8 entries by default
    # (past that it silently runs eager), so the cap is raised to room for a few engines.
    RECOMPILE_LIMIT = 64

    def __init__(self, model):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   self.RECOMPILE_LIMIT)
        self.compiled = torch.compile(model, dynamic=True, backend=COMPILE_BACKEND)

    def __call__(self, **inputs):
        return self.compiled(**inputs)


def dynamo_counts() -> dict[str, int]:
    """Graphs Dynamo compiled (a recompile adds one) and graph breaks, process-wide."""
    counters = torch._dynamo.utils.counters
    return {"graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}


@dataclass
class WarmUp:
    graphs: int
    graph_breaks: int
    seconds: float


def warm_up_schedule(k: int) -> list[int]:
    """The k of each warm-up step: a full step (draft 1-token forwards, k + 1 verification), a
    plain one (one-token verification), a speculative one after it (the draft's 2-token first
    forward) and one after three plain steps (the draft's catch-up forward)."""
    return [k, 0, k, 0, 0, 0, k] if k > 0 else [0]


def warm_up(runner, make_sequence, k: int, vocab_size: int) -> WarmUp:
    """Run every decode forward kind at 1 and 2 rows so that all compiling happens now.
    `make_sequence(request_id, prompt_ids, params)` builds an engine Sequence."""
    before, start = dynamo_counts(), time.perf_counter()
    params = SamplingParams(max_tokens=8 * (k + 1), ignore_eos=True)   # never finishes here
    for batch in (1, 2):
        prompts = [[(7 * i + 3 * j + 1) % vocab_size for j in range(5 + 3 * i)] for i in range(batch)]
        group = runner.new_group([make_sequence(f"warm-up-{batch}-{i}", p, params)
                                  for i, p in enumerate(prompts)])
        runner.prefill(group, [len(p) for p in prompts])
        for step_k in warm_up_schedule(k if runner.draft is not None else 0):
            runner.step(group, step_k)
            group.realign()
    after = dynamo_counts()
    return WarmUp(after["graphs"] - before["graphs"], after["graph_breaks"] - before["graph_breaks"],
                  time.perf_counter() - start)
