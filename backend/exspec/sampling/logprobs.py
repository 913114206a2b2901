"""Per-token logprobs in vLLM's meaning, for the rows of a batch that asked for them.

vLLM's default logprobs mode is raw: values come from the model's logits before temperature,
top-k or top-p. A token's rank counts the tokens at least as likely as it (vLLM's rule, so the
most likely token has rank 1). Only the rows that asked are copied to the host, in one transfer,
and the top-N alternatives only as wide as the widest request.
"""
from __future__ import annotations

import torch

from ..outputs import TokenLogprob


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, wanted: list[int | None]):
    """logits [B, T, V] (raw target logits), tokens [B, T] (the tokens chosen), wanted[b]: row
    b's `logprobs` (None: it did not ask). Returns, per row, T TokenLogprob or None."""
    rows = [b for b, n in enumerate(wanted) if n is not None]
    out: list[list[TokenLogprob] | None] = [None] * len(wanted)
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    logp = logits.index_select(0, index).float().log_softmax(-1)
    chosen = logp.gather(-1, tokens.index_select(0, index).unsqueeze(-1))      # [R, T, 1]
    rank = (logp >= chosen).sum(-1, keepdim=True)
    width = max(wanted[b] for b in rows)
    top_logp, top_ids = logp.topk(width, dim=-1) if width else (logp[..., :0], logp[..., :0])
    # ids and ranks are < 2^24, exact in float32: one tensor, one host transfer
    host = torch.cat([chosen, rank.float(), top_logp, top_ids.float()], dim=-1).tolist()
    for r, b in enumerate(rows):
        n = wanted[b]
        out[b] = [TokenLogprob(v[0], int(v[1]),
                               [(int(i), lp) for i, lp in zip(v[2 + width:2 + width + n], v[2:2 + n])])
                  for v in host[r]]
    return out
