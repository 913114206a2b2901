"""The target's decoder-layer matrices stored for a verification's few rows on a CPU, on the
compiled decode path.

nn.Linear keeps its weight [out, in] and multiplies x @ weight.T, which MKL's sgemm reads as a
transposed operand; from 4 rows on it then takes a path that costs about 1.5x one row. The same
values stored [in, out] (the weight with transposed strides, so every caller still sees an [out,
in] Linear weight) are read as a plain operand, another path: cheaper from 4 rows on, dearer at
2 and 3 (`scripts/weight_layout_cost.py`; Intel Xeon, one thread, the real pair's 210 matrices:
5 rows 1.49x -> 1.38x one row, 2 rows 1.12x -> 1.23x). So the target's one-token forwards are
fed as one token, not two (runner.forward_output): the real pair's target at batch 1, 96 tokens
of context, compiled: 1 token 50.5 -> 48.3 ms, 5 tokens 72.3 -> 65.9 ms (docs/results-by-machine.md).
A draft's forwards are one or two tokens wide, where the [out, in] layout is the cheaper: drafts
keep it. Laid out in place, once: no copy is kept.

Only on the compiled path, like the packed head (packed_head.py): the eager path keeps Hugging
Face's layout, so its tokens are the reference's to the bit; the compiled path's rounding
already differs from it by float32 ulps (inductor's kernels), and this adds another such
difference, in the prefill too (it runs the same weights eagerly).
"""
from __future__ import annotations

import torch


def lay_out_for_small_batches(layers) -> int:
    """Store every plain float32 CPU nn.Linear weight of `layers` [in, out] (strides (1, out));
    returns how many matrices are so laid out (0 on another device)."""
    count = 0
    with torch.no_grad():
        for layer in layers:
            for module in layer.modules():
                weight = getattr(module, "weight", None)
                if (type(module) is not torch.nn.Linear or weight.device.type != "cpu"
                        or weight.dtype != torch.float32):
                    continue
                if weight.is_contiguous():
                    weight.data = weight.data.t().contiguous().t()
                count += weight.t().is_contiguous()
    return count
