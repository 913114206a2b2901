"""The analytic ideal of an engine run (design: "Definitions"), from measured forward costs."""
from __future__ import annotations

import statistics
import time

import torch

from .methods import ENGINE_METHODS, HFModels, sync


def describes(method: str, path: str) -> bool:
    """Whether CostModel's forwards are what a run of `method` on `path` runs: Hugging Face's
    eager target and draft model, so the eager path, and the target alone or the draft model's
    methods. Not a compiled forward (cheaper: measured runs came out at 130-260% of such an
    "ideal"), an EAGLE-3 head's drafts or a lookup's (no draft forward at all)."""
    return path == "eager" and ENGINE_METHODS.get(method, ("", ""))[1] == "draft_model"


class CostModel:
    """Median forward costs over a cache of typical length: draft(rows) = one draft forward with
    a 1-token query; target(rows, width) = one target forward at that query width (width 1 = a
    plain decoding step). After every engine run the benchmark samples that run's shapes a few
    rounds (interleaved); a shape's cost is the median of all its samples, so on a shared
    machine the costs see the same spread of load over the benchmark as the runs do.
    """

    ROUNDS = 3
    WARMUP = 1

    def __init__(self, hf: HFModels, cache_len: int, seed: int = 0):
        self.hf = hf
        self.cache_len = cache_len
        self.gen = torch.Generator().manual_seed(seed)
        self.samples: dict[tuple[str, int, int], list[float]] = {}
        self._caches: dict[tuple[str, int], tuple] = {}
        self._queries: dict[tuple[str, int, int], tuple] = {}

    @staticmethod
    def shapes(steps_by_shape) -> list[tuple[str, int, int]]:
        """The forwards behind steps at these (rows, k)."""
        need = set()
        for rows, k in steps_by_shape:
            need.add(("target", rows, k + 1))
            if k > 0:
                need.add(("draft", rows, 1))
        return sorted(need)

    @torch.inference_mode()
    def measure(self, shapes: list[tuple[str, int, int]]) -> None:
        """Add ROUNDS samples of each shape's forward, measured now, round by round."""
        device = self.hf.device
        for shape in shapes:
            self._prepare(shape)
        times = {shape: [] for shape in shapes}
        for r in range(self.WARMUP + self.ROUNDS):
            for shape in shapes:
                model, cache = self._caches[shape[:2]]
                ids, pos = self._queries[shape]
                sync(device)
                start = time.perf_counter()
                model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True,
                      logits_to_keep=shape[2])
                sync(device)
                if r >= self.WARMUP:
                    times[shape].append(time.perf_counter() - start)
                cache.crop(-shape[2])   # back to cache_len entries
        for shape, values in times.items():
            self.samples.setdefault(shape, []).extend(values)

    def cost(self, shape: tuple[str, int, int]) -> float:
        if shape not in self.samples:
            self.measure([shape])
        return statistics.median(self.samples[shape])

    def _prepare(self, shape: tuple[str, int, int]) -> None:
        """A cache of cache_len random tokens per (model, rows), and a query per shape."""
        from transformers import DynamicCache
        role, rows, width = shape
        model = self.hf.draft if role == "draft" else self.hf.target
        vocab = model.get_output_embeddings().weight.shape[0]
        device = self.hf.device
        if (role, rows) not in self._caches:
            context = torch.randint(vocab, (rows, self.cache_len), generator=self.gen).to(device)
            cache = DynamicCache(config=model.config)
            model(input_ids=context, cache=cache, use_cache=True, logits_to_keep=1)
            self._caches[role, rows] = (model, cache)
        if shape not in self._queries:
            ids = torch.randint(vocab, (rows, width), generator=self.gen).to(device)
            pos = torch.arange(self.cache_len, self.cache_len + width, device=device).expand(rows, width)
            self._queries[shape] = (ids, pos)

    def ideal_seconds(self, stats: dict) -> float:
        """Ideal time of one engine run: each step it ran at its (rows, k) (k draft forwards and
        one verification at width k+1, or one plain forward at k = 0), plus its measured
        prefill time."""
        steps = 0.0
        for (rows, k), n in stats["steps_by_shape"].items():
            if k == 0:
                step = self.cost(("target", rows, 1))
            else:
                step = k * self.cost(("draft", rows, 1)) + self.cost(("target", rows, k + 1))
            steps += n * step
        return steps + stats["time_prefill_s"]

    def table_ms(self) -> dict:
        return {f"{role} rows={rows} width={width}": round(statistics.median(s) * 1e3, 4)
                for (role, rows, width), s in sorted(self.samples.items())}
