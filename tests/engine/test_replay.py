"""The offline replay (bench/replay.py): on greedy traces it takes the engine's own steps. The
engine serves requests one at a time at a fixed k with prompt lookup and suffix decoding; the
replay of their outputs must count, request by request, the same decode steps and propose the
same tokens. Then the command as a user runs it: text traces, warm-up, k's, refusals."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from exspec import SamplingParams
from exspec.bench import replay
from exspec.demo.tiny import build_tokenizer

from enginekit import make_engine
from test_ngram import cyclic_target


@pytest.fixture(scope="module")
def cyclic(tmp_path_factory):
    path = tmp_path_factory.mktemp("cyclic") / "target"
    return str(path), cyclic_target(path, len(build_tokenizer()))


@pytest.mark.parametrize("sampling", [{}, {"temperature": 8.0}], ids=["greedy", "seeded"])
@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    {"method": "suffix", "num_speculative_tokens": 3},
])
def test_replay_counts_the_engines_own_steps_request_by_request(pairs, cyclic, spec, sampling):
    """The output cycles through the target's successor cycle of the prompt's last token; the
    prompt holds each token of that cycle followed by a wrong one, so lookups in it propose
    wrong continuations (rejected) until the output's own first cycle is there to match (kept).
    Later requests ask again (suffix decoding's global tree proposes the answer seen). Seeded
    sampling (the gumbel coupling) keeps a proposed token where the target draws it: the
    recorded output replays as exactly as a greedy one."""
    target, successor = cyclic
    rng = random.Random(3)
    vocab = len(successor)
    prompts, cycles = [], []
    for _ in range(4):
        cycle = [rng.randrange(1, vocab)]
        while successor[cycle[-1]] != cycle[0]:
            cycle.append(successor[cycle[-1]])
        wrong = [rng.choice([t for t in range(1, vocab) if t != successor[c]]) for c in cycle]
        prompts.append([t for pair in zip(cycle, wrong) for t in pair] + cycle[:1])
        cycles.append(cycle)
    prompts += [p[:] for p in prompts[:2]]   # asked again: the answer was seen
    cycles += cycles[:2]
    # the second request and its repeat end at a stop token, within a proposal that runs past it
    stops = {1: [cycles[1][4]], 5: [cycles[1][4]]}
    keys = {k: v for k, v in spec.items() if k not in ("method", "num_speculative_tokens")}
    engine = make_engine(pairs, target_model=target, draft_model=None, method="exspec",
                         proposer=spec["method"], num_speculative_tokens=3, adaptive_k=False,
                         max_batch_size=1, max_num_seqs=1, **keys)
    traces, steps, proposed = [], [], []
    for i, prompt in enumerate(prompts):
        before = engine.stats()
        params = SamplingParams(max_tokens=16 + 3 * i, ignore_eos=True, seed=40 + i,
                                stop_token_ids=stops.get(i, []), **sampling)
        [out] = engine.generate([prompt], params)
        after = engine.stats()
        traces.append(replay.Trace(prompt, out.token_ids))
        steps.append(after["steps"] - before["steps"])
        proposed.append(after["draft_tokens"] - before["draft_tokens"])

    proposer, k = replay.proposer_of(spec)
    tallies = [replay.replay_one(proposer, t, k) for t in traces]
    assert [t.steps for t in tallies] == steps
    assert [t.proposed for t in tallies] == proposed
    kept = sum(t.kept for t in tallies)
    assert 0 < kept < sum(proposed), (kept, proposed)   # both kept and rejected proposals
    assert all(t.tokens == len(tr.output_ids) - 1 for t, tr in zip(tallies, traces))
    drawn = [(a, b) for tr in traces for a, b in zip(tr.output_ids, tr.output_ids[1:])]
    off_cycle = sum(b != successor[a] for a, b in drawn)
    # seeded at a high temperature: many draws leave the cycle (59 of 135), yet some proposals hold
    assert (off_cycle > 0) == bool(sampling), off_cycle


def test_the_command_replays_text_traces_per_category_and_k(pairs, tmp_path, capsys):
    """Text through the tokenizer, the first trace served but not counted, each configuration at
    each k a row, each category a column; the JSON holds the same tallies."""
    tokenizer = pairs["tokenizer"]
    answer = "def add(a, b):\n    return a + b\n"
    rows = [{"prompt": "Write add.", "output": answer, "category": "code"},
            {"prompt": "Write add again.", "output": answer, "category": "code"},
            {"prompt": "Say hi.", "output": "hi there, hi there, hi there", "category": "chat"}]
    traces = tmp_path / "traces.jsonl"
    traces.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "tallies.json"
    assert replay.main(["--traces", str(traces), "--tokenizer", tokenizer, "--warm", "1",
                        "-k", "2,4", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 traces replayed (after 1 served first)" in text
    assert "| chat | code |" in text
    labels = [line.split("|")[1].strip() for line in text.splitlines()
              if line.startswith("| ngram") or line.startswith("| suffix")]
    assert labels == ["ngram, k = 2", "ngram, k = 4", "suffix, k = 2", "suffix, k = 4"]
    tallies = json.loads(out.read_text())
    assert [t["config"]["num_speculative_tokens"] for t in tallies] == [2, 4, 2, 4]
    suffix_4 = tallies[3]["tallies"]
    # the second "add" repeats the warm first one's answer: suffix decoding proposes it whole
    assert suffix_4["code"]["kept"] > 0
    assert suffix_4["all"]["steps"] == suffix_4["code"]["steps"] + suffix_4["chat"]["steps"]
    assert suffix_4["code"]["tokens_per_step"] > tallies[2]["tallies"]["code"]["tokens_per_step"] > 1


ONE_TRACE = json.dumps({"prompt_token_ids": [1, 2], "output_token_ids": [3, 4]}) + "\n"
BAD = {   # case: (the traces file's text or None for none, flags, words of the error)
    "missing traces file": (None, [], "t.jsonl: No such file or directory"),
    "traces not JSONL": ("prompt: a\n", [], "t.jsonl:1 is not JSON"),
    "a trace not an object": (ONE_TRACE + "[1, 2]\n", [], "t.jsonl:2 holds a list, not a JSON object"),
    "a trace without output": ('{"prompt_token_ids": [1]}\n', [],
                               'no "output" (text) nor "output_token_ids"'),
    "token ids not ids": ('{"prompt_token_ids": [1], "output_token_ids": ["a"]}\n', [],
                          "output_token_ids must be a list of token ids"),
    "text without a tokenizer": ('{"prompt": "a", "output": "b"}\n', [], "t.jsonl:1 holds text: give --tokenizer"),
    "k not a number": (ONE_TRACE, ["-k", "2,x"], "-k: a comma list of k >= 1, got '2,x'"),
    "k zero": (ONE_TRACE, ["-k", "0"], "-k: a comma list of k >= 1, got '0'"),
    "config not JSON": (ONE_TRACE, ["--speculative-config", "{method: suffix}"], "--speculative-config: not JSON"),
    "config at k zero": (ONE_TRACE, ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
                         "num_speculative_tokens must be >= 1"),
    "config of a model": (ONE_TRACE, ["--speculative-config", '{"method": "eagle3", "model": "head"}'],
                          "'ngram' or 'suffix'"),
    "config the engine refuses": (ONE_TRACE, ["--speculative-config", '{"method": "suffix", '
                                              '"suffix_decoding_min_token_prob": 2}'], "suffix_decoding_min_token_prob"),
    "warm leaving none": (ONE_TRACE, ["--warm", "1"], "--warm 1 leaves none of the 1 traces to count"),
    "tokenizer not there": (ONE_TRACE, ["--tokenizer", "./no-tokenizer"], "--tokenizer path does not exist"),
    "out in no folder": (ONE_TRACE, ["--out", "no-folder/tallies.json"], "its folder no-folder does not exist"),
    "save-traces beside traces": (ONE_TRACE, ["--save-traces", "out.jsonl"],
                                  "--save-traces writes the traces --prompt-set makes"),
}


# one case of each kind runs the real command in a process of its own (~10 s each on a busy
# CPU); the others call its main() here, the same code
REAL = ("missing traces file", "traces not JSONL", "a trace without output", "k zero",
        "config not JSON", "config at k zero")


def refusal(argv: list[str], cwd, real: bool, capsys, monkeypatch) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the replay command refusing `argv`."""
    if real:
        done = subprocess.run([sys.executable, "-m", "exspec.bench.replay", *argv], cwd=cwd,
                              capture_output=True, text=True, timeout=300)
        return done.returncode, done.stdout, done.stderr
    monkeypatch.chdir(cwd)
    with pytest.raises(SystemExit) as exit_:
        replay.main(argv)
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_flag_or_file_is_one_line_naming_it_before_any_work(tmp_path, capsys, monkeypatch, case):
    """The command as a user runs it: a bad flag, file or configuration is argparse's one line
    (exit code 2) naming it, no traceback, and nothing runs after the flags are read."""
    text, flags, words = BAD[case]
    if text is not None:
        (tmp_path / "t.jsonl").write_text(text)
    code, out, err = refusal(["--traces", "t.jsonl", *flags], tmp_path, case in REAL, capsys, monkeypatch)
    error = err.strip().splitlines()[-1] if err.strip() else ""
    assert code == 2 and "Traceback" not in err, f"{case}: exit {code}: {err}"
    assert error.startswith("python -m exspec.bench.replay: error: ") and words in error, \
        f"{case}: {words!r} not in {error!r}"
    assert not out, f"{case}: work began: {out}"


def test_traces_made_from_a_shipped_prompt_set_are_saved_and_replayed(tmp_path, capsys):
    """--prompt-set: the demo pair's target answers the set greedily here, the traces are
    written as JSONL the command reads back, and replaying that file prints the same table."""
    saved = tmp_path / "repeated.jsonl"
    args = ["--pair", "demo", "--num-prompts", "3", "--max-tokens", "6", "--no-progress", "-k", "3"]
    assert replay.main(["--prompt-set", "repeated", "--save-traces", str(saved), *args]) == 0
    made = capsys.readouterr().out
    lines = [json.loads(line) for line in saved.read_text().splitlines()]
    assert len(lines) == 3 and {line["category"] for line in lines} == {"tool_call", "sql"}
    assert all(1 <= len(line["output_token_ids"]) <= 6 and line["prompt_token_ids"] for line in lines)
    assert replay.main(["--traces", str(saved), "-k", "3"]) == 0
    table = lambda text: text[text.index("| tokens per target step"):]
    assert table(capsys.readouterr().out) == table(made)
