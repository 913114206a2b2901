"""The traffic recorder's writer (backend/exspec_traffic.py), without Triton: it never blocks
the send thread (a full queue drops and counts), it rotates past max_bytes keeping one old
file, and a write that fails is counted for the send thread to log. Served end to end:
tests/integration/test_record_traffic.py."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "backend"))
from exspec_traffic import TrafficLog, TrafficSettings  # noqa: E402


def line(i: int) -> dict:
    return {"prompt_token_ids": [1, 2, 3], "output_token_ids": [i] * 10, "finish_reason": "stop",
            "category": f"c{i}"}


def lines_of(path: Path) -> list[dict]:
    return [json.loads(raw) for raw in path.read_text().splitlines()] if path.exists() else []


def test_a_full_queue_drops_and_counts_without_blocking_and_news_says_so_once(tmp_path):
    path = tmp_path / "served.jsonl"
    log = TrafficLog(TrafficSettings(str(path)), queue_records=2)   # writer not started: nothing drains
    started = time.monotonic()
    log.offer([line(0), line(1), line(2)])
    log.offer([line(3)])
    assert time.monotonic() - started < 0.5, "offer blocked on a full queue"
    assert log.dropped == 2, log.dropped
    news = log.news()
    assert news is not None and "dropped 2 records" in news and str(path) in news, news
    assert log.news() is None, "the same drops reported twice"
    log.start()
    log.close()
    assert [r["category"] for r in lines_of(path)] == ["c0", "c1"]


def test_past_max_bytes_the_file_becomes_path_1_and_a_new_one_begins(tmp_path):
    path = tmp_path / "served.jsonl"
    size = len(json.dumps(line(0), separators=(",", ":"))) + 1
    log = TrafficLog(TrafficSettings(str(path), max_bytes=2 * size))   # two lines a file
    log.start()
    log.offer([line(i) for i in range(5)])
    log.close()
    assert [r["category"] for r in lines_of(Path(f"{path}.1"))] == ["c2", "c3"]
    assert [r["category"] for r in lines_of(path)] == ["c4"]
    assert log.news() is None


def test_a_rotation_that_fails_is_counted_for_the_send_thread_to_log_and_writing_goes_on(tmp_path):
    path = tmp_path / "served.jsonl"
    (tmp_path / "served.jsonl.1").mkdir()
    (tmp_path / "served.jsonl.1" / "keep").write_text("")   # the rotation's rename fails
    log = TrafficLog(TrafficSettings(str(path), max_bytes=10))
    log.start()
    log.offer([line(0), line(1)])
    log.close()
    assert log.write_errors == 1, log.write_errors
    news = log.news()
    assert news is not None and "1 write or rotation errors" in news, news
    assert [r["category"] for r in lines_of(path)] == ["c0", "c1"], "the writer stopped writing"
