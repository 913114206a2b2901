"""The benchmark's divergence rule (design: "Definitions"): which first divergences a floating-point
near-tie explains, per dtype. float32: a reference top-2 gap below 1e-4 of the logit range;
bfloat16 / float16: a gap within a few ulps of that dtype at the top logit's magnitude."""
from __future__ import annotations

import pytest
import torch

from exspec.bench.equivalence import TIE_ULPS, is_near_tie, ulp


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("value", [0.3, 1.0, 7.5, 24.0, -24.0, 130.0])
def test_ulp_is_the_spacing_of_the_dtype_at_that_magnitude(dtype, value):
    x = torch.tensor(value, dtype=getattr(torch, dtype))
    above = torch.nextafter(x.abs(), torch.tensor(float("inf"), dtype=x.dtype))
    assert ulp(float(x), dtype) == pytest.approx(float(above - x.abs()))


def test_bf16_ties_are_a_few_ulps_at_the_top_logit():
    # at a top logit of 24, a bf16 ulp is 0.125: two logits 0.25 apart can swap by rounding
    assert ulp(24.0, "bfloat16") == 0.125
    assert is_near_tie(24.0, 24.0 - 0.25, spread=40.0, dtype="bfloat16")
    assert is_near_tie(24.0, 24.0 - TIE_ULPS * 0.125, spread=40.0, dtype="bfloat16")
    assert not is_near_tie(24.0, 24.0 - (TIE_ULPS + 1) * 0.125, spread=40.0, dtype="bfloat16")
    # the float32 rule would call every one of these gaps real (1e-4 of 40 is 0.004)
    assert not is_near_tie(24.0, 24.0 - 0.25, spread=40.0, dtype="float32")


def test_fp16_is_finer_than_bf16_and_scales_with_magnitude():
    assert ulp(24.0, "float16") == pytest.approx(0.125 / 8)
    assert is_near_tie(24.0, 23.97, spread=40.0, dtype="float16")
    assert not is_near_tie(24.0, 23.8, spread=40.0, dtype="float16")
    assert is_near_tie(96.0, 95.8, spread=40.0, dtype="float16")   # 4 x the ulp at 96


def test_float32_keeps_the_relative_rule():
    assert is_near_tie(10.0, 10.0 - 3e-4, spread=5.0, dtype="float32")
    assert not is_near_tie(10.0, 10.0 - 6e-4, spread=5.0, dtype="float32")
    assert not is_near_tie(1.0, 1.0, spread=0.0, dtype="float32")


def test_divergence_report_records_the_gap_and_applies_the_dtype_rule(tmp_path):
    """A real reference (HF generate on a tiny pair) and a run whose one row leaves it: the
    record carries the reference's top-2 gap (absolute, relative, in ulps) and the verdict."""
    from types import SimpleNamespace

    from exspec.bench.equivalence import Reference
    from exspec.bench.methods import CellKey, HFModels, Prompt, Run
    from exspec.demo.tiny import build_demo_pair

    pair = build_demo_pair(tmp_path / "pair")
    hf = HFModels(SimpleNamespace(target=str(pair / "target"), draft=None, device="cpu",
                                  tokenizer=str(pair / "tokenizer"), dtype="float32"))
    prompts = [Prompt(i, "test", "", ids) for i, ids in enumerate([[5, 6, 7], [40, 41]])]
    reference = Reference(hf, prompts, 8, progress=False)
    got = [list(reference.ids[0]), list(reference.ids[1])]
    got[1][3] = (got[1][3] + 1) % 300            # row 1 leaves the reference at position 3
    exact, _, divergences = reference.compare(CellKey("eqspec", 2, 3, False), [Run(0.0, got)])
    assert exact == 0.5 and len(divergences) == 1
    d = divergences[0]
    assert (d["question_id"], d["position"]) == (1, 3)
    top, second, spread = hf.top_two(prompts[1].ids, reference.ids[1][:3])
    assert d["top2_gap"] == pytest.approx(top - second) and d["top2_gap"] > 0
    assert d["top2_gap_rel"] == pytest.approx((top - second) / spread)
    assert d["top2_gap_ulps"] == pytest.approx((top - second) / ulp(top, "float32"))
    assert d["float_tie"] == is_near_tie(top, second, spread, "float32")
