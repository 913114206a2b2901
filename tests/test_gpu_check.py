"""`make gpu-check`'s script (exspec.bench.gpu_check) on the CPU: its --smoke run (tiny shapes, a
few tokens, one torch thread) writes report.json and report.md with every phase, compares the
three methods' outputs for real, and finds nothing compiled after READY; a phase that raises
fails alone, and a run killed mid-way leaves the phases it finished in its report. The
calibrated pair, the comparison and pytest's closing line are checked directly too."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from exspec.bench import gpu_check
from exspec.bench.equivalence import Reference
from exspec.bench.methods import CellKey, Run

PHASES = list(gpu_check.PHASES)


def run_check(out, *flags, code=None, timeout=240):
    """The script in a subprocess (its compile backend and signal handlers stay its own);
    `code`: Python run first in that process, to plant a failure."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    argv = ["--out", str(out), "--smoke", *flags]
    if code is None:
        cmd = [sys.executable, "-m", "exspec.bench.gpu_check", *argv]
    else:
        cmd = [sys.executable, "-c", textwrap.dedent(code) + f"\nsys.exit(g.main({argv!r}))"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    return proc, time.perf_counter() - start


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    proc, wall = run_check(out)
    print(f"gpu-check --smoke: {wall:.1f} s wall")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "report.json").read_text()), (out / "report.md").read_text(), proc


def test_smoke_run_writes_both_reports_with_every_phase(smoke):
    out, report, md, proc = smoke
    assert report["status"] == "passed"
    assert list(report["phases"]) == PHASES
    assert {p["status"] for p in report["phases"].values()} <= {"passed", "skipped"}
    assert report["phases"]["gpu_tests"]["status"] == "skipped"
    assert report["phases"]["gpu_tests"]["summary"].startswith("skipped:")
    for name in PHASES:
        assert f"| {name} |" in md
    assert report["machine"]["torch"] == torch.__version__ and report["machine"]["transformers"]
    assert str(out / "report.md") in proc.stdout


def test_smoke_ready_times_both_engines_on_the_calibrated_pair(smoke):
    ready = smoke[1]["phases"]["ready"]
    engines = {(e["method"], e["batch_size"]): e for e in ready["engines"]}
    assert set(engines) == {(m, b) for m in ("exspec", "autoregressive") for b in (1, 8)}
    assert all(e["ready_s"] > 0 for e in engines.values())
    # the first engine of each method compiled its forwards in its warm-up (the compiled path)
    assert engines["exspec", 1]["graphs"] > 0 and engines["autoregressive", 1]["graphs"] > 0
    cal = ready["pair"]["calibration"]
    assert abs(cal["agreement"] - cal["goal"]) < 0.1, cal
    assert ready["pair"]["draft_layers"] < ready["pair"]["target_layers"]


def test_smoke_interleaved_cells_compare_outputs_for_real(smoke):
    _, report, md, _ = smoke
    timed = report["phases"]["interleaved"]
    cells = {(c["method"], c["batch_size"]): c for c in timed["cells"]}
    assert set(cells) == {(m, b) for m in ("hf_generate", "autoregressive", "exspec") for b in (1, 8)}
    assert timed["repeats_done"] == 2
    for cell in cells.values():
        assert len(cell["tokens_per_s_runs"]) == 2 and cell["tokens_per_s"] > 0
        assert cell["exact_match_share"] == 1.0 and cell["mismatches"] == 0
    assert cells["exspec", 1]["acceptance_rate"] > 0   # the draft's tokens were kept
    for batch in ("1", "8"):
        assert timed["per_batch"][batch]["equal_across_methods"] is True
        assert timed["per_batch"][batch]["exspec_vs_autoregressive"] > 0
    assert "outputs equal across the three" in md


def test_smoke_step_diagnostics_and_nothing_compiled_after_ready(smoke):
    diag = smoke[1]["phases"]["step_diagnostics"]
    assert diag["after_ready"]["graphs"] == 0 and diag["after_ready"]["graph_breaks"] == 0
    assert diag["after_ready"]["new_shapes"] == []
    assert diag["after_ready"]["eager_forwards"] == 0   # counted across the engines' forwards
    for method in ("autoregressive", "exspec"):
        steps = diag["engines"][method]
        assert steps["profiled_steps"] > 0
        assert 0 < len(steps["top_ops"]) <= gpu_check.TOP_OPS
        assert steps["top_ops"][0]["self_ms"] >= steps["top_ops"][-1]["self_ms"] > 0
    assert "## Since READY (must be 0)" in smoke[2] and "forwards run eagerly" in smoke[2]


def test_smoke_reading_in_place_serves_exspec_exactly_and_builds_every_graph_before_ready(tmp_path):
    """--path in_place: exspec's engines read the block store in place (FlexAttention, a graph
    per width), what a lent GPU checks first for that path; on the CPU its smoke run at one
    batch size: exact, nothing compiled after READY."""
    proc, _ = run_check(tmp_path, "--path", "in_place", "--batch-sizes", "2", "--skip-tests")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    exspec = next(e for e in report["phases"]["ready"]["engines"] if e["method"] == "exspec")
    assert "KV read in place" in exspec["warm_up"] and exspec["kv_tokens"] > 0
    cells = report["phases"]["interleaved"]["cells"]
    assert all(c["exact_match_share"] == 1.0 for c in cells) and len(cells) == 3
    after = report["phases"]["step_diagnostics"]["after_ready"]
    assert after["graphs"] == 0 and after["eager_forwards"] == 0 and after["new_shapes"] == []


def test_a_failed_phase_and_a_kill_leave_the_earlier_phases_in_the_report(tmp_path):
    """interleaved raises (the run goes on), then step_diagnostics is killed by SIGTERM, as the
    Makefile's `timeout` would: both reports hold ready's results and each failure."""
    proc, _ = run_check(tmp_path, "--batch-sizes", "1", code="""
        import os, signal, sys, time
        import exspec.bench.gpu_check as g

        def planted(check, entry):
            raise RuntimeError("planted failure")

        def killed(check, entry):
            entry["reached"] = True
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)

        g.PHASES["interleaved"], g.PHASES["step_diagnostics"] = planted, killed
    """)
    assert proc.returncode == 1, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    phases = report["phases"]
    assert report["status"] == "killed"
    assert phases["gpu_tests"]["status"] == "skipped"
    assert phases["ready"]["status"] == "passed" and len(phases["ready"]["engines"]) == 2
    assert phases["interleaved"]["status"] == "failed"
    assert "planted failure" in phases["interleaved"]["error"]
    assert phases["step_diagnostics"]["status"] == "failed" and phases["step_diagnostics"]["reached"]
    assert "killed (SIGTERM)" in phases["step_diagnostics"]["error"]
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# gpu-check: killed") and "planted failure" in md
    assert not list(tmp_path.glob(".*.part"))


def test_the_comparison_reports_a_changed_token_and_equal_outputs():
    """Negative control of the equality check: rows equal to the reference are equal across
    methods; one token changed in exspec's row is a mismatch, and no near tie."""
    pair, _ = gpu_check.build_pair("tiny", "cpu", "float32", seed=3, goal=0.75)
    hf = gpu_check.PairModels(pair, "float32", "cpu")
    prompts = gpu_check.random_prompts(3, len(pair.tokenizer), seed=3)
    reference = Reference(hf, prompts, 6, progress=False)
    keys = [CellKey("hf_generate", 1, 0, None), CellKey("autoregressive", 1, 0, None),
            CellKey("exspec", 1, 4, False)]

    def runs(change: bool) -> dict:
        out = {key: [Run(1.0, [list(ids) for ids in reference.ids])] for key in keys}
        if change:
            row = out[keys[2]][0].outputs[1]
            row[2] = (row[2] + 1) % hf.target.config.vocab_size
        return out

    same = gpu_check.compare(reference, runs(False), [1])
    assert same["per_batch"][1]["equal_across_methods"] is True
    assert all(c["mismatches"] == 0 for c in same["cells"])
    changed = gpu_check.compare(reference, runs(True), [1])
    cells = {c["method"]: c for c in changed["cells"]}
    assert changed["per_batch"][1]["equal_across_methods"] is False
    assert cells["exspec"]["mismatches"] == 1 and cells["exspec"]["not_near_tie"] == 1
    assert cells["hf_generate"]["mismatches"] == cells["autoregressive"]["mismatches"] == 0
    assert changed["mismatch_examples"][0]["position"] == 2


def test_the_8b_recipe_at_a_small_size_calibrates_a_draft_of_shared_layers():
    """The large shape's builder (Qwen3, its own init) at a few layers on the CPU: the draft is
    the target's first layers, the same tensors, and agrees with it as asked; a lower goal
    takes a larger scale of the later layers."""
    from exspec.demo.tiny import build_tokenizer
    shape = {"arch": "qwen3", "draft_layers": 2,
             "config": dict(gpu_check.SHAPES["8b"]["config"], vocab_size=1024, hidden_size=64,
                            intermediate_size=192, num_hidden_layers=6, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)}
    tok = build_tokenizer()
    ids = torch.randint(1, len(tok), (8, 32), generator=torch.Generator().manual_seed(0))
    found = {}
    for goal in (0.5, 0.9):
        target = gpu_check.random_target(shape, len(tok), tok.eos_token_id, "cpu", "float32", seed=0)
        draft = gpu_check.first_layers(target, 2)
        assert len(draft.model.layers) == 2 and draft.config.layer_types == ["full_attention"] * 2
        assert draft.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
        assert (draft.model.layers[1].mlp.down_proj.weight.data_ptr()
                == target.model.layers[1].mlp.down_proj.weight.data_ptr())
        assert draft.model.layers[0] is not target.model.layers[0]
        found[goal] = gpu_check.calibrate(target, draft, 2, goal, ids)
        assert abs(found[goal]["agreement"] - goal) < 0.1, found[goal]
    assert found[0.5]["scale"] > found[0.9]["scale"]


def test_pytest_counts_reads_the_closing_line():
    text = "....s\nSKIPPED [1] tests/x.py:3: needs CUDA\n== 2 failed, 10 passed, 3 skipped in 99.1s =="
    assert gpu_check.pytest_counts(text) == {"failed": 2, "passed": 10, "skipped": 3}
    assert gpu_check.pytest_counts("no tests ran in 0.1s") == {}
