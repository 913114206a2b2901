"""Output equivalence (design: "Definitions"): every run's rows against target-only greedy Hugging Face
`generate` at batch size 1, with the reference's top-2 logit gap at every first divergence; in a
sampled run, against the target-only seeded output (the engine's autoregressive path, batch 1,
gumbel coupling), which the gumbel coupling must equal and rejection sampling need not."""
from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from .methods import CellKey, HFModels, Run


FLOAT32_TIE = 1e-4   # design: "Definitions": a top-2 gap below this share of the logit range
TIE_ULPS = 4         # bf16 / fp16: a top-2 gap within this many ulps at the top logit


def ulp(value: float, dtype: str) -> float:
    """The spacing of `dtype` numbers at |value| (bfloat16 keeps 8 significant bits, float16
    11), i.e. how far apart two logits of that size can round."""
    eps = torch.finfo(getattr(torch, dtype)).eps
    return eps * 2.0 ** math.floor(math.log2(abs(value))) if value else eps


def is_near_tie(top: float, second: float, spread: float, dtype: str) -> bool:
    """Whether a first divergence is explained by rounding: the reference's top-2 logit gap is
    below 1e-4 of the logit range in float32, and within TIE_ULPS ulps of the dtype at the top
    logit's magnitude in bfloat16 / float16 (batched GEMMs round differently from batch-1 ones
    on a GPU, and one ulp there is ~0.4% of the logit)."""
    gap = top - second
    if dtype == "float32":
        return spread > 0 and gap / spread < FLOAT32_TIE
    return gap <= TIE_ULPS * ulp(top, dtype)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Reference:
    """Target-only greedy HF generate at batch size 1, once per prompt; gaps on demand. `ids`:
    a sampled run's reference outputs instead (no logit gaps then: they are a greedy notion)."""

    def __init__(self, hf: HFModels, prompts: list[Prompt], max_tokens: int, progress: bool,
                 ids: list[list[int]] | None = None):
        self.hf, self.prompts = hf, prompts
        self.greedy = ids is None
        self.ids = ids if ids is not None else [
            hf.generate([p.ids], max_tokens)[0]
            for p in tqdm(prompts, desc="reference (HF generate, batch 1)", disable=not progress)]
        self._top_two: dict[tuple[int, int], tuple[float, float, float]] = {}

    def compare(self, key: CellKey, runs: list[Run]) -> tuple[float, float, list[dict]]:
        """(exact_match_share, prefix_match_mean, divergences) over every row of every run."""
        exact, prefix, divergences = 0, [], []
        for r, run in enumerate(runs):
            for i, (ref, got) in enumerate(zip(self.ids, run.outputs)):
                n = common_prefix(ref, got)
                longest = max(len(ref), len(got))
                prefix.append(n / longest if longest else 1.0)
                if ref == got:
                    exact += 1
                    continue
                top_two = None
                if self.greedy and n < len(ref) and n < len(got):
                    if (i, n) not in self._top_two:
                        self._top_two[i, n] = self.hf.top_two(self.prompts[i].ids, ref[:n])
                    top_two = self._top_two[i, n]
                top, second, spread = top_two or (None, None, None)
                divergences.append({
                    "method": key.method, "batch_size": key.batch_size, "k": key.k,
                    "adaptive_k": key.adaptive_k, "sampling_coupling": key.coupling, "run": r,
                    "question_id": self.prompts[i].question_id, "position": n,
                    "reference_token": ref[n] if n < len(ref) else None,
                    "got_token": got[n] if n < len(got) else None,
                    "reference_len": len(ref), "got_len": len(got),
                    "top2_gap": None if top_two is None else top - second,
                    "top2_gap_rel": None if top_two is None or not spread else (top - second) / spread,
                    "top2_gap_ulps": None if top_two is None else (top - second) / ulp(top, self.hf.dtype),
                    "float_tie": top_two is not None and is_near_tie(top, second, spread, self.hf.dtype)})
        rows = len(prefix)
        return exact / rows, sum(prefix) / rows, divergences
