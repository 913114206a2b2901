"""The compiled decode path (enforce_eager = false, compiled.py): exact tokens, and nothing
recompiles or breaks the graph after the warm-up.

Dynamo's guards (hence recompiles and graph breaks) do not depend on the compile backend, so
these tests compile with the "eager" backend: no C++ is generated in CI. The inductor backend
is exercised by exspec-bench --paths eager,compiled.
"""
import copy
import logging
import random

import pytest
import torch

from exspec import EngineConfig, LLMEngine, SamplingParams
from exspec.models import compiled
from exspec.demo.tiny import build_tokenizer
from exspec.models.loading import ModelPair
from exspec.engine.adaptive_k import AdaptiveK

from enginekit import _load, make_engine, make_prompts, run_schedule
from tiny_archs import build, greedy_reference

MIN_GAP = 1e-4   # below it a reference token is a float tie, and a flip would be no bug


@pytest.fixture(autouse=True)
def eager_backend(monkeypatch):
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()   # each engine's models are new: start from an empty code cache
    yield
    torch._dynamo.reset()


def assert_no_ties(target_path, prompts, references):
    """The reference's top-2 logit gap exceeds MIN_GAP at every generated position, so exact
    equality is the right bar (a tie flip cannot make the test flaky)."""
    model = _load(target_path)
    for prompt, ref in zip(prompts, references):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ref])).logits[0]
        top = logits[len(prompt) - 1:len(prompt) - 1 + len(ref)].topk(2).values
        gaps = (top[:, 0] - top[:, 1]).tolist()
        assert min(gaps) > MIN_GAP, f"prompt {prompt[:5]}...: reference tie (gap {min(gaps):.2e})"


def pairwise(cases, in_ci):
    """Every case; those not in `in_ci` run only under -m slow (make test-slow)."""
    return [c if c in in_ci else pytest.param(*c, marks=pytest.mark.slow) for c in cases]


MATRIX = [(arch, batch, k, method) for arch in ("llama", "gpt2") for batch in (1, 3)
          for k in (1, 3) for method in ("exspec", "eqspec")]
# In CI a pairwise cover (every pair of values of any two dimensions, in 5 of the 16 cases)
IN_CI = {("llama", 1, 1, "exspec"), ("llama", 3, 3, "eqspec"), ("gpt2", 1, 3, "eqspec"),
         ("gpt2", 3, 1, "eqspec"), ("gpt2", 3, 3, "exspec")}


def compiled_outputs(pairs, arch, batch, k, method, prompts, max_tokens, engine_out=None, **config):
    engine = make_engine(pairs, arch, "noisy", method=method, max_batch_size=batch,
                         num_speculative_tokens=k, enforce_eager=False, **config)
    assert engine.warm_up is not None and engine.warm_up.graphs > 0, "nothing was compiled"
    if engine_out is not None:
        engine_out.append(engine)
    return engine.generate(prompts, SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize("arch, batch, k, method", pairwise(MATRIX, IN_CI))
def test_compiled_path_matches_target_greedy(pairs, reference, arch, batch, k, method):
    prompts = [p for p in make_prompts(320, pairs[arch, "eos"], seed=31, count=6) if len(p) > 1]
    refs = [reference(pairs[arch, "target"], p, 16) for p in prompts]
    assert_no_ties(pairs[arch, "target"], prompts, refs)
    outs = compiled_outputs(pairs, arch, batch, k, method, prompts, 16)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.error is None, out.error
        assert out.token_ids == ref, (f"{arch} {method} B={batch} k={k} row {i}: got "
                                      f"{out.token_ids}, expected {ref}")


def test_compiled_rounds_stopped_at_an_unsure_draft_match_target_greedy(pairs, reference, monkeypatch):
    """Adaptive k's confidence stop on the compiled path: shorter rounds, the same tokens."""
    monkeypatch.setattr(AdaptiveK, "choose", lambda self, group, cap, *rest: cap)
    prompts = [p for p in make_prompts(320, pairs["gpt2", "eos"], seed=31, count=6) if len(p) > 1]
    refs = [reference(pairs["gpt2", "target"], p, 16) for p in prompts]
    assert_no_ties(pairs["gpt2", "target"], prompts, refs)
    engines = []
    outs = compiled_outputs(pairs, "gpt2", 3, 3, "exspec", prompts, 16, engines,
                            adaptive_k=True, draft_stop_confidence=0.2)
    assert [o.token_ids for o in outs] == refs
    stats = engines[0].stats()
    ks = {s["k"] for s in stats["steps_by_shape"]}
    assert stats["draft_stopped_steps"] > 0 and 3 in ks and ks - {3}, stats["steps_by_shape"]


def test_broken_compiled_forward_fails_equivalence(pairs, reference, monkeypatch):
    """Negative control: a compiled forward fed positions shifted by one must be caught (and so
    the compiled forwards are really the ones that ran)."""
    call = compiled.CompiledForward.__call__

    def shifted(self, **inputs):
        return call(self, **{**inputs, "position_ids": inputs["position_ids"] + 1})
    monkeypatch.setattr(compiled.CompiledForward, "__call__", shifted)
    prompts = [p for p in make_prompts(320, pairs["gpt2", "eos"], seed=31, count=6) if len(p) > 1]
    outs = compiled_outputs(pairs, "gpt2", 3, 3, "exspec", prompts, 16)
    assert any(out.token_ids != reference(pairs["gpt2", "target"], p, 16)
               for out, p in zip(outs, prompts)), "a broken compiled forward went unnoticed"


def ragged_schedule(eos: int, seed: int, count: int, last_tick: int, max_tokens: int, aborted: int):
    """Greedy requests (prompts of 2+ tokens) arriving at random ticks up to last_tick, each
    with its own max_tokens (4 .. max_tokens) and k cap; every 4th (from `aborted`) aborted 1-4
    ticks after it arrived. Returns prompts, arrivals, aborts, params (run_schedule's)."""
    rng = random.Random(seed)
    prompts = [p for p in make_prompts(320, eos, seed=8, count=count) if len(p) > 1]
    arrivals, aborts, params = {}, {}, {}
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        tick = rng.randint(0, last_tick)
        arrivals.setdefault(tick, []).append((rid, p))
        params[rid] = SamplingParams(max_tokens=rng.randint(4, max_tokens),
                                     num_speculative_tokens=rng.choice([None, 1, 2]))
        if i % 4 == aborted:
            aborts.setdefault(tick + rng.randint(1, 4), []).append(rid)
    return prompts, arrivals, aborts, params


@pytest.mark.parametrize("method", ["exspec", "eqspec"])
def test_no_recompile_or_graph_break_after_warm_up(pairs, method, caplog):
    """A mixed run after the warm-up: arrivals, aborts, ragged acceptance, adaptive k moving
    (down to plain steps and back, with draft catch-ups), per-request k caps and rows leaving.
    Dynamo's own counters must not move."""
    engine = make_engine(pairs, "llama", "independent", method=method, max_batch_size=4,
                         max_num_seqs=6, adaptive_k=True, num_speculative_tokens=4,
                         enforce_eager=False)
    assert engine.warm_up.graph_breaks == 0, "the warm-up itself broke a graph"
    before = compiled.dynamo_counts()
    _, arrivals, aborts, params = ragged_schedule(pairs["llama", "eos"], 5, count=14, last_tick=20,
                                                  max_tokens=30, aborted=0)
    with caplog.at_level(logging.WARNING, logger="exspec"):
        run_schedule(engine, arrivals, aborts, params)
    ks = {shape["k"] for shape in engine.stats()["steps_by_shape"]}
    assert len(ks) >= 2, f"k never changed ({ks}): the run does not exercise it"
    assert compiled.dynamo_counts() == before, (
        f"after warm-up: {before} -> {compiled.dynamo_counts()} (graphs = compiles)")
    assert not [r.getMessage() for r in caplog.records if NEW_SHAPE in r.getMessage()]


NEW_SHAPE = "met a shape after the warm-up"


def test_a_shape_the_warm_up_missed_compiles_and_says_so_in_the_log(pairs, reference, monkeypatch, caplog):
    """Negative control of the warm-up's coverage: warmed up at one row only, the first step of
    three rows compiles the many-row graphs then, and the log says so, once per shape, with
    the tokens still exact."""
    monkeypatch.setattr(compiled, "WARM_UP_ROWS", (1,))
    # the target alone: half the compiling of a pair, the same warm-up and forwards
    engine = make_engine(pairs, "llama", "noisy", method="autoregressive", max_batch_size=3,
                         enforce_eager=False)
    before = compiled.dynamo_counts()
    prompts = [[5, 9, 17, 33, 2], [40, 41], [7, 8, 9, 10, 11, 12]]
    with caplog.at_level(logging.WARNING, logger="exspec"):
        outs = engine.generate(prompts, SamplingParams(max_tokens=8))
    assert compiled.dynamo_counts()["graphs"] > before["graphs"], "nothing compiled after the warm-up"
    logged = [r.getMessage() for r in caplog.records if r.name == "exspec"]
    lines = [line for line in logged if NEW_SHAPE in line]
    assert lines and all("3 rows" in line and "compiled" in line for line in lines), logged
    assert len(lines) == len(set(lines)), f"a shape logged twice: {lines}"
    for out, p in zip(outs, prompts):
        assert out.token_ids == reference(pairs["llama", "target"], p, 8)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_decoder_layers_share_one_compiled_region(pairs, arch):
    """Regional compilation: every decoder layer of a model runs the one compiled function, so a
    3-layer draft of other shapes adds the same one graph (EXSPEC: every row count, one-token
    forwards fed as two) as the 2-layer target; a graph per layer (a layer index reaching the
    graph) would make it 1 + 3, and one per row count 2 + 6."""
    engine = make_engine(pairs, arch, "othershape", method="exspec", max_batch_size=2,
                         num_speculative_tokens=2, enforce_eager=False)
    forwards = [engine.runner.decode_forwards[m] for m in (engine.target, engine.draft)]
    assert all(f.regional for f in forwards), engine.warm_up.compiled
    assert engine.warm_up.graphs <= 2, f"{engine.warm_up.graphs} graphs: layers did not share one"


def test_layers_sharing_one_cache_layer_fail_equivalence(pairs, reference, monkeypatch):
    """Negative control inside the compiled regions: every layer handed layer 0's cache must be
    caught (and so the regions, not the eager layers, ran the decode forwards)."""
    monkeypatch.setattr(compiled._Region, "_own",
                        staticmethod(lambda value, index: compiled.LayerCache(value, 0)
                                     if isinstance(value, compiled.Cache) else value))
    prompts = [p for p in make_prompts(320, pairs["llama", "eos"], seed=31, count=6) if len(p) > 1]
    outs = compiled_outputs(pairs, "llama", 3, 3, "exspec", prompts, 16)
    assert any(out.token_ids != reference(pairs["llama", "target"], p, 16)
               for out, p in zip(outs, prompts)), "layers sharing a cache layer went unnoticed"


def test_whole_model_fallback_matches_target_greedy(pairs, reference, monkeypatch):
    """A model in which no repeated decoder layers are found compiles whole, and stays exact."""
    monkeypatch.setattr(compiled, "decoder_layers", lambda model: None)
    prompts = [p for p in make_prompts(320, pairs["gpt2", "eos"], seed=31, count=6) if len(p) > 1]
    engine = make_engine(pairs, "gpt2", "noisy", method="eqspec", max_batch_size=3,
                         num_speculative_tokens=3, enforce_eager=False)
    assert not engine.runner.decode_forwards[engine.target].regional, engine.warm_up.compiled
    assert "whole model" in engine.warm_up.describe()
    outs = engine.generate(prompts, SamplingParams(max_tokens=16))
    for i, (out, p) in enumerate(zip(outs, prompts)):
        assert out.token_ids == reference(pairs["gpt2", "target"], p, 16), f"row {i}"


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text", "phi3"])
def test_compiled_path_on_other_architectures(model_type):
    """Other layer codes (q/k norms, sliding and full layers of one class, fused qkv) compile
    regionally, recompile nothing after the warm-up and stay exact."""
    target, draft = build(model_type)
    engine = LLMEngine(EngineConfig(target_model=model_type, draft_model=model_type,
                                    method="exspec", num_speculative_tokens=3, max_batch_size=4,
                                    adaptive_k=False, enforce_eager=False),
                       pair=ModelPair(build_tokenizer(), target, draft, set(), 256))
    assert all(f.regional for f in engine.runner.decode_forwards.values()), engine.warm_up.compiled
    before = compiled.dynamo_counts()
    prompts = [[5, 9, 17, 33, 2], [40], [7, 8, 9, 10, 11, 12, 13, 14, 15], [100, 3]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=8))
    for i, (out, p) in enumerate(zip(outs, prompts)):
        assert out.token_ids == greedy_reference(target, p, 8), f"{model_type} row {i}"
    assert compiled.dynamo_counts() == before, f"{model_type}: recompiled after the warm-up"


DEEP = 12   # layers: past compiled.SHALLOW, so regions run several layers each


def deep_engine(model_type: str, method: str, **config):
    target, draft = build(model_type, num_hidden_layers=DEEP, **config)
    engine = LLMEngine(EngineConfig(target_model=model_type, draft_model=model_type, method=method,
                                    num_speculative_tokens=3, max_batch_size=3, adaptive_k=False,
                                    enforce_eager=False),
                       pair=ModelPair(build_tokenizer(), target, draft, set(), 256))
    return engine, target


DEEP_PROMPTS = [[5, 9, 17, 33, 2], [40], [7, 8, 9, 10, 11, 12, 13, 14, 15], [100, 3], [61, 62]]


@pytest.mark.parametrize("method", ["exspec", "eqspec"])
def test_regions_of_several_layers_match_target_greedy(method):
    """A 12-layer model runs 3 layers per compiled region (the smallest divisor of its depth
    that keeps a forward to MAX_REGIONS = 4 calls): exact, nothing recompiles after warm-up."""
    engine, target = deep_engine("llama", method)
    forwards = list(engine.runner.decode_forwards.values())
    assert [f.layers_per_region for f in forwards] == [3, 3], engine.warm_up.describe()
    before = compiled.dynamo_counts()
    outs = engine.generate(DEEP_PROMPTS, SamplingParams(max_tokens=10))
    for i, (out, p) in enumerate(zip(outs, DEEP_PROMPTS)):
        assert out.token_ids == greedy_reference(target, p, 10), f"{method} row {i}"
    assert compiled.dynamo_counts() == before, "recompiled after the warm-up"


_TORCH_COMPILE = torch.compile


def _module_guards_per_graph(monkeypatch) -> list[int]:
    """Every graph the engine compiles from here on: how many of the guards it keeps check an
    nn.Module's attributes (Dynamo evaluates them all before each call)."""
    counts = []

    def with_counter(fn=None, **kwargs):
        options = dict(kwargs.get("options") or {})
        keeps = options.get("guard_filter_fn") or (lambda entries: [True] * len(entries))

        def counting(entries):
            kept = keeps(entries)
            counts.append(sum(k and e.orig_guard.source.is_unspecialized_nn_module()
                              for e, k in zip(entries, kept)))
            return kept
        kwargs["options"] = {**options, "guard_filter_fn": counting}
        return _TORCH_COMPILE(fn, **kwargs)
    monkeypatch.setattr(compiled.torch, "compile", with_counter)
    return counts


def test_regions_guard_no_module_attributes(monkeypatch):
    """A region is handed its layers' tensors and one template layer, not its layer modules, and
    the template's attributes are not guarded (nothing changes it): Dynamo checks none of the
    module attributes it checked before each call when handed the modules (515 a graph for 3
    layers here, ~2,900 on the deep-narrow pair, with reading each weight through its module
    ~0.6 ms a region call)."""
    counts = _module_guards_per_graph(monkeypatch)
    engine, _ = deep_engine("llama", "exspec")
    assert engine.runner.decode_forwards[engine.target].layers_per_region == 3
    assert counts and max(counts) == 0, counts


@pytest.mark.parametrize("shared_code", [False, True])
def test_a_draft_of_the_targets_shapes_never_runs_the_targets_graphs(shared_code, monkeypatch):
    """Models of the very same shapes whose layers differ in a constant (the draft is the target
    but for its norms' eps, 0.5): each model's regions have a code object of their own, so each
    compiles its own graph (EXSPEC: one for every row count), and the draft never runs the
    target's, which no guard on the (unguarded) template would stop. Negative control: one code
    object for both, and one model runs the other's graph, whose eps is a constant of it (the
    warm-up compiles with floats specialised): the draft compiles first, so the target runs
    with the draft's eps and its output changes."""
    if shared_code:
        monkeypatch.setattr(compiled, "_own_code", lambda fn, name=None: fn)
    torch._dynamo.reset()
    before = compiled.dynamo_counts()["graphs"]
    target, _ = build("llama", num_hidden_layers=DEEP)
    draft = copy.deepcopy(target)
    for module in draft.modules():
        if hasattr(module, "variance_epsilon"):
            module.variance_epsilon = 0.5
    engine = LLMEngine(EngineConfig(target_model="llama", draft_model="llama", method="exspec",
                                    num_speculative_tokens=3, max_batch_size=3, adaptive_k=False,
                                    enforce_eager=False),
                       pair=ModelPair(build_tokenizer(), target, draft, set(), 256))
    outs = engine.generate(DEEP_PROMPTS, SamplingParams(max_tokens=10))
    exact = [out.token_ids == greedy_reference(target, p, 10) for out, p in zip(outs, DEEP_PROMPTS)]
    if shared_code:
        assert not all(exact), "the target ran the draft's graph and nothing changed"
    else:
        assert all(exact), exact
    graphs = compiled.dynamo_counts()["graphs"] - before
    assert graphs == (1 if shared_code else 2), engine.warm_up.describe()


def test_region_layers_fed_the_region_input_fail_equivalence(monkeypatch):
    """Negative control: a region whose later layers get the region's input instead of the
    previous layer's output must be caught (so a region really runs all its layers)."""
    def unchained(template, names, tensors, caches, args, kwargs):
        out = None
        for j, cache in enumerate(caches):
            own = dict(zip(names, tensors[j * len(names):(j + 1) * len(names)]))
            out = torch.func.functional_call(
                template, own, tuple(cache if isinstance(a, compiled.Cache) else a for a in args),
                {n: cache if isinstance(v, compiled.Cache) else v for n, v in kwargs.items()})
        return out, ()
    monkeypatch.setattr(compiled, "_run_layers", unchained)
    engine, target = deep_engine("llama", "exspec")
    assert engine.runner.decode_forwards[engine.target].layers_per_region == 3
    outs = engine.generate(DEEP_PROMPTS, SamplingParams(max_tokens=10))
    assert any(out.token_ids != greedy_reference(target, p, 10)
               for out, p in zip(outs, DEEP_PROMPTS)), "unchained region layers went unnoticed"


def test_layers_given_their_own_masks_run_one_per_region():
    """Sliding and full layers get their own masks: the probe sees layers given different
    arguments, so each region keeps one layer, and the output stays exact."""
    pattern = (["sliding_attention"] * 2 + ["full_attention"]) * (DEEP // 3)
    engine, target = deep_engine("gemma3_text", "exspec", layer_types=pattern, sliding_window=4)
    forward = engine.runner.decode_forwards[engine.target]
    assert forward.layers_per_region == 1, forward.describe()
    assert "different arguments" in forward.describe()
    outs = engine.generate(DEEP_PROMPTS, SamplingParams(max_tokens=10))
    for i, (out, p) in enumerate(zip(outs, DEEP_PROMPTS)):
        assert out.token_ids == greedy_reference(target, p, 10), f"row {i}"


def test_the_target_alone_compiles_nothing_after_warm_up_at_one_row(pairs, reference, caplog):
    """k = 0 (the target alone): the warm-up's first forward is the eager region probe, so a
    warm-up of one step per row count left the 1-row graph to the first request (seen on a GPU
    as "1 rows, 1 tokens" compiled after the server was ready)."""
    engine = make_engine(pairs, "llama", "noisy", method="autoregressive", max_batch_size=2,
                         enforce_eager=False)
    before = compiled.dynamo_counts()
    prompt = [5, 9, 17, 33, 2]
    with caplog.at_level(logging.WARNING, logger="exspec"):
        out = engine.generate([prompt], SamplingParams(max_tokens=8))[0]
    assert compiled.dynamo_counts() == before, f"after warm-up: {before} -> {compiled.dynamo_counts()}"
    assert not [r.getMessage() for r in caplog.records if NEW_SHAPE in r.getMessage()]
    assert out.token_ids == reference(pairs["llama", "target"], prompt, 8)


def test_the_lm_head_is_packed_on_the_compiled_path_only(pairs):
    """On a CPU the compiled path runs the lm_head through weights oneDNN packed for small
    batches (packed_head.py): logits within float32 rounding of the plain head's at every row
    count, and the plain head (bit for bit) whenever the compiled forward is not running."""
    from exspec.models.packed_head import PackedHead
    engine = make_engine(pairs, "llama", "noisy", method="exspec", max_batch_size=2,
                         num_speculative_tokens=3, enforce_eager=False)
    forward = engine.runner.decode_forwards[engine.target]
    assert forward.packed_head and "lm_head packed" in forward.describe(), forward.describe()
    head = engine.target.get_output_embeddings()
    packed = vars(head)["forward"]
    assert isinstance(packed, PackedHead)
    calls = packed.calls
    engine.generate([[5, 9, 17, 33, 2]], SamplingParams(max_tokens=6))
    assert packed.calls > calls, "the compiled steps did not go through the packed head"
    with torch.inference_mode():
        for rows in (1, 2, 5, 9):
            hidden = torch.randn(1, rows, head.in_features)
            plain = torch.nn.functional.linear(hidden, head.weight)
            assert torch.equal(head(hidden), plain)   # not active: Hugging Face's own forward
            forward.active = True
            try:
                got = head(hidden)
            finally:
                forward.active = False
            assert got.shape == plain.shape
            assert torch.allclose(got, plain, rtol=1e-5, atol=1e-5), (rows, (got - plain).abs().max())


@pytest.mark.parametrize("static", [False, True])
def test_forwards_gather_the_longest_rows_blocks_unless_graphs_are_per_shape(pairs, reference, monkeypatch,
                                                                              static):
    """Inductor's graphs on a CPU are symbolic in the KV width, so a compiled forward gathers
    the longest row's blocks (a power-of-two bucket gathered up to twice that: suffix decoding's
    plain steps at B = 8 ran 3% slower); where graphs are per concrete shape (CUDA graphs' rule,
    compiled.STATIC_SHAPES here) tables come in powers of two, every one built in the warm-up.
    Either way nothing compiles after it and the tokens are target-only greedy."""
    from exspec.kv.blocks import BlockKV
    monkeypatch.setattr(compiled, "STATIC_SHAPES", static)
    engine = make_engine(pairs, "llama", "noisy", method="exspec", max_batch_size=2, max_model_len=128,
                         adaptive_k=False, num_speculative_tokens=2, enforce_eager=False)
    assert engine.runner.kv_layout.bucketed == static
    widths, table = [], BlockKV.host_table
    monkeypatch.setattr(BlockKV, "host_table", lambda kv: widths.append(len(table(kv)[0])) or table(kv))
    before = compiled.dynamo_counts()
    # a lone short row first (one block: a table of width 1, which the warm-up's rows never
    # had), then two rows, the longer of 37 to 69 tokens: 3 to 5 blocks
    runs = [([[7, 3, 9]], 10), ([[5 + i % 40 for i in range(37)], [7, 3, 9]], 30)]
    for prompts, max_tokens in runs:
        outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
        for out, prompt in zip(outs, prompts):
            assert out.token_ids == reference(pairs["llama", "target"], prompt, max_tokens)
    assert compiled.dynamo_counts() == before, f"after warm-up: {before} -> {compiled.dynamo_counts()}"
    # gathered as they are, or in the buckets 2, 4 and 8
    assert set(widths) == ({2, 4, 8} if static else {1, 3, 4, 5}), widths
