"""Per-token logprobs in vLLM's meaning (exspec/sampling/logprobs.py) and per-token text deltas, in the
engine: only the rows that ask get them, and they are the target's own numbers."""
import pytest
import torch

from exspec import SamplingParams

from enginekit import _load, make_engine


def _run(engine, requests: dict) -> dict:
    """request id -> (prompt, params); returns request id -> its outputs, in order."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def test_logprobs_are_the_targets_for_the_rows_that_asked(pairs):
    engine = make_engine(pairs, "llama", "noisy", max_batch_size=4)
    prompt = [5, 6, 7, 8]
    outs = _run(engine, {"top3": (prompt, SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3)),
                         "none": (prompt, SamplingParams(max_tokens=10, ignore_eos=True))})
    assert all(o.new_logprobs is None for o in outs["none"]), "a row that did not ask got logprobs"
    ids = [t for o in outs["top3"] for t in o.new_token_ids]
    logprobs = [lp for o in outs["top3"] for lp in o.new_logprobs]
    assert len(logprobs) == len(ids) == 10
    with torch.no_grad():
        logits = _load(pairs["llama", "target"])(torch.tensor([prompt + ids])).logits[0]
    reference = logits[len(prompt) - 1:-1].float().log_softmax(-1)
    for pos, (token, lp) in enumerate(zip(ids, logprobs)):
        assert abs(lp.logprob - reference[pos, token].item()) < 1e-4, pos
        assert lp.rank == 1, f"greedy chose a token of rank {lp.rank} at {pos}"
        top = reference[pos].topk(3)
        assert [t for t, _ in lp.top] == top.indices.tolist(), pos
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4), pos


def test_text_per_token_splits_each_step_into_its_tokens_texts(pairs):
    # an identical twin draft: every draft is accepted, so steps commit several tokens
    engine = make_engine(pairs, "llama", "twin", max_batch_size=4)
    params = dict(max_tokens=40, ignore_eos=True, stop=["zz"])
    outs = _run(engine, {"split": ("日本語 🚀", SamplingParams(**params, text_per_token=True)),
                         "whole": ("日本語 🚀", SamplingParams(**params))})
    assert max(len(o.new_token_ids) for o in outs["split"]) > 1, "no step committed several tokens"
    for o in outs["split"]:
        assert len(o.token_texts) == len(o.new_token_ids), o
        assert "".join(o.token_texts) == o.text_delta, o
    assert all(o.token_texts is None for o in outs["whole"])
    assert "".join(o.text_delta for o in outs["split"]) == "".join(o.text_delta for o in outs["whole"])
