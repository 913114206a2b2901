"""exspec-bench end to end on a tiny pair: the three output files, results.json against the
schema (design: "Names other parts rely on"), shares within [0, 1], and exact equivalence of
the speculative methods."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

from exspec.bench.cli import main, rotated  # noqa: E402
from exspec.bench.methods import ENGINE_METHODS  # noqa: E402
from exspec.bench.report import paired, ratio  # noqa: E402
from exspec.demo.tiny import build_demo_pair  # noqa: E402

NUMBER = (int, float)
CELL_SCHEMA = {   # key: (allowed types, may be null)
    "method": (str, False), "batch_size": (int, False), "k": (int, False),
    "adaptive_k": (bool, True), "sampling_coupling": (str, True), "path": (str, False), "tokens_per_s": (NUMBER, False), "tokens_per_s_runs": (list, False),
    "speedup_vs_autoregressive": (NUMBER, True), "speedup_vs_batch1": (NUMBER, True),
    "exact_match_share": (NUMBER, False), "prefix_match_mean": (NUMBER, False),
    "acceptance_rate": (NUMBER, True), "mean_accepted_length": (NUMBER, True),
    "acceptance_by_depth": (list, True), "draft_ms_per_forward": (NUMBER, True),
    "step_ms": (NUMBER, True), "draft_cost_vs_target_step": (NUMBER, True),
    "realign_share": (NUMBER, True), "equal_length_step_share": (NUMBER, True),
    "ideal_tokens_per_s": (NUMBER, True), "ideal_share": (NUMBER, True),
}
# ideal_share (measured ÷ analytic ideal) is left out on purpose: it compares two timings taken
# moments apart, and timing claims stay out of tests (design: "Testing rules"; the benchmark
# reports it).
SHARES = ("exact_match_share", "prefix_match_mean", "acceptance_rate", "realign_share",
          "equal_length_step_share")
METHODS = ("autoregressive", "eqspec", "exspec", "eqspec_eagle3", "exspec_eagle3", "eqspec_ngram",
           "exspec_ngram", "eqspec_suffix", "exspec_suffix", "eqspec_eagle3_suffix",
           "exspec_eagle3_suffix", "eqspec_draft_model_suffix", "exspec_draft_model_suffix",
           "hf_generate", "hf_assisted")


def check_schema(results: dict) -> None:
    # paths: with --paths compiled; tokens_per_step: with --tokens-per-step also
    assert set(results) - {"paths", "tokens_per_step"} == {"schema", "command", "machine", "config",
                                                           "cells"}, sorted(results)
    assert results["schema"] == 1
    assert isinstance(results["command"], str) and results["command"].startswith("exspec-bench")
    assert isinstance(results["machine"], dict) and isinstance(results["config"], dict)
    assert isinstance(results["cells"], list) and results["cells"]
    for cell in results["cells"]:
        where = f"cell {cell.get('method')} B={cell.get('batch_size')} adaptive={cell.get('adaptive_k')}"
        assert set(cell) == set(CELL_SCHEMA), f"{where}: keys {sorted(set(cell) ^ set(CELL_SCHEMA))}"
        for key, (types, nullable) in CELL_SCHEMA.items():
            value = cell[key]
            if value is None:
                assert nullable, f"{where}: {key} is null"
                continue
            assert isinstance(value, types), f"{where}: {key}={value!r} is not {types}"
            if types is NUMBER:
                assert not isinstance(value, bool), f"{where}: {key} is a bool"
        assert all(isinstance(v, NUMBER) and v > 0 for v in cell["tokens_per_s_runs"]), where
        assert cell["method"] in METHODS, where


@pytest.fixture(scope="module")
def bench_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    pair = build_demo_pair(root / "pair")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "code", "turns": [t]}) + "\n"
                               for i, t in enumerate(["def add(a, b):\n", "import os\nimport sys\n"])))
    return root, ["--target", str(pair / "target"), "--draft", str(pair / "draft"),
                  "--tokenizer", str(pair / "tokenizer"), "--prompts", str(prompts),
                  "--num-prompts", "2", "-k", "3", "--batch-sizes", "1,2", "--repeats", "1",
                  "--no-progress"]


@pytest.fixture(scope="module")
def bench_run(bench_inputs):
    root, args = bench_inputs
    assert main(args + ["--max-tokens", "6", "--fixed-k", "0,1,3", "--out", str(root / "out")]) == 0
    return root / "out"


def test_adaptive_k_is_compared_with_every_fixed_k(bench_run):
    """--fixed-k runs each fixed k beside adaptive k; results.md compares adaptive with the best."""
    cells = json.loads((bench_run / "results.json").read_text())["cells"]
    for method in ("eqspec", "exspec"):
        for batch in (1, 2):
            fixed = sorted(c["k"] for c in cells if c["method"] == method and c["batch_size"] == batch
                           and c["adaptive_k"] is False)
            assert fixed == [0, 1, 3], f"{method} B={batch}: fixed k's {fixed}"
    md = (bench_run / "results.md").read_text()
    # that section alone: the drafts-by-position table after it lists an adaptive cell too
    # whenever it drafted in the timed runs
    table = md.split("## Adaptive k against the best fixed k")[1].split("\n## ")[0]
    rows = [line for line in table.splitlines() if line.startswith("| exspec (adaptive") or
            line.startswith("| eqspec (adaptive")]
    assert len(rows) == 4, table
    assert all(re.search(r"\| \d+\.\d\d \(\d+\.\d\d\) \|", row) for row in rows), table   # with the paired ratio


def test_fixed_k_zero_is_the_methods_layout_without_speculation(bench_run):
    """--fixed-k 0: the method's own layout decoding plainly (what speculation adds on top of
    it is then visible beside autoregressive, which runs EQSPEC's layout): exact, no drafts."""
    cells = json.loads((bench_run / "results.json").read_text())["cells"]
    plain = [c for c in cells if c["k"] == 0 and c["adaptive_k"] is False]
    assert sorted((c["method"], c["batch_size"]) for c in plain) == [
        (m, b) for m in ("eqspec", "eqspec_ngram", "exspec", "exspec_ngram") for b in (1, 2)]
    for c in plain:
        assert c["exact_match_share"] == 1.0, c
        assert c["acceptance_rate"] is None, c           # no draft token was proposed
        assert c["mean_accepted_length"] == 1.0, c       # one token per row-step
    assert "| exspec (k=0) | 2 |" in (bench_run / "results.md").read_text()


def test_bench_writes_the_three_files(bench_run):
    for name in ("results.json", "results.md", "throughput.png"):
        assert (bench_run / name).stat().st_size > 0, name
    assert (bench_run / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| method | B | tokens/s" in (bench_run / "results.md").read_text()


def test_results_json_follows_the_schema(bench_run):
    results = json.loads((bench_run / "results.json").read_text())
    check_schema(results)
    cells = {(c["method"], c["batch_size"], c["adaptive_k"]) for c in results["cells"]}
    for b in (1, 2):
        assert {("autoregressive", b, None), ("hf_generate", b, None)} <= cells
        for method in ("eqspec", "exspec"):
            assert {(method, b, True), (method, b, False)} <= cells, f"{method} B={b}"
    assert {("hf_assisted", 1, True), ("hf_assisted", 1, False)} <= cells
    assert not any(m == "hf_assisted" and b != 1 for m, b, _ in cells), "assisted is batch 1 only"


def test_every_share_lies_in_the_unit_interval(bench_run):
    for cell in json.loads((bench_run / "results.json").read_text())["cells"]:
        for key in SHARES:
            value = cell[key]
            assert value is None or 0.0 <= value <= 1.0, \
                f"{cell['method']} B={cell['batch_size']} adaptive={cell['adaptive_k']}: {key}={value}"
        # an analytic ideal where its cost model (HF's eager target and draft) is what ran
        modelled = cell["path"] == "eager" and ENGINE_METHODS.get(cell["method"], ("", ""))[1] == "draft_model"
        assert (cell["ideal_share"] is not None and cell["ideal_share"] > 0) == modelled, cell


def test_speculative_methods_match_the_reference_exactly(bench_run):
    for cell in json.loads((bench_run / "results.json").read_text())["cells"]:
        if cell["method"] in ("eqspec", "exspec", "autoregressive"):
            assert cell["exact_match_share"] == 1, \
                f"{cell['method']} B={cell['batch_size']} adaptive={cell['adaptive_k']}: " \
                f"exact_match_share {cell['exact_match_share']}"
            assert cell["prefix_match_mean"] == 1


def test_speedups_are_relative_to_autoregressive_and_batch_one(bench_run):
    cells = json.loads((bench_run / "results.json").read_text())["cells"]
    by = {(c["method"], c["batch_size"], c["k"], c["adaptive_k"]): c for c in cells}
    for c in cells:
        ar = by["autoregressive", c["batch_size"], 0, None]
        assert c["speedup_vs_autoregressive"] == pytest.approx(c["tokens_per_s"] / ar["tokens_per_s"])
        b1 = by[c["method"], 1, c["k"], c["adaptive_k"]]
        assert c["speedup_vs_batch1"] == pytest.approx(c["tokens_per_s"] / b1["tokens_per_s"])


def test_sampled_run_compares_both_couplings_with_the_seeded_reference(bench_inputs):
    """--temperature / --top-p / --sampling-couplings: engine cells per coupling, each row against
    the target-only seeded output, which the gumbel coupling equals exactly."""
    root, args = bench_inputs
    out = root / "sampled"
    assert main(args + ["--max-tokens", "12", "--temperature", "1.0", "--top-p", "0.95",
                        "--sampling-couplings", "gumbel,rejection",
                        "--methods", "autoregressive,exspec", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    check_schema(results)
    assert results["config"]["greedy"] is False and results["config"]["sampling_couplings"] == ["gumbel", "rejection"]
    cells = results["cells"]
    assert {(c["method"], c["sampling_coupling"]) for c in cells} == {
        (m, c) for m in ("autoregressive", "exspec") for c in ("gumbel", "rejection")}
    for c in cells:
        if c["sampling_coupling"] == "gumbel":
            assert c["exact_match_share"] == 1, c
        if c["method"] == "exspec" and c["adaptive_k"] is False:   # adaptive k may not draft here
            assert c["acceptance_rate"] is not None and 0 < c["acceptance_rate"] <= 1, c
    # rejection sampling keeps the distribution, not the sample: some row differs
    assert min(c["prefix_match_mean"] for c in cells if c["sampling_coupling"] == "rejection") < 1
    assert "gumbel" in (out / "results.md").read_text()


def test_ngram_methods_on_a_shipped_prompt_set_are_exact(bench_inputs):
    """--methods *_ngram and *_suffix: no draft model; --prompt-set grounded: the shipped set,
    through the chat template. Exact (this random pair seldom repeats itself, so whether it
    proposes is left to tests/engine/test_ngram.py)."""
    root, args = bench_inputs
    out = root / "ngram"
    args = list(args)
    del args[args.index("--prompts"):args.index("--prompts") + 2]   # the set instead
    args[args.index("--batch-sizes") + 1] = "1"
    assert main(args + ["--max-tokens", "16", "--prompt-set", "grounded", "--methods",
                        "autoregressive,eqspec_ngram,exspec_ngram,exspec_suffix", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    check_schema(results)
    assert results["config"]["prompts"].endswith("grounded.jsonl")
    ngram = [c for c in results["cells"] if c["method"].endswith("_ngram")]
    assert {c["method"] for c in ngram} == {"eqspec_ngram", "exspec_ngram"}
    assert any(c["method"] == "exspec_suffix" for c in results["cells"])
    assert all(c["exact_match_share"] == 1 for c in results["cells"])


def test_warm_prompts_are_served_untimed_before_each_run_to_a_proposer_that_learns(
        bench_inputs, monkeypatch, capsys):
    """--warm-prompts N: the set's first N prompts are the history a server served before;
    before each run (the warm-up and every repeat) suffix decoding forgets and is served them
    again, untimed, then the rest are timed and compared with the reference."""
    from exspec.spec.suffix import SuffixProposer
    log = []
    forget, done = SuffixProposer.forget, SuffixProposer.request_done
    monkeypatch.setattr(SuffixProposer, "forget",
                        lambda self: (log.append((self, " ")), forget(self)))
    monkeypatch.setattr(SuffixProposer, "request_done",
                        lambda self, row, reason: (log.append((self, "d")), done(self, row, reason)))
    root, args = bench_inputs
    out = root / "warm"
    args = list(args)
    del args[args.index("--prompts"):args.index("--prompts") + 2]
    args[args.index("--batch-sizes") + 1] = "2"
    args[args.index("--num-prompts") + 1] = "6"
    assert main(args + ["--max-tokens", "6", "--prompt-set", "repeated", "--warm-prompts", "2",
                        "--methods", "autoregressive,exspec_suffix", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["warm_prompts"] == 2 and results["config"]["num_prompts"] == 4
    assert all(c["exact_match_share"] == 1 for c in results["cells"])
    # two suffix cells (adaptive k, k = 3), each warmed up and run once: 2 + 4 requests a run
    cells = {proposer for proposer, _ in log}
    runs = ["".join(e for p, e in log if p is cell).split() for cell in cells]
    assert len(cells) == 2 and runs == [["d" * (2 + 4)] * 2] * 2, runs
    assert "4 prompts (after 2 more, served untimed" in (out / "results.md").read_text()
    with pytest.raises(SystemExit):
        main(args + ["--prompt-set", "repeated", "--warm-prompts", "6", "--out", str(out)])
    assert "--warm-prompts 6 leaves none of --num-prompts 6 to time" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(args + ["--prompt-set", "repeated", "--warm-prompts", "-1", "--out", str(out)])
    assert "--warm-prompts must be >= 0" in capsys.readouterr().err


def test_eagle3_methods_report_acceptance_by_position_and_the_heads_cost(bench_inputs):
    """--eagle3: a head for the pair's target (random weights: what is checked is the report, the
    equality, and that the drafts' positions and cost are measured). Every cell is exact; each
    drafting cell reports acceptance at every draft position, the head's milliseconds per draft
    forward and their ratio to an autoregressive step, and results.md a table of them and the
    projection."""
    import torch
    from transformers import AutoModelForCausalLM
    from exspec.models.eagle3 import head_for, save_head
    root, args = bench_inputs
    target_dir = args[args.index("--target") + 1]
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    save_head(head_for(target, (0, 2, 3)), root / "head", dtype=torch.float32)
    out = root / "eagle3"
    args = list(args)
    args[args.index("--batch-sizes") + 1] = "1"
    assert main(args + ["--max-tokens", "8", "--eagle3", str(root / "head"), "--fixed-k", "2",
                        "--methods", "autoregressive,eqspec_eagle3,exspec_eagle3", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    check_schema(results)
    assert results["config"]["eagle3"] == str(root / "head")
    assert all(c["exact_match_share"] == 1 for c in results["cells"])
    fixed = [c for c in results["cells"] if c["method"].endswith("_eagle3") and c["adaptive_k"] is False]
    assert {c["method"] for c in fixed} == {"eqspec_eagle3", "exspec_eagle3"}
    for c in fixed:
        assert len(c["acceptance_by_depth"]) == 2 and all(0 <= a <= 1 for a in c["acceptance_by_depth"])
        assert c["draft_ms_per_forward"] > 0 and c["draft_cost_vs_target_step"] > 0
    md = (out / "results.md").read_text()
    assert "## Drafts by position" in md and "Projection (analytic, not measured)" in md
    with pytest.raises(SystemExit, match="--eagle3"):
        main(args + ["--methods", "exspec_eagle3", "--out", str(root / "none")])


def test_every_decode_path_in_one_run(bench_inputs, monkeypatch):
    """--paths eager,compiled,in_place: every engine cell on the first two, the exspec ones on
    the read in place too (the others cannot read a block store), each exact; per-forward costs
    of both models on both paths at B = 1 and 8, and each compiled engine's warm-up (graphs,
    seconds). The "eager" compile backend keeps C++ out of the test (Dynamo's graphs are the
    same)."""
    import torch

    from exspec.models import compiled
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", compiled.COMPILE_BACKEND)   # restored after
    torch._dynamo.reset()
    root, args = bench_inputs
    out = root / "paths"
    args = [a if a != "1,2" else "1" for a in args]
    assert main(args + ["--max-tokens", "4", "--methods", "autoregressive,exspec",
                        "--paths", "eager,compiled,in_place", "--compile-backend", "eager",
                        "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    check_schema(results)
    torch._dynamo.reset()
    cells = {(c["method"], c["adaptive_k"], c["path"]) for c in results["cells"]}
    for path in ("eager", "compiled"):
        assert {("autoregressive", None, path), ("exspec", True, path), ("exspec", False, path)} <= cells
    assert {("exspec", True, "in_place"), ("exspec", False, "in_place")} <= cells
    assert ("autoregressive", None, "in_place") not in cells
    # read in place, against the target alone compiled (the path's own cannot read in place)
    assert all(c["speedup_vs_autoregressive"] > 0 for c in results["cells"] if c["path"] == "in_place")
    assert all(c["exact_match_share"] == 1.0 for c in results["cells"]), "a path changed tokens"
    # no "ideal" from eager forward costs for a compiled run (it came out at 130-260% of it)
    assert all((c["ideal_tokens_per_s"] is None) == (c["path"] != "eager") for c in results["cells"]
               if c["method"] in ("autoregressive", "exspec"))
    assert "exspec (adaptive k≤3, compiled, KV read in place)" in (out / "results.md").read_text()
    costs = {(r["model"], r["batch_size"]) for r in results["paths"]["forward_ms"]}
    assert costs == {("draft", 1), ("draft", 8), ("target", 1), ("target", 8)}
    assert all(r["eager_ms"] > 0 and r["compiled_ms"] > 0 for r in results["paths"]["forward_ms"])
    warm = results["paths"]["warm_up"]
    assert warm and sum(w["graphs"] for w in warm) > 0 and all(w["graph_breaks"] == 0 for w in warm)
    assert "Eager against compiled" in (out / "results.md").read_text()


def test_each_repeat_rotates_the_order_of_the_cells():
    """Over as many repeats as cells, every cell runs once at every point of a repeat."""
    keys = ["a", "b", "c", "d"]
    orders = [rotated(keys, r) for r in range(len(keys))]
    assert all(sorted(order) == keys for order in orders)
    for position in range(len(keys)):
        assert sorted(order[position] for order in orders) == keys


def test_paired_ratio_compares_runs_of_the_same_repeat():
    """Per repeat 2.0, 0.5, 2.0: paired median 2.0, where the medians' ratio is 200 / 150."""
    a, b = {"tokens_per_s_runs": [100, 200, 300]}, {"tokens_per_s_runs": [50, 400, 150]}
    assert paired(a, b) == 2.0
    a["tokens_per_s"], b["tokens_per_s"] = 200, 150
    assert ratio(a, b) == "1.33 (2.00)"
    assert ratio(a, None) == "–"


def test_findings_name_every_proposer_slower_than_autoregressive():
    """"Slower than autoregressive" lists every speculative cell below 1x, whatever proposes."""
    from exspec.bench.report import findings

    def cell(method, adaptive, speedup):
        return {"method": method, "batch_size": 16, "adaptive_k": adaptive, "k": 5,
                "sampling_coupling": None, "path": "eager", "speedup_vs_autoregressive": speedup,
                "ideal_tokens_per_s": None, "realign_share": None}
    cells = [cell("autoregressive", None, 1.0), cell("exspec", True, 1.8),
             cell("eqspec_ngram", True, 0.82), cell("exspec_suffix", False, 0.9)]
    slower = findings(cells)[-1]
    assert "eqspec_ngram (adaptive k≤5) at B=16" in slower and "exspec_suffix (k=5) at B=16" in slower
    assert "exspec (" not in slower
    assert findings(cells[:2])[-1] == "Slower than autoregressive: nowhere."


def test_interleaved_methods_take_turns_and_each_is_timed_alone(monkeypatch):
    """run_interleaved: one unit of each live method per round (a method that is done drops
    out), each round in a new seeded order, so no cell always follows the same neighbour (the
    one after a cell sharing its weights runs faster: a fixed cycle biased the comparison of
    adaptive and fixed k by 3-6%); a method's seconds are its own units' only (a fake clock
    that each unit advances by its cost), not its untimed `before_run` (a served history)."""
    from exspec.bench import methods as bench_methods
    clock, log = [0.0], []
    monkeypatch.setattr(bench_methods.time, "perf_counter", lambda: clock[0])

    class Fake(bench_methods.Method):
        device = "cpu"

        def __init__(self, name, costs):
            self.name, self.costs = name, costs

        def before_run(self, max_tokens):   # untimed: a history (--warm-prompts) costs 10
            clock[0] += 10.0

        def ticks(self, prompts, max_tokens):
            for cost in self.costs:
                clock[0] += cost
                log.append(self.name)
                yield
            return [[len(self.costs)]], None

    a, b = Fake("a", [1.0, 2.0, 3.0]), Fake("b", [0.5, 0.25])
    runs = bench_methods.run_interleaved([a, b], [], 4, "cpu")
    assert sorted(log[:2]) == ["a", "b"] and sorted(log[2:4]) == ["a", "b"] and log[4] == "a"
    assert [r.seconds for r in runs] == [6.0, 0.75]
    assert [r.outputs for r in runs] == [[[3]], [[2]]]
    assert a.run([], 4).seconds == 6.0   # alone: the same units, the same sum

    def sequence(seed):
        log.clear()
        bench_methods.run_interleaved([Fake(n, [0.0] * 30) for n in "xyz"], [], 4, "cpu", seed=seed)
        return list(log)

    first = sequence(0)
    rounds = [first[i:i + 3] for i in range(0, 90, 3)]
    assert all(sorted(r) == ["x", "y", "z"] for r in rounds)
    before = {(p, n) for p, n in zip(first, first[1:]) if p != n}
    assert before == {(p, n) for p in "xyz" for n in "xyz" if p != n}   # every neighbour, both ways
    assert sequence(0) == first and sequence(1) != first   # seeded


def test_processing_bench_times_both_cells_in_one_table(capsys):
    """`python -m exspec.bench.processing` on the demo pair: one row per method and batch size,
    the sampled cell and the same cell with every processing parameter, and their ratio."""
    import torch
    from exspec.bench.processing import main as processing_main
    threads = torch.get_num_threads()
    try:
        processing_main(["--steps", "2", "--batch-sizes", "2", "--methods", "exspec", "-k", "2"])
    finally:
        torch.set_num_threads(threads)   # the bench sets one thread; the session keeps its own
    out = capsys.readouterr().out
    assert "torch threads: 1" in out
    assert re.search(r"^\| exspec \| 2( \| [\d.]+){5} \|$", out, re.M), out


def test_every_shipped_prompt_set_reads_and_multiturn_sets_have_later_turns():
    from exspec.bench.cli import PROMPT_SETS, read_prompts
    sets = {p.stem: read_prompts(p, 1000) for p in PROMPT_SETS.glob("*.jsonl")}
    assert {"grounded", "open", "agentic", "multiturn", "code_edit", "repeated"} <= set(sets)
    for name, prompts in sets.items():
        assert len(prompts) >= 8 and all(p.text and p.turns[0] == p.text for p in prompts), name
        assert len({p.question_id for p in prompts}) == len(prompts), name
    assert all(len(p.turns) == 2 for p in sets["multiturn"])


def test_a_multi_turn_prompt_holds_the_targets_own_answer_to_the_earlier_turn(bench_inputs):
    """What a client keeping the conversation sends: turn 1, the target's greedy answer to it
    (generated before the run), then turn 2."""
    import argparse
    from exspec.bench.cli import chat_of_turns
    from exspec.bench.methods import HFModels
    _, args = bench_inputs
    get = lambda flag: args[args.index(flag) + 1]   # noqa: E731
    hf = HFModels(argparse.Namespace(target=get("--target"), draft=None, tokenizer=get("--tokenizer"),
                                     dtype="float32", device="cpu"))
    hf.tokenizer.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                                  "{% if add_generation_prompt %}<assistant>{% endif %}")
    text = chat_of_turns(hf, ["def add(a, b):", "Again, with a docstring."], 8)
    first = hf.tokenizer.encode("<user>def add(a, b):\n<assistant>", add_special_tokens=False)
    answer = hf.tokenizer.decode(hf.generate([first], 8)[0], skip_special_tokens=True).strip()
    assert answer and text == (f"<user>def add(a, b):\n<assistant>{answer}\n"
                               f"<user>Again, with a docstring.\n<assistant>")


def test_draft_stop_reaches_the_engine_cells(bench_inputs):
    """--draft-stop sets model.json's draft_stop_confidence of every engine cell (0: off)."""
    from exspec.bench.cli import parse_args
    from exspec.bench.methods import CellKey, EngineMethod
    _, args = bench_inputs
    for flag, expected, stops in (("0", 0.0, False), ("auto", "auto", True)):
        parsed = parse_args(list(args) + ["--draft-stop", flag])
        cell = EngineMethod(CellKey("exspec", 1, 3, True, None), parsed, 2)
        assert cell.engine.config.draft_stop_confidence == expected
        assert (cell.engine.pool.scheduler.draft_stop is not None) == stops


PROMPT = json.dumps({"question_id": 0, "category": "code", "turns": ["def add(a, b):\n"]}) + "\n"
BAD_FLAGS = {   # case: (the prompts file's text or None for none, flags, words of the error)
    "missing prompts file": (None, [], "--prompts p.jsonl: No such file or directory"),
    "prompts not JSONL": ("turns: [a]\n", [], "p.jsonl:1 is not JSON"),
    "a prompt without turns": (PROMPT + '{"question_id": 1}\n', [],
                               'p.jsonl:2: "turns" must be a non-empty list of texts'),
    "batch sizes not numbers": (PROMPT, ["--batch-sizes", "1,x"],
                                "--batch-sizes: a comma list of batch sizes >= 1, got '1,x'"),
    "k zero": (PROMPT, ["-k", "0"], "-k must be >= 1, got 0"),
    "fixed k above k": (PROMPT, ["-k", "3", "--fixed-k", "0,4"], "--fixed-k: a comma list of k's in 0..3"),
    "no tokens": (PROMPT, ["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    "draft stop past 1": (PROMPT, ["--draft-stop", "1.5"], "--draft-stop: auto or a confidence in [0, 1)"),
    "top-p zero": (PROMPT, ["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    "warm prompts leaving none": (PROMPT, ["--num-prompts", "2", "--warm-prompts", "2"],
                                  "--warm-prompts 2 leaves none of --num-prompts 2 to time"),
    "target not there": (PROMPT, ["--target", "./no-target"], "--target path does not exist: ./no-target"),
    "head without config": (PROMPT, ["--eagle3", "."], "--eagle3 .: no config.json there"),
    "out a file": (PROMPT, ["--out", "p.jsonl"], "--out p.jsonl is a file; give a folder path"),
    "unknown compile backend": (PROMPT, ["--paths", "compiled", "--compile-backend", "fast"],
                                "--compile-backend 'fast': not a torch.compile backend"),
    "read in place, no exspec method": (PROMPT, ["--paths", "in_place", "--methods", "autoregressive,eqspec"],
                                        "--paths in_place reads EXSPEC's block store: add an exspec method"),
}
# one case of each kind runs the real command in a process of its own (~10 s each on a busy
# CPU); the others call its main() here, the same code
REAL = ("missing prompts file", "prompts not JSONL", "batch sizes not numbers", "k zero",
        "target not there")


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_a_bad_flag_or_file_is_one_line_naming_it_before_any_model_loads(tmp_path, capsys,
                                                                         monkeypatch, case):
    """A bad file, list or number is argparse's one line (exit code 2) naming the flag, no
    traceback, before any set-up (which prints the threads line) or model load."""
    text, flags, words = BAD_FLAGS[case]
    if text is not None:
        (tmp_path / "p.jsonl").write_text(text)
    argv = ["--prompts", "p.jsonl", *flags]
    if case in REAL:
        done = subprocess.run([sys.executable, "-m", "exspec.bench", *argv], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        code, out, err = done.returncode, done.stdout, done.stderr
    else:
        monkeypatch.chdir(tmp_path)
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        code, (out, err) = exit_.value.code, capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, f"{case}: exit {code}: {err}"
    assert lines[-1].startswith("exspec-bench: error: ") and words in lines[-1], \
        f"{case}: {words!r} not in {lines[-1]!r}"
    # argparse's usage, then its error: nothing else ran
    assert all(line.startswith(("usage:", " ")) for line in lines[:-1]) and not out, f"{case}: {err}"
