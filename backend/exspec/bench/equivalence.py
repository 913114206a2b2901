"""Output equivalence (DESIGN §3.7): every run's rows against target-only greedy Hugging Face
`generate` at batch size 1, with the reference's top-2 logit gap at every first divergence; in a
sampled run, against the target-only seeded output (the engine's autoregressive path, batch 1,
gumbel coupling), which the gumbel coupling must equal and rejection sampling need not."""
from __future__ import annotations

from tqdm.auto import tqdm

from .methods import CellKey, HFModels, Run


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
        self._gaps: dict[tuple[int, int], float] = {}

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
                gap = None
                if self.greedy and n < len(ref) and n < len(got):
                    if (i, n) not in self._gaps:
                        self._gaps[i, n] = self.hf.logit_gap(self.prompts[i].ids, ref[:n])
                    gap = self._gaps[i, n]
                divergences.append({
                    "method": key.method, "batch_size": key.batch_size, "k": key.k,
                    "adaptive_k": key.adaptive_k, "sampling_coupling": key.coupling, "run": r,
                    "question_id": self.prompts[i].question_id, "position": n,
                    "reference_token": ref[n] if n < len(ref) else None,
                    "got_token": got[n] if n < len(got) else None,
                    "reference_len": len(ref), "got_len": len(got), "top2_gap_rel": gap,
                    "float_tie": gap is not None and gap < 1e-4})
        rows = len(prefix)
        return exact / rows, sum(prefix) / rows, divergences
