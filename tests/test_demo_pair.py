"""The built-in demo pair: the training script runs end to end (tiny configuration), and the
committed pair in model_repository/exspec/1/demo/ loads with plain transformers and generates."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "train_demo_pair.py"
DEMO = REPO / "model_repository" / "exspec" / "1" / "demo"
MAX_BYTES = 25 * 1000 * 1000


def _prompts(path: Path):
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for i, r in enumerate(rows):
        assert set(r) >= {"question_id", "category", "turns"}
        assert isinstance(r["question_id"], int) and r["category"] == "code"
        assert isinstance(r["turns"], list) and len(r["turns"]) == 1 and r["turns"][0].strip()
    assert len({r["question_id"] for r in rows}) == len(rows)
    return [r["turns"][0] for r in rows]


def _generate(tok, model, prompt: str, n: int = 8):
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    new = out[0, enc["input_ids"].shape[1]:]
    assert new.numel() == n
    assert isinstance(tok.decode(new), str)
    return new


def _check_pair(root: Path):
    tok = AutoTokenizer.from_pretrained(root / "tokenizer")
    tok_t = AutoTokenizer.from_pretrained(root / "target")
    assert tok.get_vocab() == tok_t.get_vocab()
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token_id == tok.eos_token_id
    _check_chat_template(tok)
    target = AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(root / "draft", dtype=torch.float32)
    assert target.dtype == torch.float32 and draft.dtype == torch.float32
    assert target.config.model_type == "llama" and draft.config.model_type == "llama"
    assert target.config.vocab_size == draft.config.vocab_size == len(tok)
    assert target.config.eos_token_id == draft.config.eos_token_id == tok.eos_token_id
    prompts = _prompts(root / "prompts.jsonl")
    assert prompts
    _generate(tok, target, prompts[0])
    _generate(tok, draft, prompts[0])
    card = (root / "model_card.md").read_text()
    for needle in ("Corpus", "Licence", "PSF", "mean_accepted_length", "ratio"):
        assert needle in card
    metrics = json.loads((root / "metrics.json").read_text())
    return tok, target, draft, prompts, metrics


def _check_chat_template(tok):
    """Chat clients (Triton's OpenAI frontend renders chats with the tokenizer's template) get
    the plain template: a one-message chat is exactly that completion prompt."""
    assert tok.chat_template, "the demo tokenizer has no chat template"
    one = tok.apply_chat_template([{"role": "user", "content": "def f(x):"}], tokenize=False,
                                  add_generation_prompt=True)
    assert one == "def f(x):", f"one-message chat rendered as {one!r}"
    two = tok.apply_chat_template([{"role": "system", "content": "helpers"},
                                   {"role": "user", "content": "def f(x):"}], tokenize=False,
                                  add_generation_prompt=True)
    assert two == "# helpers\ndef f(x):", f"system + user chat rendered as {two!r}"


def _total_bytes(root: Path):
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_train_script_tiny_end_to_end(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--out", str(out), "--seed", "3"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tok, target, draft, prompts, metrics = _check_pair(out)
    assert metrics["tiny"] and metrics["seed"] == 3
    assert 1.0 <= metrics["acceptance"]["mean_accepted_length"] <= 6.0
    assert metrics["cost"]["ratio_decode"] > 0
    assert _total_bytes(out) < MAX_BYTES


@pytest.mark.skipif(not ((DEMO / "target" / "model.safetensors").exists()
                         and (DEMO / "draft" / "model.safetensors").exists()),
                    reason="demo pair not built (python scripts/train_demo_pair.py)")
def test_committed_demo_pair():
    tok, target, draft, prompts, metrics = _check_pair(DEMO)
    assert len(prompts) >= 30
    assert target.get_input_embeddings().weight.shape[0] == draft.get_input_embeddings().weight.shape[0]
    # the draft is a different, much cheaper model
    n_t = sum(p.numel() for p in target.parameters())
    n_d = sum(p.numel() for p in draft.parameters())
    assert n_d * 4 < n_t
    assert draft.config.num_hidden_layers < target.config.num_hidden_layers
    assert _total_bytes(DEMO) <= MAX_BYTES
    assert not metrics["tiny"]
    assert metrics["cost"]["ratio_decode"] <= 1 / 8 and metrics["cost"]["ratio_prefill"] <= 1 / 8


def _line(out: str, pattern: str) -> re.Match:
    found = re.search(pattern, out)
    assert found, f"no line matching {pattern!r} in the demo's output:\n{out[-4000:]}"
    return found


def test_the_engine_demo_runs_both_cases_side_by_side_and_exact_on_the_demo_pair(capsys):
    """`make demo`'s first command (`python -m exspec.demo.engine`), on the committed demo pair:
    it names the processor, prints what checking 2 and 3 tokens costs against one, then both
    cases (the pair's draft on its prompts; suffix decoding on two-turn repeated asks), each
    timed against the target alone through the benchmark's `run_interleaved` over 2 repeats,
    every output of every repeat equal to target-only greedy, and the line that ties them."""
    from exspec.demo import engine as demo_engine
    from exspec.utils.machine import processor_name
    rc = demo_engine.main(["--num-prompts", "2", "--max-tokens", "8", "-k", "2", "--batch-size", "2",
                           "--repeats", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"on {processor_name()}, 1 torch thread(s)" in out, out   # the figures name their machine
    # make demo runs the compiled path (inductor), warmed up before anything is timed
    assert "the compiled decode path (--path)" in out, out
    _line(out, r"exspec: compiled decode path ready: compiled \d+ graphs in \d+\.\d s; inductor: ")
    check = _line(out, r"here checking 2/3 tokens costs (\d+\.\d\d)/(\d+\.\d\d)x one token")
    assert all(float(r) > 0 for r in check.groups()), check.group(0)
    _line(out, r"case 1, exspec, the draft model, k <= 2 on 2 code prompts: .*speed-up \d+\.\d\dx "
               r"\(median of 2: .*acceptance rate \d\.\d\d; 2/2 outputs identical to target-only greedy")
    # the suffix case drafted (an acceptance rate, not n/a) and stayed exact in both repeats
    _line(out, r"case 2, exspec, suffix decoding, k <= 2 on 2 repeated asks \(two-turn chats\): "
               r".*speed-up \d+\.\d\dx \(median of 2: .*acceptance rate \d\.\d\d; "
               r"2/2 outputs identical to target-only greedy")
    _line(out, r"why they differ: .*; the draft model committed \d+\.\d\d tokens a step, suffix "
               r"decoding \d+\.\d\d; every output exact")


def test_the_engine_demo_falls_back_to_the_eager_path_where_compiling_fails(capsys, monkeypatch):
    """A machine whose compiler fails (no C++ compiler for inductor, say): the demo says so in
    one line and runs both cases on the eager path, still exact."""
    from exspec.demo import engine as demo_engine
    from exspec.models import compiled

    def broken(*args, **kwargs):
        raise RuntimeError("InductorError: CppCompileError: no C++ compiler")
    monkeypatch.setattr(compiled, "warm_up", broken)
    rc = demo_engine.main(["--num-prompts", "1", "--max-tokens", "6", "-k", "2", "--batch-size", "1",
                           "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    _line(out, r"the compiled path failed here \(RuntimeError: InductorError: CppCompileError: no C\+\+ "
               r"compiler\); running on the eager path instead \(--path eager\)")
    assert "the eager decode path (--path)" in out, out
    _line(out, r"case 1, .*1/1 outputs identical to target-only greedy")


@pytest.mark.parametrize("seconds,regime", [
    # an AMD EPYC: the real pair's target at batch 1, 58 ms for 1 token, 93 for 2, 116 for 3
    ({1: 0.058, 2: 0.093, 3: 0.116, 4: 0.100, 5: 0.101}, "decodes mostly plainly"),
    # an Intel Xeon: about 1 + 0.14 a token beyond the first
    ({1: 0.060, 2: 0.068, 3: 0.077, 4: 0.085, 5: 0.094}, "a 2-token check is cheap here")])
def test_the_check_cost_line_says_what_the_ratios_mean(seconds, regime):
    """The demo's line on verification cost: the ratios per width, and the regime they put
    speculation in (no check cheap: plain decoding unless text repeats; a cheap one: even weak
    proposals pay)."""
    from exspec.demo.check_cost import CheckCost
    line = CheckCost(seconds, samples=7).line()
    ratios = "/".join(f"{seconds[w] / seconds[1]:.2f}" for w in (2, 3, 4, 5))
    assert f"here checking 2/3/4/5 tokens costs {ratios}x one token" in line, line
    assert regime in line, line
