"""`make demo`'s server part (exspec.demo.server) as it runs: the real pair in a real
tritonserver, chat questions streamed over gRPC speculative and autoregressive with the same
answers, one HTTP generate_stream, the OpenAI part run or skipped with its reason, the server
stopped. Slow (a second real-pair server): test_real_pair_served holds the served behaviour in
`make test`."""
from __future__ import annotations

import pytest

from exspec.demo import server as demo_server


@pytest.mark.slow
def test_demo_server_answers_chat_questions_on_the_real_pair(capsys):
    assert demo_server.main(["--num-questions", "2", "--max-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "2/2 answers identical to autoregressive" in out, out
    assert "speed-up" in out and "acceptance" in out, out
    joined = next(line for line in out.splitlines() if line.startswith("-- joined text:"))
    assert "Paris" in joined, joined   # question 2, "What is the capital of France?", over curl
    assert "== 3. OpenAI chat completion" in out, out
    assert out.rstrip().endswith("stopped."), out[-500:]
    assert "/v2/models/smollm2/generate_stream" in out, out   # the model `make serve` serves
