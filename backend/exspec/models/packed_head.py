"""The output head (lm_head) prepacked for small batches on a CPU, on the compiled decode path.

A verification of k + 1 tokens multiplies k + 1 rows by the lm_head, the largest matrix of a small
model (SmolLM2-135M: 49,152 x 576, a fifth of its weights). MKL's sgemm repacks the weight on
every call, and from 4 rows on takes a path that costs about twice one row: on an Intel Xeon, one
thread, 10.3 ms for 1 row, 20.5 ms for 5. A weight packed once by oneDNN for that batch size
(`mkldnn._reorder_linear_weight`) costs 9.8 ms for 1 row and 10.4 ms for 5, so the head no longer
grows with the verification's width (measured by `scripts/verification_cost.py`;
docs/results-by-machine.md).

Only the head, and only on the compiled path: it runs eagerly between the compiled regions (a
packed oneDNN tensor cannot enter a Dynamo graph), and the decoder layers' own matrices, inside
the graphs, stay as inductor lays them out. The packed copy is extra memory (the head's size: 113
MB for SmolLM2, whose head is tied to its embedding). The eager path keeps Hugging Face's own
forward, so its tokens are the reference's to the bit; on the compiled path the head's rounding
differs from MKL's by float32 ulps, as inductor's kernels already do.
"""
from __future__ import annotations

import torch

from .packed_linears import pack, packed_product


def packable(model) -> bool:
    """A float32 CPU model with a plain nn.Linear head and no bias, where oneDNN is built in."""
    head = model.get_output_embeddings()
    return (type(head) is torch.nn.Linear and head.bias is None
            and head.weight.dtype == torch.float32 and head.weight.device.type == "cpu"
            and torch.backends.mkldnn.is_available())


class PackedHead:
    """The head's forward while `active()` says so (the compiled forward is running): through
    its oneDNN-packed weight; else the nn.Linear's own."""

    def __init__(self, head: torch.nn.Linear, active):
        self.eager = head.forward
        self.active = active
        self.out_features = head.out_features
        self.calls = 0   # forwards through the packed weight
        self.packed = pack(head.weight)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.active() or torch.is_grad_enabled():
            return self.eager(hidden)
        self.calls += 1
        return packed_product(hidden, self.packed, None, self.out_features)


def pack_head(model, active) -> bool:
    """Put a PackedHead on the model's lm_head (once); True when it has one."""
    head = model.get_output_embeddings()
    if isinstance(vars(head).get("forward"), PackedHead):
        return True
    if not packable(model):
        return False
    head.forward = PackedHead(head, active)
    return True
