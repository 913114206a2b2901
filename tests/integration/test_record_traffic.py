"""model.json's record_traffic through a real tritonserver: each completed request becomes one
JSONL line per sample, as the offline replay reads it (backend/exspec_traffic.py), with the
prompt as the model saw it and the output ids the client received; the replay reads the file;
the file rotates past max_bytes; a refused or cancelled request writes nothing.

One server of its own, two models on the exspec test pair: `recorded` (a large cap) and
`rotated` (a cap of a few lines)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from clients import event_ids, first_response_then_cancel, generate, grpc_inputs, grpc_stream
from serverkit import MODELS, scrape, wait_for
from exspec.demo.tiny import build_tokenizer, llama, noisy_copy, save_pair
from exspec.serving.launcher import TritonServer
from modelrepo import write_model

ROTATE_BYTES = 300   # two or three lines of the rotation test's requests
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]


def lines_of(path: Path) -> list[dict]:
    return [json.loads(raw) for raw in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    root = tmp_path_factory.mktemp("record-traffic")
    tokenizer = build_tokenizer()
    target = llama(len(tokenizer), 11, layers=2, hidden=64, max_positions=512,
                   eos_token_id=tokenizer.eos_token_id)
    pair = root / "pairs" / "exspec"
    save_pair(pair, tokenizer, target, noisy_copy(target, 12, scale=0.05))
    repo = root / "models"
    write_model(repo, "recorded", pair, {**MODELS["exspec"], "record_traffic": {
        "path": str(root / "served.jsonl"), "max_bytes": 1 << 20}})
    write_model(repo, "rotated", pair, {**MODELS["exspec"], "record_traffic": {
        "path": "rotated.jsonl", "max_bytes": ROTATE_BYTES}})   # relative: the version folder's
    with TritonServer(repo, free_ports=True, startup_timeout_s=300,
                      log_path=root / "tritonserver.log") as server:
        yield server, root, AutoTokenizer.from_pretrained(pair / "tokenizer")


@pytest.fixture(scope="module")
def served(recording):
    """A few requests of each shape to `recorded`, each labelled by its category (lines are
    written as requests finish, so not necessarily in this order); returns what each client
    received, by category: [(output ids, finish reason)] per sample, and the file's lines."""
    server, root, _ = recording
    url = server.urls["grpc"]
    received = {}
    for category, request in [
        ("text", {"prompt": "hello world", "sampling": {"max_tokens": 6, "category": "text"}}),
        ("stream", {"prompt": "the quick", "stream": True,
                    "sampling": {"max_tokens": 9, "category": "stream"}}),
        ("ids", {"input_ids": [5, 6, 7, 8], "stream": True, "sampling": {"max_tokens": 7},
                 "parameters": {"category": "ids"}}),          # a gRPC request parameter
        ("", {"input_ids": [9, 10, 11], "sampling": {"max_tokens": 4}}),   # no category
    ]:
        call = grpc_stream(url, "recorded", [{**request, "return_finish_reason": True}])[0]
        assert call.finished and all(r.error is None for r in call.responses), (category, call)
        reasons = [r.outputs["finish_reason"].reshape(-1)[0].decode() for r in call.responses
                   if "finish_reason" in r.outputs]
        received[category] = [(call.ids(), reasons[-1])]
    # n = 2, sampled: the samples' ids one after another, num_output_tokens splits them
    call = grpc_stream(url, "recorded", [{
        "prompt": "abc", "return_num_output_tokens": True, "return_finish_reason": True,
        "sampling": {"n": 2, "temperature": 1.0, "seed": 3, "max_tokens": 5, "category": "n2"}}])[0]
    assert call.finished and all(r.error is None for r in call.responses), call
    final = call.responses[-1].outputs
    counts = [int(c) for c in final["num_output_tokens"].reshape(-1)]
    ids = call.ids()
    reasons = [r.decode() for r in final["finish_reason"].reshape(-1)]
    received["n2"] = [(ids[:counts[0]], reasons[0]), (ids[counts[0]:], reasons[1])]
    # a chat over HTTP generate, its category a top-level key (a request parameter)
    status, body = generate(server.urls["http"], "recorded", {
        "messages": json.dumps(CHAT), "max_tokens": 5, "category": "chat", "return_finish_reason": True})
    assert status == 200, body
    received["chat"] = [(event_ids(body), body["finish_reason"])]

    path = root / "served.jsonl"
    total = sum(len(samples) for samples in received.values())
    wait_for(lambda: len(lines_of(path)) >= total, what=f"{total} lines in {path}")
    return received, lines_of(path)


def test_each_finished_sample_is_one_line_with_the_prompt_the_model_saw_and_the_ids_sent(recording, served):
    _, _, tokenizer = recording
    received, lines = served
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)   # noqa: E731 (the engine's)
    prompts = {"text": encode("hello world"), "stream": encode("the quick"), "ids": [5, 6, 7, 8],
               "": [9, 10, 11], "n2": encode("abc"),
               "chat": encode(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                            tokenize=False))}
    assert prompts["chat"] != encode("hi there")   # the template's own text is in it
    by_category: dict[str, list[dict]] = {}
    for line in lines:
        by_category.setdefault(line.get("category", ""), []).append(line)
    assert sorted(by_category) == sorted(received), (sorted(by_category), lines)
    for category, samples in received.items():
        got = sorted(by_category[category], key=lambda line: line.get("sample", 0))
        assert len(got) == len(samples), f"{category!r}: {len(got)} lines for {len(samples)} samples"
        for index, (line, (ids, reason)) in enumerate(zip(got, samples)):
            where = f"{category!r} sample {index}"
            assert line["prompt_token_ids"] == prompts[category], \
                f"{where}: prompt {line['prompt_token_ids']} != {prompts[category]}"
            assert line["output_token_ids"] == ids, f"{where}: output {line['output_token_ids']} != sent {ids}"
            assert ids, f"{where}: the client received no ids"
            assert line["finish_reason"] == reason, f"{where}: {line['finish_reason']} != sent {reason}"
            assert line.get("sample") == (index if len(samples) > 1 else None), (where, line)
    assert received["n2"][0][0] != received["n2"][1][0], "n = 2 sampled twice the same: a weak check"


def test_the_replay_reads_the_recorded_file(recording, served):
    _, root, _ = recording
    done = subprocess.run([sys.executable, "-m", "exspec.bench.replay", "--traces",
                           str(root / "served.jsonl"), "--no-progress"],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    header = next((row for row in done.stdout.splitlines()
                   if row.startswith("| tokens per target step")), None)
    assert header is not None, done.stdout
    for category in ("all", "chat", "ids", "n2", "stream", "text"):
        assert f"| {category} " in header + " ", (category, header)
    assert f"{len(served[1])} traces replayed" in done.stdout, done.stdout
    assert "| ngram, k = 5 |" in done.stdout and "| suffix, k = 5 |" in done.stdout, done.stdout


def test_past_max_bytes_the_file_rotates_to_path_1_keeping_one_old_file(recording):
    server, root, _ = recording
    path = root / "models" / "rotated" / "1" / "rotated.jsonl"
    for i in range(6):   # one after another: lines in this order
        call = grpc_stream(server.urls["grpc"], "rotated", [{
            "input_ids": [5 + i, 6, 7], "sampling": {"max_tokens": 8, "category": f"r{i}"}}])[0]
        assert call.finished and all(r.error is None for r in call.responses), call
    wait_for(lambda: any(line["category"] == "r5" for line in lines_of(path)),
             what=f"the last request's line in {path}")
    old, new = Path(f"{path}.1"), path
    kept = [line["category"] for line in lines_of(old) + lines_of(new)]
    assert old.exists() and lines_of(old), f"{old} was never written: kept {kept}"
    for file in (old, new):
        assert file.stat().st_size <= ROTATE_BYTES, f"{file} is {file.stat().st_size} bytes"
    assert 2 <= len(kept) < 6 and kept == [f"r{i}" for i in range(6 - len(kept), 6)], \
        f"kept {kept}: not the latest lines in order, or nothing rotated away"


def test_a_refused_or_cancelled_request_writes_nothing(recording, served):
    server, root, _ = recording
    url = server.urls["grpc"]
    path = root / "served.jsonl"
    before = len(lines_of(path))
    for request in [
        {"prompt": "hi", "sampling": {"temperature": -1, "category": "refused-parse"}},
        {"prompt": "hi", "sampling": {"max_tokens": 100000, "category": "refused-engine"}},
    ]:
        call = grpc_stream(url, "recorded", [request])[0]
        assert call.responses and call.responses[-1].error, (request, call)
    cancelled = scrape(server, "exspec:requests_total", model="recorded", outcome="cancelled")
    first_response_then_cancel(url, "recorded", grpc_inputs(
        prompt="hello", stream=True,
        sampling={"max_tokens": 480, "ignore_eos": True, "category": "cancelled"}))
    wait_for(lambda: scrape(server, "exspec:requests_total", model="recorded",
                            outcome="cancelled") == cancelled + 1, what="the cancellation")
    call = grpc_stream(url, "recorded", [{"prompt": "hi", "sampling": {"max_tokens": 3,
                                                                         "category": "after"}}])[0]
    assert call.finished and all(r.error is None for r in call.responses), call
    wait_for(lambda: any(line.get("category") == "after" for line in lines_of(path)),
             what="the completed request's line")
    written = [line.get("category") for line in lines_of(path)[before:]]
    assert written == ["after"], f"lines written since: {written}"

