"""A seeded sampled request through the real server gives the same tokens on two server starts
(first among concurrent requests, then alone on a fresh server), the same as the in-process
engine; another seed gives other tokens. One extra server start: it is slow."""
from __future__ import annotations

from clients import grpc_one, grpc_stream
from serverkit import MODELS
from modelrepo import write_model

from exspec import SamplingParams
from exspec.serving.launcher import TritonServer

PROMPT = "def fibonacci(n):"
SEEDED = {"max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "seed": 4242, "ignore_eos": True}


def test_seeded_request_gives_the_same_tokens_on_two_server_starts(server, pair_dir, engine, tmp_path):
    crowd = [{"prompt": "x = " * (i + 1), "sampling": {"max_tokens": 20, "temperature": 1.0}}
             for i in range(3)]
    first = grpc_stream(server.urls["grpc"], "exspec", [{"prompt": PROMPT, "sampling": SEEDED}] + crowd)
    assert all(c.finished and not any(r.error for r in c.responses) for c in first), first
    repo = tmp_path / "models"
    write_model(repo, "exspec", pair_dir / "exspec", MODELS["exspec"])
    with TritonServer(repo, free_ports=True, startup_timeout_s=300, log_path=tmp_path / "log",
                      extra_args=["--exit-timeout-secs=20"]) as fresh:
        again = grpc_one(fresh.urls["grpc"], "exspec", prompt=PROMPT, sampling=SEEDED)
        other_seed = grpc_one(fresh.urls["grpc"], "exspec", prompt=PROMPT,
                              sampling={**SEEDED, "seed": SEEDED["seed"] + 1})
    tokens = first[0].ids()
    assert len(tokens) == SEEDED["max_tokens"]
    assert again.ids() == tokens, f"second server start: {again.ids()} != first: {tokens}"
    in_process = engine.generate([PROMPT], SamplingParams(**SEEDED))[0].token_ids
    assert in_process == tokens, f"in-process engine {in_process} != served {tokens}"
    assert other_seed.ids() != tokens, "another seed gave the same 24 sampled tokens"
