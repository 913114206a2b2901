"""The layers' linears through oneDNN-packed copies on a CPU's compiled path (packed_linears.py):
the op against F.linear, the warm-up's timed choice, the copies' lifetime, and an inductor
engine serving through them exactly, on graphs its compile cache keeps."""
import gc
import logging

import pytest
import torch
import torch._dynamo.utils
import torch.nn.functional as F

from exspec.models import compiled, packed_linears
from exspec.models.packed_linears import PackedLinear, PackedLinears, packed_linear, packs

from enginekit import make_engine
from test_compiled_inductor import assert_target_greedy, run_compiling_nothing


class Layer(torch.nn.Module):
    def __init__(self, size=256, bias=False):
        super().__init__()
        self.proj = torch.nn.Linear(size, size, bias=bias)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_only_float32_cpu_linears_big_enough_to_pay_for_the_op_are_packed():
    assert packs(torch.nn.Linear(256, 256))   # 65,536 weights: PACK_FROM_ELEMENTS
    assert not packs(torch.nn.Linear(64, 64))   # the deep-narrow pair's: the dispatch costs more
    assert not packs(torch.nn.Linear(256, 256).to(torch.bfloat16))
    assert not packs(torch.nn.Conv1d(256, 256, 1))


@pytest.mark.parametrize("bias", [False, True])
def test_the_op_is_the_linear_through_either_product_and_the_warm_up_keeps_the_faster(bias):
    """While calibrating, calls alternate between the packed copy and MKL's product (each timed);
    both give F.linear's result to float32 rounding; settle chooses per (rows, shape) by the
    medians, and a shape that chose the packed copy then runs it."""
    layer = Layer(bias=bias)
    owner = PackedLinears([layer], ["proj"])
    weight, x = layer.proj.weight, torch.randn(3, 2, 256)
    expected = F.linear(x, weight, layer.proj.bias)
    with torch.inference_mode():
        for _ in range(2 * packed_linears.MIN_SAMPLES):
            torch.testing.assert_close(packed_linear(x, weight, layer.proj.bias), expected)
    assert owner.calls == packed_linears.MIN_SAMPLES   # every other call packed
    key = (6, 256, 256)   # rows, out, in
    assert [len(owner.samples[key + (p,)]) for p in (True, False)] == [packed_linears.MIN_SAMPLES] * 2
    owner.samples[key + (True,)] = [0.0] * packed_linears.MIN_SAMPLES   # as if packed were faster
    owner.settle("Layer")
    assert owner.chosen == {key: True} and not owner.calibrating
    with torch.inference_mode():
        torch.testing.assert_close(packed_linear(x, weight, layer.proj.bias), expected)
    assert owner.calls == packed_linears.MIN_SAMPLES + 1
    # a weight nobody packed, or another view at the packed one's address: F.linear itself
    other = torch.randn(256, 256)
    assert torch.equal(packed_linear(x, other, None), F.linear(x, other))
    assert torch.equal(packed_linear(x, weight.t(), None), F.linear(x, weight.t()))
    assert owner.calls == packed_linears.MIN_SAMPLES + 1


def test_where_every_shape_chose_mkl_the_copies_go_and_with_their_weight_anyway():
    layer = Layer()
    owner = PackedLinears([layer], ["proj"])
    address = layer.proj.weight.data_ptr()
    assert address in packed_linears._PACKS
    owner.samples[6, 256, 256, True] = [2.0] * packed_linears.MIN_SAMPLES
    owner.samples[6, 256, 256, False] = [1.0] * packed_linears.MIN_SAMPLES
    owner.settle("Layer")
    assert owner.chosen == {(6, 256, 256): False} and address not in packed_linears._PACKS
    assert owner.describe() == "" and owner.bytes == 0
    layer = Layer()   # a weight freed drops its copy: no later weight at its address meets it
    PackedLinears([layer], ["proj"])
    address = layer.proj.weight.data_ptr()
    del layer
    gc.collect()
    assert address not in packed_linears._PACKS


def test_an_inductor_engine_serves_through_packed_linears_exactly_and_compiles_nothing_after_ready(
        pairs, reference, caplog, monkeypatch, fresh_dynamo):
    """The tiny pair's linears (below PACK_FROM_ELEMENTS: the bar lowered here) through the op in
    inductor's graphs: the warm-up timed both products at its row counts and logged them; with
    every shape on the packed copies after READY (no choice counted: MIN_SAMPLES out of reach),
    a ragged schedule compiles nothing and every token is the target-only greedy one."""
    monkeypatch.setattr(packed_linears, "PACK_FROM_ELEMENTS", 0)
    monkeypatch.setattr(packed_linears, "MIN_SAMPLES", 10 ** 9)
    with caplog.at_level(logging.INFO, logger="exspec"):
        engine = make_engine(pairs, "llama", "independent", method="exspec", max_batch_size=2,
                             num_speculative_tokens=3, enforce_eager=False)
    target = engine.runner.decode_forwards[engine.target]
    assert all(type(m) is PackedLinear for m in target.template.modules() if isinstance(m, torch.nn.Linear))
    owner = target.packed_linears
    assert owner.count == len(target.layers) * 7 and not owner.calibrating   # q k v o gate up down
    # the copies' memory, said where an operator sizes the pod: the weights' own size
    assert owner.bytes == sum(m.weight.nbytes for layer in target.layers for m in layer.modules()
                              if type(m) is torch.nn.Linear)
    assert f"layer linears packed by oneDNN ({owner.count} weights, {owner.size()} of copies" in target.describe()
    assert any(f"{owner.size()} of copies" in r.getMessage() for r in caplog.records)
    calls = owner.calls
    prompts, params, outputs, finished = run_compiling_nothing(engine, pairs, caplog, seed=5, count=6,
                                                               last_tick=6, max_tokens=12)
    assert owner.calls > calls
    assert_target_greedy(pairs, reference, prompts, params, outputs, finished)
