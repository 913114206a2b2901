"""The block store read in place (attention_backend "FLEX_ATTENTION", kv/in_place.py): compiled
decode forwards attend over the store's whole buffer through FlexAttention and a BlockMask of
each row's blocks, instead of gathering each row's blocks per layer.

What a decode step allocates must not grow with the context (the gather's copy does), every
greedy token must be the target-only one (sliding windows too, compiled by inductor, where the
BlockMask's block lists decide what the kernel reads), and a configuration that cannot read in
place is refused naming what to change. The randomized serving session runs with it too
(test_compiled_session.py)."""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from exspec import EngineConfig, LLMEngine, SamplingParams
from exspec.demo.tiny import build_tokenizer, llama
from exspec.errors import ModelLoadError
from exspec.models import compiled
from exspec.models.loading import ModelPair

from enginekit import make_engine
from tiny_archs import build, greedy_reference

ROWS = 8
CONTEXTS = (256, 4096)
CHUNK = 256   # prefill tokens a row per forward (the eager prefill's scores grow with it)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()   # each engine's models are new: start from an empty code cache
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    """A tiny Llama whose positions reach past 4,096 tokens, saved with the tiny tokenizer."""
    root = tmp_path_factory.mktemp("long_llama")
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(root / "tokenizer")
    llama(len(tokenizer), seed=1, max_positions=4608).save_pretrained(root / "target")
    return root


def decode_step_bytes(engine: LLMEngine, context: int) -> int:
    """Bytes the CPU allocator hands out during one decode step of ROWS rows of `context`
    tokens each (the target alone, one token a row), as torch's profiler counts them. The rows
    are prefilled in chunks through the engine's runner, then stepped once before the count."""
    runner = engine.runner
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    group = runner.new_group([engine._sequence(f"{context}-{i}", [(7 * i + j) % 90 + 3 for j in range(context)],
                                               params) for i in range(ROWS)])
    for _ in range(0, context, CHUNK):
        runner.prefill(group, [CHUNK] * ROWS)
    runner.step(group, 0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner.step(group, 0)
    assert [len(s.output_ids) for s in group.seqs] == [3] * ROWS
    for kv in group.caches():   # the rows' blocks back to the store
        kv.select([])
    return sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)


def test_reading_in_place_a_decode_step_allocates_alike_at_256_and_4096_tokens(long_llama, monkeypatch):
    """Batch 8, target alone on the block store, inductor: a decode step's allocations at 4,096
    tokens of context are within 10% of those at 256 when the store is read in place, while the
    gather's grow with the context (its copy of every row's blocks per layer)."""
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "inductor")
    allocated = {}
    for backend in ("FLEX_ATTENTION", None):
        engine = LLMEngine(EngineConfig(
            target_model=str(long_llama / "target"), tokenizer=str(long_llama / "tokenizer"),
            method="exspec", num_speculative_tokens=0, max_batch_size=ROWS, max_num_seqs=ROWS,
            enforce_eager=False, enable_prefix_caching=False, attention_backend=backend,
            max_num_kv_tokens=ROWS * (max(CONTEXTS) + 32) + 16))
        allocated[backend] = {c: decode_step_bytes(engine, c) for c in CONTEXTS}
        torch._dynamo.reset()
    flex, gather = allocated["FLEX_ATTENTION"], allocated[None]
    assert abs(flex[4096] - flex[256]) <= 0.1 * flex[256], allocated
    assert gather[4096] > 2 * gather[256], allocated   # what the read in place saves


@pytest.mark.parametrize("model_type,backend", [
    ("qwen3", "eager"),        # q/k norms
    ("phi3", "eager"),         # fused qkv
    # sliding and full layers, each layer type its own BlockMask; inductor's kernel reads only
    # the blocks the masks list, so the windowed lists are checked compiled
    ("gemma3_text", "inductor")])
def test_other_architectures_read_in_place_exactly(model_type, backend, monkeypatch):
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", backend)
    config = {"layer_types": ["sliding_attention", "full_attention"]} if model_type == "gemma3_text" else {}
    target, draft = build(model_type, **config)
    engine = LLMEngine(EngineConfig(target_model=model_type, draft_model=model_type, method="exspec",
                                    num_speculative_tokens=1 if backend == "inductor" else 3,
                                    max_batch_size=4, adaptive_k=False, enforce_eager=False,
                                    attention_backend="FLEX_ATTENTION", max_num_kv_tokens=4096),
                       pair=ModelPair(build_tokenizer(), target, draft, set(), 256))
    before = compiled.dynamo_counts()
    prompts = [[5, 9, 17, 33, 2], [40], [7, 8, 9, 10, 11, 12, 13, 14, 15] * 3, [100, 3]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12))
    for i, (out, p) in enumerate(zip(outs, prompts)):
        assert out.token_ids == greedy_reference(target, p, 12), f"{model_type} row {i}"
    assert compiled.dynamo_counts() == before, f"{model_type}: compiled after the warm-up"


@pytest.mark.parametrize("changes,named", [
    (dict(attention_backend="FLASH_ATTN"), "attention_backend must be 'FLEX_ATTENTION'"),
    (dict(enforce_eager=True), "enforce_eager false"),
    (dict(max_num_kv_tokens=None), "max_num_kv_tokens on cpu"),
    (dict(method="eqspec"), "method exspec")])
def test_a_configuration_that_cannot_read_in_place_is_refused_naming_it(changes, named):
    values = dict(target_model="t", draft_model="d", method="exspec", enforce_eager=False,
                  attention_backend="FLEX_ATTENTION", max_num_kv_tokens=4096)
    values.update(changes)
    with pytest.raises(ValueError, match=named):
        EngineConfig(**values)


def test_a_model_whose_attention_flex_cannot_compute_is_refused_at_load():
    """Soft-capped attention logits (Gemma 2) would need a score_mod: refused, not served
    differently."""
    target, draft = build("gemma2")
    with pytest.raises(ModelLoadError, match="soft-capped"):
        LLMEngine(EngineConfig(target_model="gemma2", draft_model="gemma2", method="exspec",
                               num_speculative_tokens=2, enforce_eager=False,
                               attention_backend="FLEX_ATTENTION", max_num_kv_tokens=4096),
                  pair=ModelPair(build_tokenizer(), target, draft, set(), 256))


def test_engines_sharing_a_model_each_run_their_own_compiled_forward(pairs, reference, monkeypatch):
    """A gathering engine and one reading in place on the same weights (the benchmark's
    cells): each compiled forward installs itself on the shared layers, and each engine's steps
    run its own regions (before, the second took the layers over and the first ran eagerly),
    both exact."""
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")   # which forward runs, not its kernels
    ran = []
    run_region = compiled.CompiledForward.run_region
    monkeypatch.setattr(compiled.CompiledForward, "run_region",
                        lambda self, *args: ran.append(self) or run_region(self, *args))
    gather = make_engine(pairs, "llama", "noisy", method="exspec", num_speculative_tokens=2,
                         max_batch_size=2, enforce_eager=False, max_num_kv_tokens=4096)
    flex = LLMEngine(EngineConfig(**{**vars(gather.config), "attention_backend": "FLEX_ATTENTION"}),
                     pair=gather.pair)
    prompt = [5, 9, 17, 33, 2]
    for engine in (gather, flex, gather):
        ran.clear()
        out = engine.generate([prompt], SamplingParams(max_tokens=8))[0]
        assert out.token_ids == reference(pairs["llama", "target"], prompt, 8)
        assert set(ran) == set(engine.runner.decode_forwards.values()), "ran another engine's forwards"


def test_after_the_warm_up_every_width_at_every_row_count_compiles_nothing(pairs, monkeypatch):
    """Both models, every verification width 2 .. k + 1 at 2 .. max_batch_size rows, as new
    rows after READY: no graph compiles. Two ways this failed (seen in CI as "3 rows, 4 tokens"
    compiled after READY): a width the warm-up first met at 2 rows (the draft's catch-up) kept
    a 2-row graph, and positions read from a step's upload (a view with a storage offset, which
    Dynamo guards) built a graph that a new tensor's offset of 0 missed."""
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    engine = make_engine(pairs, "llama", "noisy", method="exspec", max_batch_size=4, max_num_seqs=6,
                         num_speculative_tokens=4, enforce_eager=False,
                         attention_backend="FLEX_ATTENTION", max_num_kv_tokens=2 * 6 * 256)
    runner, compiled_after = engine.runner, []
    for model in (engine.target, engine.proposer.models[0]):
        forward = runner.decode_forwards[model]
        slots = runner.kv_layout.store(model).num_blocks * 16
        for rows in (2, 3, 4):
            for width in (2, 3, 4, 5):
                before = compiled.dynamo_counts()["graphs"]
                compiled._shape_forward(runner, model, forward, (rows, width, slots))
                if compiled.dynamo_counts()["graphs"] != before:
                    compiled_after.append((type(model).__name__, model is engine.target, rows, width))
    assert not compiled_after
