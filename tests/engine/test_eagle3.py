"""EAGLE-3 heads (models/eagle3.py, spec/eagle3.py) beyond the conformance suite's equality
(test_proposers.py runs the battery): the head drafts what its training computes, from the
features of the right positions, in both layouts, eager and compiled; a compiled region of several
layers hands the head the true layer inputs; checkpoints load in vLLM's layout variants, and a
head made for another target is refused with both sides named."""
from __future__ import annotations

import itertools
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from exspec import EngineConfig, LLMEngine, SamplingParams
from exspec.demo.tiny import build_tokenizer, llama
from exspec.engine.adaptive_k import AdaptiveK
from exspec.errors import ModelLoadError
from exspec.models import compiled
from exspec.models.compiled import CompiledForward
from exspec.models.eagle3 import default_layer_ids, head_for, load_head, save_head
from exspec.models.eagle3_training import shifted_features, unrolled
from exspec.models.layer_inputs import LayerInputs
from exspec.vllm_args import translate

from eagle3kit import first_drafts, train_head
from enginekit import make_prompts

VOCAB = 320


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A 12-layer target (compiled regions of 3 layers) and a head trained for it."""
    root = tmp_path_factory.mktemp("eagle3")
    target = llama(VOCAB, seed=5, layers=12, hidden=64, heads=4, kv_heads=2, max_positions=256)
    target.generation_config.eos_token_id = None
    target.save_pretrained(root / "target")
    build_tokenizer().save_pretrained(root / "target")
    prompts = make_prompts(VOCAB, None, seed=21, count=12)
    head = train_head(str(root / "target"), str(root / "head"), default_layer_ids(12), prompts,
                      draft_size=160, batches=200)
    return root, target, head, prompts


def _random_head(target, ids=(0, 2, 3), draft_ids=None):
    torch.manual_seed(3)
    head = head_for(target, ids, draft_ids=draft_ids).eval()
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() >= 2 and name != "embed_tokens.weight":
                p.normal_(0, 0.2)
    return head


def test_the_heads_feature_buffer_keeps_each_rows_features_in_order_through_any_steps():
    """Drafted steps (keep_verified), steps the head did not draft (extend_verified: a hybrid's
    all-suffix steps), plain steps (append), realignment and dropped rows, in random order and
    long runs: the buffer read holds, right-aligned, exactly each row's features not yet taken
    (a list per row, the model it must match)."""
    from exspec.kv.padded import PaddedKV
    from exspec.spec.eagle3 import HeadState

    rng, model = torch.Generator().manual_seed(7), llama(VOCAB, seed=1)
    hidden = model.config.hidden_size
    state = HeadState.empty(PaddedKV.empty(model, 4, "cpu"), model, 4, "cpu")
    rows = [[torch.zeros(hidden)] for _ in range(4)]   # the model: each row's features in order
    serial = itertools.count(1)

    def verified(width):   # distinct features, so any misplaced one shows
        return torch.tensor([[[next(serial)] * hidden for _ in range(width + 1)] for _ in rows],
                            dtype=torch.float32)

    for step in range(300):
        batch, op = len(rows), torch.randint(0, 10, (1,), generator=rng).item()
        width = torch.randint(0, 5, (1,), generator=rng).item()
        accepted = torch.randint(0, width + 1, (batch,), generator=rng).tolist()
        if op < 2:
            features = verified(width)
            state.keep_verified(features, width, torch.tensor(accepted), accepted)
            rows = [list(features[i, :a + 1]) for i, a in enumerate(accepted)]
        elif op < 6:
            features = verified(width)
            state.extend_verified(features, torch.tensor(accepted), accepted)
            rows = [r + list(features[i, :a + 1]) for i, (r, a) in enumerate(zip(rows, accepted))]
        elif op < 8:
            features = verified(0)
            state.append(features)
            rows = [r + [features[i, 0]] for i, r in enumerate(rows)]
        elif op == 8:
            state.compact()
        elif batch > 1:
            keep = sorted(torch.randperm(batch, generator=rng)[:batch - 1].tolist())
            state.select(keep)
            rows = [rows[i] for i in keep]
        if step % 3 == 0 or op == 9:   # read now and then: reading joins what is pending
            joined = state.joined()
            assert state.counts == [len(r) for r in rows]
            assert joined.shape[1] >= max(state.counts)
            for i, r in enumerate(rows):
                assert torch.equal(joined[i, joined.shape[1] - len(r):], torch.stack(r)), (step, i)


def test_unrolled_training_steps_are_the_heads_own_drafting():
    """Training-time test's step 0 is the head's forward over all entries, and step j at base
    entry e is what the head drafts j tokens after e with its cache (true entries 0 .. e, then
    its own provisional ones): training and serving compute the same thing."""
    target = llama(VOCAB, seed=1, layers=4, hidden=64)
    head = _random_head(target, draft_ids=list(range(0, VOCAB, 2)))
    tokens = torch.randint(1, VOCAB, (2, 12))
    with torch.no_grad():
        features = shifted_features(head, torch.randn(2, 12, 3 * 64))
        steps = [head.target_logits(x) for x in unrolled(head, tokens, features, 3)]
        whole = head(input_ids=tokens, position_ids=torch.arange(12).expand(2, -1), features=features)
        torch.testing.assert_close(whole.logits, steps[0], atol=1e-5, rtol=1e-5)
        base = 6
        cache = DynamicCache(config=head.config)
        out = head(input_ids=tokens[:, :base + 1], position_ids=torch.arange(base + 1).expand(2, -1),
                   features=features[:, :base + 1], cache=cache, use_cache=True)
        for j in (1, 2):
            out = head(input_ids=tokens[:, base + j:base + j + 1], position_ids=torch.full((2, 1), base + j),
                       features=out.hidden[:, -1:], cache=cache, use_cache=True)
            torch.testing.assert_close(out.logits[:, 0], steps[j][:, base], atol=1e-5, rtol=1e-5)
    # a draft outside the reduced vocabulary is never proposed
    assert torch.isinf(steps[0][..., 1::2]).all() and not torch.isinf(steps[0][..., 0::2]).any()


@pytest.mark.parametrize("method,path", [
    ("eqspec", "eager"), ("eqspec", "compiled"), ("exspec", "eager"), ("exspec", "compiled"),
    ("exspec", "in_place")])   # the block store read in place (kv/in_place.py)
def test_the_engine_drafts_what_the_head_computes_offline(deep, monkeypatch, method, path):
    """At k = 1 a step's one draft is the head's step-0 prediction at the pending token: the
    engine keeps exactly the drafts the offline one-pass computation (the training code, on the
    whole finished sequence) agrees with the target on. A feature taken from the wrong position,
    or a layer input from the wrong layer, would still be exact, and this count would differ."""
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    root, _, head_dir, prompts = deep
    in_place = dict(attention_backend="FLEX_ATTENTION", max_num_kv_tokens=8192) if path == "in_place" else {}
    engine = LLMEngine(EngineConfig(target_model=str(root / "target"), draft_model=head_dir,
                                    proposer="eagle3", method=method, num_speculative_tokens=1,
                                    adaptive_k=False, max_batch_size=1,
                                    enforce_eager=path == "eager", **in_place))
    assert all(f.in_place == (path == "in_place") for f in engine.runner.decode_forwards.values())
    prompts = prompts[:6]
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    target = engine.target
    head = load_head(head_dir, target, torch.float32, "cpu")
    kept = drafted = 0
    for prompt, out in zip(prompts, outs):
        sequence = prompt + out.token_ids
        drafts = first_drafts(target, head, sequence)
        n = len(prompt) + 1   # the first token comes with the prefill
        while n < len(sequence):   # the pending token is n - 1, its draft is for n
            drafted += 1
            hit = drafts[n - 1] == sequence[n]
            kept += hit
            n += 2 if hit else 1
    stats = engine.stats()
    assert stats["draft_tokens"] == drafted
    assert stats["accepted_tokens"] == kept
    assert stats["drafts_by_depth"] == [{"depth": 1, "verified": drafted, "kept": kept}]
    assert stats["draft_forwards"] == drafted   # one head forward per draft at B = 1
    assert 0 < kept < drafted


@pytest.mark.parametrize("method, compiled_path, static", [
    ("eqspec", False, False), ("exspec", False, False), ("exspec", True, False),
    ("exspec", True, True)])   # static shapes: CUDA graphs' rule (compiled.STATIC_SHAPES)
def test_every_first_draft_is_the_offline_one_through_arrivals_plain_steps_and_ragged_rows(
        deep, monkeypatch, method, compiled_path, static):
    """The hard case of the test above: four rows at a time, requests arriving tick by tick,
    adaptive k (plain steps between speculative ones, whose features the head takes later in one
    ragged forward), rows keeping different numbers of drafts, groups merging and realigning.
    Every step's first draft of every row must still be the head's offline prediction at that
    row's pending token: a feature buffer that lost, doubled or shifted a position would not."""
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(compiled, "STATIC_SHAPES", static)
    # adaptive k's choices from a fixed cycle, not from this machine's step costs (on a CPU
    # where widths cost more it ran plain nearly throughout): every width, plain steps between,
    # and a run of k + 2 plain steps, whose catch-up is wider than k + 1 whatever was accepted
    # before it (a full k = 3 step then a plain one, the only other such catch-up, depends on the
    # drafts' acceptance, which an AMD EPYC's rounding never gave)
    cycle = itertools.cycle([3, 0, 1, 0, 0, 0, 0, 0, 2, 3, 1])
    monkeypatch.setattr(AdaptiveK, "choose", lambda self, group, cap, per_step=False: min(next(cycle), cap))
    root, _, head_dir, prompts = deep
    engine = LLMEngine(EngineConfig(target_model=str(root / "target"), draft_model=head_dir,
                                    proposer="eagle3", method=method, num_speculative_tokens=3,
                                    adaptive_k=True, max_batch_size=4, max_num_seqs=8,
                                    enforce_eager=not compiled_path))
    from exspec.engine.runner import ModelRunner
    pieced, in_pieces = [], ModelRunner._in_pieces   # static shapes: catch-ups wider than k + 1
    monkeypatch.setattr(ModelRunner, "_in_pieces", lambda self, *a: pieced.append(a[2].shape[1]) or in_pieces(self, *a))
    seen, propose = [], engine.proposer.propose
    before = compiled.dynamo_counts()

    def recording(runner, state, seqs, plan, staged, sent, step):
        proposal = propose(runner, state, seqs, plan, staged, sent, step)
        firsts = proposal.tokens[:, 0].tolist()
        seen.extend((s.request_id, s.num_tokens, t) for s, t in zip(seqs, firsts))
        return proposal
    engine.proposer.propose = recording
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    outputs = {}
    for i, prompt in enumerate(prompts):   # one arrival a tick, the first four at once
        engine.add_request(f"r{i}", prompt, params)
        if i >= 3:
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    stats = engine.stats()
    assert stats["plain_steps"] > 0 and stats["accepted_tokens"] > 0, stats
    # nothing compiled after the warm-up: the head's features sliced from its buffer for one
    # row keep that buffer's stride (a size-1 dimension's), which compiled a graph until the
    # runner gave compiled inputs fresh strides
    assert compiled.dynamo_counts() == before, f"after warm-up: {before} -> {compiled.dynamo_counts()}"
    if static:   # the head's features went into every shape the warm-up built (its own width)
        forwards = engine.runner.decode_forwards
        assert forwards[engine.target].eager_forwards == 0, forwards[engine.target].eager_shapes
        assert forwards[engine.proposer.models[0]].eager_forwards == 0 and pieced   # catch-ups in pieces
    head = load_head(head_dir, engine.target, torch.float32, "cpu")
    drafts = {f"r{i}": first_drafts(engine.target, head, p + outputs[f"r{i}"])
              for i, p in enumerate(prompts)}
    wrong = [(rid, n, got, drafts[rid][n - 1]) for rid, n, got in seen if drafts[rid][n - 1] != got]
    assert len(seen) > 100 and not wrong, wrong[:5]


def test_a_compiled_region_of_several_layers_hands_on_the_true_layer_inputs(deep, monkeypatch):
    """Regions of 3 layers (12 layers): the head reads layers 2, 6 and 9; 2 and 9 sit inside a
    region, where the model hands a layer the region's output. What the head reads in a compiled
    forward equals what it reads eagerly."""
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    root, _, _, _ = deep
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float32).eval()
    tap = LayerInputs(target, default_layer_ids(12))
    ids = torch.randint(1, VOCAB, (2, 7))
    with torch.no_grad():
        target(input_ids=ids, use_cache=False)
        eager = tap.take()
        forward = CompiledForward(target)
        forward(input_ids=ids, use_cache=False)   # the probe: eager, sets the regions
        assert forward.layers_per_region == 3
        forward(input_ids=ids, use_cache=False)
        regional = tap.take()
    for a, b in zip(eager, regional):
        torch.testing.assert_close(a, b)


# -- checkpoints ------------------------------------------------------------------------------
@pytest.fixture()
def saved(tmp_path):
    target = llama(VOCAB, seed=1, layers=4, hidden=64)
    head = _random_head(target, draft_ids=list(range(0, VOCAB, 2)))
    save_head(head, tmp_path / "head", dtype=torch.float32)
    return target, head, tmp_path / "head"


def _logits(head, target):
    ids = torch.randint(1, VOCAB, (1, 5))
    features = torch.randn(1, 5, 64)
    with torch.no_grad():
        return head(input_ids=ids, position_ids=torch.arange(5)[None], features=features).logits


def test_vllm_layout_variants_load_alike(saved, tmp_path):
    """vLLM's loader takes the layer under `midlayer.` or `layers.0.`, an optional `model.`
    prefix, the head's own embeddings or the target's, and ignores `t2d`."""
    target, head, folder = saved
    torch.manual_seed(0)
    want = _logits(head, target)
    weights = load_file(str(folder / "model.safetensors"))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "d2t", "t2d", "lm_head.weight",
            "norm.weight"} <= set(weights)
    variant = tmp_path / "variant"
    shutil.copytree(folder, variant)
    renamed = {("model." + n.replace("midlayer.", "layers.0.")) if n != "lm_head.weight" else n: t
               for n, t in weights.items()}
    renamed["model.embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    save_file(renamed, str(variant / "model.safetensors"))
    for path in (folder, variant):
        loaded = load_head(str(path), target, torch.float32, "cpu")
        torch.manual_seed(0)
        torch.testing.assert_close(_logits(loaded, target), want)
    assert load_head(str(folder), target, torch.float32, "cpu").embed_tokens.weight is \
        target.get_input_embeddings().weight   # shared, not copied


def _edit(folder, tmp_path, config=None, weights=None, files=None, name="edited"):
    out = tmp_path / name
    shutil.copytree(folder, out)
    if files:
        files(out)
    if config:
        raw = json.loads((out / "config.json").read_text())
        config(raw)
        (out / "config.json").write_text(json.dumps(raw))
    if weights:
        w = load_file(str(out / "model.safetensors"))
        weights(w)
        save_file(w, str(out / "model.safetensors"))
    return str(out)


@pytest.mark.parametrize("case, words", [
    ("hidden", ["target hidden states of size 96", "the target's are 64", "another target"]),
    ("vocab", ["target vocabulary of 1000", "the target has 320 logits"]),
    ("layers", ["layers [2, 3, 7]", "the target has 4"]),
    ("d2t", ["drafts over 160 ids of the target's 320", "no d2t"]),
    ("architecture", ["LlamaForCausalLM", "not an EAGLE-3 head"]),
    ("missing", ["missing ['fc.weight']"]),
])
def test_a_head_for_another_target_is_refused_naming_both_sides(saved, tmp_path, case, words):
    target, _, folder = saved
    edits = {
        "hidden": dict(config=lambda c: c.update(target_hidden_size=96)),
        "vocab": dict(config=lambda c: c.update(vocab_size=1000)),
        "layers": dict(config=lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 3, 7])),
        "d2t": dict(weights=lambda w: w.pop("d2t")),
        "architecture": dict(config=lambda c: c.update(architectures=["LlamaForCausalLM"])),
        "missing": dict(weights=lambda w: w.pop("fc.weight")),
    }[case]
    with pytest.raises(ModelLoadError) as err:
        load_head(_edit(folder, tmp_path, **edits), target, torch.float32, "cpu")
    for w in words:
        assert w in str(err.value), str(err.value)


def test_model_json_takes_vllms_eagle3_config_and_refuses_it_without_a_head(saved):
    out, _ = translate({"model": "/t", "speculative_config": {"method": "eagle3", "model": "/h",
                                                              "num_speculative_tokens": 3}})
    assert (out["proposer"], out["draft_model"], out["num_speculative_tokens"]) == ("eagle3", "/h", 3)
    with pytest.raises(ValueError, match="the EAGLE-3 head's folder"):
        translate({"model": "/t", "speculative_config": {"method": "eagle3"}})
    with pytest.raises(ValueError, match="proposer 'eagle3' needs draft_model"):
        EngineConfig(target_model="/t", proposer="eagle3")
    _, _, folder = saved
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_head(str(folder / "nowhere"), llama(VOCAB, seed=1, layers=4, hidden=64), torch.float32, "cpu")


def _truncate(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 2])


def _corrupt_bin(folder):
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not a zip archive")


BROKEN = {   # case: (edit, words the error must hold besides the folder)
    "truncated safetensors": (dict(files=_truncate), ["model.safetensors cannot be read",
                                                       "incomplete metadata"]),
    "garbage safetensors": (dict(files=lambda f: (f / "model.safetensors").write_bytes(b"\xff" * 64)),
                            ["model.safetensors cannot be read", "SafetensorError"]),
    "corrupt bin": (dict(files=_corrupt_bin), ["pytorch_model.bin cannot be read",
                                                 "failed reading zip archive"]),
    "config not JSON": (dict(files=lambda f: (f / "config.json").write_text("{hidden_size: 64")),
                        ["config.json is not valid JSON", "line 1 column 2"]),
    "config a list": (dict(files=lambda f: (f / "config.json").write_text("[64]")),
                      ["config.json holds a list"]),
    "hidden size a string": (dict(config=lambda c: c.update(hidden_size="64")),
                             ["hidden_size is '64'", "positive integer"]),
    "no attention heads": (dict(config=lambda c: c.update(num_attention_heads=0)),
                           ["num_attention_heads is 0", "positive integer"]),
    "eps a string": (dict(config=lambda c: c.update(rms_norm_eps="small")),
                     ["do not make a Llama config", "rms_norm_eps"]),
    "float layer ids": (dict(config=lambda c: c["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids=[0.0, 2.0, 3.0])), ["layers [0.0, 2.0, 3.0]", "integer ids"]),
    "unknown activation": (dict(config=lambda c: c.update(hidden_act="swishy")),
                           ["hidden_act 'swishy'", "silu"]),
    "unknown rope type": (dict(config=lambda c: c.update(rope_parameters={"rope_type": "bogus",
                                                                          "rope_theta": 1e4})),
                          ["rope type 'bogus'", "llama3"]),
    "NaN weight": (dict(weights=lambda w: w["fc.weight"].__setitem__((0, 0), float("nan"))),
                   ["weight fc.weight holds NaN or Inf"]),
    "Inf weight": (dict(weights=lambda w: w["lm_head.weight"].__setitem__((1, 2), float("-inf"))),
                   ["weight lm_head.weight holds NaN or Inf"]),
    "int8 weight": (dict(weights=lambda w: w.update({"fc.weight": w["fc.weight"].to(torch.int8)})),
                    ["weight fc.weight is torch.int8, not floating point"]),
    "float d2t": (dict(weights=lambda w: w.update(d2t=w["d2t"].float())),
                  ["d2t is torch.float32", "integer offsets"]),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_head_folder_is_one_load_error_naming_the_folder_and_the_cause(saved, tmp_path, case):
    """A bad file or value is a ModelLoadError that names the head's folder and what is wrong,
    never a library's raw exception, and never a head that loads with poisoned weights."""
    target, _, folder = saved
    edit, words = BROKEN[case]
    broken = _edit(folder, tmp_path, **edit)
    with pytest.raises(ModelLoadError) as err:
        load_head(broken, target, torch.float32, "cpu")
    for w in [f"EAGLE-3 head {broken}"] + words:
        assert w in str(err.value), f"{case}: {w!r} not in {str(err.value)!r}"
