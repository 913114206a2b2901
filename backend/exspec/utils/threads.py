"""How many threads torch's CPU kernels use: chosen once, the same rule for the server and the
benchmark, and said out loud.

torch's default is one intra-op thread per core, whose OpenMP workers spin at every kernel's
barrier. On a machine whose cores are shared (Triton's own threads, a load client, another
model instance) a preempted worker stalls every kernel of the step. Measured here (2 cores, the
demo pair served, a locust client on the same machine, docs/serving.md, "Threads"): 206 vs 139 output
tokens/s with one thread vs two at concurrency 1, 488 vs 341 at concurrency 4. Tiny per-token
kernels gain little from a second thread anyway, so the default is one thread; a machine with
cores to spare sets more explicitly.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

DEFAULT_THREADS = 1


@dataclass(frozen=True)
class ThreadChoice:
    intra_op: int
    source: str         # "torch_threads", "OMP_NUM_THREADS" or "default"

    def describe(self) -> str:
        return f"{self.intra_op} torch thread{'s' if self.intra_op != 1 else ''} ({self.source})"


def choose_threads(requested: int | None, environ=os.environ) -> ThreadChoice:
    """An explicit value (model.json `torch_threads`, exspec-bench --threads) wins; else
    OMP_NUM_THREADS when it is set to a positive integer, as torch itself would honour it;
    else DEFAULT_THREADS."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"torch_threads must be >= 1, got {requested}")
        return ThreadChoice(requested, "torch_threads")
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1:
        return ThreadChoice(int(omp), "OMP_NUM_THREADS")
    return ThreadChoice(DEFAULT_THREADS, "default")


def apply_threads(choice: ThreadChoice) -> ThreadChoice:
    """Set torch's intra-op threads, and inter-op threads to match when torch still allows it
    (only before the first inter-op parallel work of the process). Returns what torch now
    reports, so a log line built from it shows the setting really took."""
    torch.set_num_threads(choice.intra_op)
    try:
        torch.set_num_interop_threads(choice.intra_op)
    except RuntimeError:
        pass    # already fixed for this process; the engine runs no inter-op parallel work
    return ThreadChoice(torch.get_num_threads(), choice.source)
