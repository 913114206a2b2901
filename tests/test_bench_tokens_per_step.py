"""`exspec-bench --tokens-per-step` on a tiny pair with a random EAGLE-3 head: the table of
tokens per target step, prompt categories down, every speculative method across (the hybrids
included), each figure the engine's own count (committed tokens / steps) or, for the lookup
proposers, the offline replay's, which must equal what an engine serving the same prompts one
by one counts; the one-line refusal of a method whose draft or head is not given."""
from __future__ import annotations

import json

import pytest

from exspec import EngineConfig, LLMEngine, SamplingParams
from exspec.bench.cli import main
from exspec.bench.methods import model_of
from exspec.demo.tiny import build_demo_pair

CATEGORIES = ("open", "agentic", "grounded", "multiturn", "code_edit", "repeated")
PROPOSERS = ("draft_model", "eagle3", "ngram", "suffix", "eagle3_suffix", "draft_model_suffix")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM
    from exspec.models.eagle3 import head_for, save_head
    root = tmp_path_factory.mktemp("tps")
    pair = build_demo_pair(root / "pair")
    target = AutoModelForCausalLM.from_pretrained(pair / "target", dtype=torch.float32)
    save_head(head_for(target, (0, 2, 3)), root / "head", dtype=torch.float32)
    return root, {"--target": str(pair / "target"), "--draft": str(pair / "draft"),
                  "--tokenizer": str(pair / "tokenizer"), "--eagle3": str(root / "head")}


def flags(paths: dict, *without: str) -> list[str]:
    return [a for flag, value in paths.items() if flag not in without for a in (flag, value)]


def figures(cell: dict) -> tuple:
    return cell["steps"], cell["tokens"], cell["proposed"], cell["kept"]


def test_every_category_and_method_side_by_side_untimed(pair):
    """Alone, --tokens-per-step writes results.json and results.md with the table only (no
    timed cell, no plot): a row per shipped set and "all", a column per proposer (by default
    every exspec_* method whose draft or head is given, the hybrids too), each figure its own
    tokens over its own steps, at least 1, "all" the categories' sums."""
    root, paths = pair
    out = root / "all_sets"
    assert main(flags(paths) + ["--tokens-per-step", "--num-prompts", "1", "--max-tokens", "6",
                                "-k", "3", "--no-progress", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "results.md"]
    results = json.loads((out / "results.json").read_text())
    assert results["cells"] == [] and results["config"]["tokens_per_step"] == "only"
    [table] = results["tokens_per_step"]   # one table per batch size: batch 1 by default
    assert (table["batch_size"], table["k"], table["max_tokens"]) == (1, 3, 6)
    assert [c["proposer"] for c in table["columns"]] == list(PROPOSERS)
    assert {c["proposer"]: c["source"] for c in table["columns"]} == {
        "draft_model": "engine", "eagle3": "engine", "ngram": "replay", "suffix": "replay",
        "eagle3_suffix": "engine", "draft_model_suffix": "engine"}
    rows = {r["category"]: r for r in table["rows"]}
    assert list(rows) == [*CATEGORIES, "all"]
    for name, row in rows.items():
        assert set(row["cells"]) == set(PROPOSERS) and row["outputs_agree"], name
        for proposer, cell in row["cells"].items():
            assert cell["steps"] > 0 and cell["tokens_per_step"] == cell["tokens"] / cell["steps"] >= 1
            assert cell["tokens"] == 5 * row["prompts"], (name, proposer)   # 6 tokens, the first prefill's
    for proposer in PROPOSERS:
        assert [sum(rows[c]["cells"][proposer][k] for c in CATEGORIES) for k in ("steps", "tokens")] \
            == [rows["all"]["cells"][proposer][k] for k in ("steps", "tokens")], proposer
    assert "chosen" in rows["open"]["cells"]["eagle3_suffix"]   # the hybrid's rows per source
    md = (out / "results.md").read_text()
    assert ("| category | prompts | draft_model | eagle3 | ngram (replay) | suffix (replay) | "
            "eagle3_suffix | draft_model_suffix |") in md
    assert all(f"\n| {name} | " in md for name in rows) and "tokens/s" not in md


def test_figures_are_the_engines_counts_and_the_replay_equals_the_engine(pair):
    """Categories from a --prompts file; repeated asks, so suffix decoding (replayed) and the
    hybrid keep proposals. Each category's figures equal those of an engine built here, serving
    the same prompts one after another at batch 1 (its first one served, not counted:
    --warm-prompts 1), the lookup proposer's too; eqspec_X and exspec_X share one column."""
    root, paths = pair
    texts = {"again": ["def add(a, b):\n", "import os\n", "def add(a, b):\n", "def add(a, b):\n"],
             "other": ["class Engine:\n", "for i in range(10):\n", "class Engine:\n"]}
    prompts = root / "again.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n"
                               for i, (c, t) in enumerate((c, t) for c in texts for t in texts[c])))
    out = root / "again"
    assert main(flags(paths) + ["--tokens-per-step", "--prompts", str(prompts), "--num-prompts", "7",
                                "--warm-prompts", "1", "--max-tokens", "16", "-k", "3",
                                "--methods", "exspec_suffix,exspec_eagle3_suffix,eqspec_eagle3_suffix",
                                "--no-progress", "--out", str(out)]) == 0
    [table] = json.loads((out / "results.json").read_text())["tokens_per_step"]
    assert [(c["proposer"], c["source"], c["methods"]) for c in table["columns"]] == [
        ("suffix", "replay", ["exspec_suffix"]),
        ("eagle3_suffix", "engine", ["exspec_eagle3_suffix", "eqspec_eagle3_suffix"])]
    rows = {r["category"]: r for r in table["rows"]}
    assert list(rows) == ["again", "other", "all"] and rows["again"]["prompts"] == 3

    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(paths["--tokenizer"])
    for proposer in ("suffix", "eagle3_suffix"):
        engine = LLMEngine(EngineConfig(
            target_model=paths["--target"], tokenizer=paths["--tokenizer"], method="exspec",
            draft_model=paths["--eagle3"] if proposer == "eagle3_suffix" else None,
            proposer=proposer, num_speculative_tokens=3, adaptive_k=False, max_batch_size=1,
            max_num_seqs=1))
        for category, asks in texts.items():
            engine.proposer.forget()
            for i, text in enumerate(asks):
                if i == 1:
                    before = engine.stats()
                engine.generate([tokenizer.encode(text, add_special_tokens=False)],
                                SamplingParams(max_tokens=16))
            after = engine.stats()
            expected = tuple(after[k] - before[k] for k in
                             ("steps", "committed_tokens", "draft_tokens", "accepted_tokens"))
            assert figures(rows[category]["cells"][proposer]) == expected, (proposer, category)
        del engine
    again = rows["again"]["cells"]
    assert again["suffix"]["tokens_per_step"] > 1.5 and again["eagle3_suffix"]["tokens_per_step"] > 1.5
    assert again["eagle3_suffix"]["chosen"]["suffix"] > 0
    assert "| again | 3 | " in (out / "results.md").read_text()


@pytest.mark.parametrize("methods, without, words", [
    ("exspec_suffix,exspec_eagle3_suffix", "--eagle3",
     "exspec-bench: exspec_eagle3_suffix needs --eagle3 (an EAGLE-3 head's folder)"),
    ("exspec_draft_model_suffix,eqspec", "--draft",
     "exspec-bench: exspec_draft_model_suffix, eqspec need --draft (a draft model)"),
])
def test_a_method_without_its_head_or_draft_is_one_line_naming_the_flag(pair, monkeypatch, methods,
                                                                       without, words):
    """Asked for a method whose model is not given, exspec-bench stops with one line naming the
    flag that gives it, before any model loads."""
    from exspec.bench import cli

    def loaded(*_):
        raise AssertionError("a model loaded before the check")
    monkeypatch.setattr(cli, "HFModels", loaded)
    root, paths = pair
    with pytest.raises(SystemExit) as stop:
        main(flags(paths, without) + ["--tokens-per-step", "--methods", methods, "--no-progress",
                                      "--out", str(root / "refused")])
    assert str(stop.value) == words


def test_the_registry_says_which_methods_need_a_head_or_a_draft():
    assert [model_of(m) for m in ("exspec_eagle3", "eqspec_eagle3_suffix", "exspec",
                                  "exspec_draft_model_suffix", "hf_assisted", "exspec_suffix",
                                  "exspec_ngram", "autoregressive", "hf_generate")] == \
        ["head", "head", "draft", "draft", "draft", None, None, None, None]


@pytest.mark.parametrize("extra, words", [
    (["--temperature", "0.5"], "--tokens-per-step counts greedy steps: drop --temperature"),
    (["--methods", "autoregressive,hf_generate"], "--tokens-per-step: --methods names no speculative"),
])
def test_flags_the_table_cannot_honour_are_refused_by_name(capsys, extra, words):
    with pytest.raises(SystemExit) as stop:
        main(["--tokens-per-step", *extra])
    assert stop.value.code == 2 and words in capsys.readouterr().err


def test_also_puts_the_table_beside_a_timed_runs_cells(pair):
    """--tokens-per-step also: the timed run as before, and the table of its speculative methods
    (here the one --prompt-set) in results.json and results.md."""
    pytest.importorskip("matplotlib")
    from test_bench import check_schema
    root, paths = pair
    out = root / "also"
    assert main(flags(paths) + ["--tokens-per-step", "also", "--prompt-set", "repeated",
                                "--num-prompts", "2", "--max-tokens", "6", "-k", "2",
                                "--batch-sizes", "1", "--repeats", "1",
                                "--methods", "autoregressive,exspec_suffix,exspec_eagle3_suffix",
                                "--no-progress", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    check_schema(results)
    assert {c["method"] for c in results["cells"]} == {"autoregressive", "exspec_suffix",
                                                       "exspec_eagle3_suffix"}
    assert all(c["exact_match_share"] == 1 for c in results["cells"])
    [table] = results["tokens_per_step"]
    assert [r["category"] for r in table["rows"]] == ["repeated", "all"]
    assert [c["proposer"] for c in table["columns"]] == ["suffix", "eagle3_suffix"]
    md = (out / "results.md").read_text()
    assert "| method | B | tokens/s" in md and "## Tokens per target step by prompt category" in md


def test_a_table_per_batch_size_counts_row_steps_of_an_engine_serving_waves(pair):
    """--batch-sizes 1,2: a second table at batch 2 where every column, the lookup proposers'
    too, is an engine serving each category's prompts two at a time; its figures equal those of
    an engine built here serving the same waves (tokens over row-steps: a step of 2 rows counts
    2), exact like batch 1's, and results.md shows both tables."""
    root, paths = pair
    texts = ["def add(a, b):\n", "import os\n", "def add(a, b):\n", "class Engine:\n"]
    prompts = root / "waves.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "mix", "turns": [t]}) + "\n"
                               for i, t in enumerate(texts)))
    out = root / "waves"
    assert main(flags(paths) + ["--tokens-per-step", "--prompts", str(prompts), "--num-prompts", "4",
                                "--batch-sizes", "1,2", "--max-tokens", "12", "-k", "3",
                                "--methods", "exspec_suffix,exspec_eagle3", "--no-progress",
                                "--out", str(out)]) == 0
    one, two = json.loads((out / "results.json").read_text())["tokens_per_step"]
    assert (one["batch_size"], two["batch_size"]) == (1, 2)
    assert [c["source"] for c in one["columns"]] == ["replay", "engine"]
    assert [c["source"] for c in two["columns"]] == ["engine", "engine"]
    mix = {r["category"]: r for r in two["rows"]}["mix"]
    assert mix["outputs_agree"]

    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(paths["--tokenizer"])
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    for proposer in ("suffix", "eagle3"):
        engine = LLMEngine(EngineConfig(
            target_model=paths["--target"], tokenizer=paths["--tokenizer"], method="exspec",
            draft_model=paths["--eagle3"] if proposer == "eagle3" else None, proposer=proposer,
            num_speculative_tokens=3, adaptive_k=False, max_batch_size=2, max_num_seqs=2))
        before = engine.stats()
        for wave in (ids[:2], ids[2:]):
            engine.generate(wave, [SamplingParams(max_tokens=12) for _ in wave])
        after = engine.stats()
        shapes = {(s["rows"], s["k"]): s["steps"] for s in after["steps_by_shape"]}
        for s in before["steps_by_shape"]:
            shapes[s["rows"], s["k"]] -= s["steps"]
        row_steps = sum(rows * n for (rows, _), n in shapes.items())
        assert any(rows == 2 for (rows, _), n in shapes.items() if n), shapes   # waves of two
        expected = (row_steps, *(after[k] - before[k] for k in
                                 ("committed_tokens", "draft_tokens", "accepted_tokens")))
        assert figures(mix["cells"][proposer]) == expected, proposer
        del engine
    md = (out / "results.md").read_text()
    assert "by prompt category, batch 1" in md and "by prompt category, batch 2" in md
