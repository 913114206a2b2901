"""The real pair's EAGLE-3 training script end to end in its tiny configuration (scripts/
train_smollm2_eagle3.py --tiny): a head trained on question and answer positions that serves
through the engine, a continuation of it (--init), and the refusal of a head whose draft
vocabulary is not the data's. `make test-slow`: ~5 min on 2 cores."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from exspec.models.real_pair import HEAD_DIR, ensure_pair  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "train_smollm2_eagle3.py"

pytestmark = pytest.mark.slow


def _train(tmp: Path, out: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--questions-too", "--threads", "1",
                           "--work", str(tmp / "work"), "--out", str(tmp / out), *extra],
                          capture_output=True, text=True, timeout=900)


def test_tiny_head_trains_continues_and_refuses_another_vocabulary(tmp_path):
    ensure_pair()
    first = _train(tmp_path, "head")
    assert first.returncode == 0, first.stderr[-3000:]
    metrics = json.loads((tmp_path / "head" / "metrics.json").read_text())
    # the question's positions were trained on, the answers' alone measured
    assert metrics["trained_positions"] > metrics["answer_tokens"] > 0
    assert len(metrics["held_out_agreement_per_step"]) == 3
    assert metrics["engine_acceptance"]["draft_tokens"] > 0   # the head served through the engine
    assert (tmp_path / "head" / "model.safetensors").stat().st_size < 30 * 1000 * 1000

    more = _train(tmp_path, "head2", "--init", str(tmp_path / "head"))
    assert more.returncode == 0, more.stderr[-3000:]
    continued = json.loads((tmp_path / "head2" / "metrics.json").read_text())
    assert continued["settings"]["init"] == str(tmp_path / "head")
    # its own checkpoint: the first run's finished schedule is not taken for it
    assert len(list((tmp_path / "work").glob("ckpt-*-init*.pt"))) == 1
    assert (tmp_path / "head2" / "model.safetensors").read_bytes() != \
        (tmp_path / "head" / "model.safetensors").read_bytes()

    refused = _train(tmp_path, "head3", "--init", str(HEAD_DIR))   # 8,192 draft ids, tiny has 2,048
    assert refused.returncode != 0
    assert "draft vocabulary" in refused.stderr and "--init" in refused.stderr
