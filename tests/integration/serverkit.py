"""One real tritonserver for the integration suite, started through the launcher on free ports.

The model repository is built in a temporary folder from tiny seeded model pairs (exspec.demo.tiny)
and the repository's own config files, and serves three models from one server:

- exspec         random Llama target + noisy draft, method exspec (the parity model), and
  exspec_unary   the repository's BLS front model on top of it;
- scripted       a Llama pair whose greedy output is a fixed multi-lingual string (CJK, emoji
                 and " STOP here" split across byte-level tokens), for the streaming-text tests;
- small          a GPT-2 pair (learned absolute positions), method eqspec, with a one-slot
                 pool and queue and slowed ticks, for the busy test;
- tokenwise      the exspec pair again, streaming one response per token and publishing
                 the vLLM backend's vllm: metric families (REPORT_CUSTOM_METRICS), for the
                 drop-in tests;
- vllm_plain, vllm_spec  the exspec pair under model.json files in vLLM's own words (the vLLM
                 backend's sample, without and with a speculative_config).
"""
from __future__ import annotations

import os
import shutil
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backend"))
sys.path.insert(0, str(REPO / "tests"))

pytest.importorskip("tritonclient.grpc", reason="needs the serve extra: pip install -e '.[serve]'")

import torch  # noqa: E402

from exspec.serving.launcher import TritonServer  # noqa: E402
from exspec.demo.tiny import build_tokenizer, gpt2, llama, noisy_copy, save_pair  # noqa: E402
from modelrepo import copy_unary, write_model, write_model_json  # noqa: E402,F401  (tests/modelrepo.py)

SCRIPT = "日本語🚀 STOP here.ü"   # the scripted model's greedy output cycles through this
MODELS = {
    "exspec": {"method": "exspec", "num_speculative_tokens": 4, "max_batch_size": 4,
               "max_num_seqs": 16, "default_max_tokens": 16, "max_output_tokens": 512},
    # k pinned: its draft costs as much as its target, so adaptive k may rightly decode plainly
    # (one token a step), and the streaming tests on it need steps that commit several tokens
    "scripted": {"method": "exspec", "num_speculative_tokens": 3, "adaptive_k": False,
                 "max_batch_size": 4, "max_num_seqs": 8, "default_max_tokens": 40},
    "small": {"method": "eqspec", "num_speculative_tokens": 3, "max_batch_size": 1,
              "max_num_seqs": 1, "max_queue_len": 1, "default_max_tokens": 8,
              "max_output_tokens": 200, "fault_injection": {"tick_delay_s": 0.05}},
}

# Triton's vLLM backend's sample model.json (its README), keys exspec spells otherwise included.
VLLM_SAMPLE = {"disable_log_requests": True, "gpu_memory_utilization": 0.5, "enforce_eager": True}

# The vLLM backend's switch for its vllm: metric families, as its CI appends it to config.pbtxt.
REPORT_CUSTOM_METRICS = '\nparameters: { key: "REPORT_CUSTOM_METRICS" value: { string_value: "true" } }\n'


def scripted_pair(out: Path, tokenizer, text: str = SCRIPT, seed: int = 7) -> list[int]:
    """A Llama whose next token depends only on the current one and walks the tokens of `text`
    in a cycle: attention and MLP outputs are zeroed, so the residual stream is the token's
    embedding, and the LM head row of each cycle token is the embedding of its predecessor.
    Returns the cycle's token ids."""
    cycle = tokenizer.encode(text, add_special_tokens=False)
    assert len(set(cycle)) == len(cycle), f"cycle tokens must be unique: {cycle}"
    target = llama(len(tokenizer), seed, layers=2, hidden=128, max_positions=512,
                   eos_token_id=tokenizer.eos_token_id)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        emb = torch.randn(len(tokenizer), 128, generator=gen)
        emb *= (128 ** 0.5) / emb.norm(dim=1, keepdim=True)       # RMS 1: the final norm keeps it
        target.model.embed_tokens.weight.copy_(emb)
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros_like(target.lm_head.weight)
        for prev, nxt in zip(cycle, cycle[1:] + cycle[:1]):
            head[nxt] = emb[prev] / 8.0     # logit 16 for the successor, ~N(0, 2) elsewhere
        target.lm_head.weight.copy_(head)
    draft = noisy_copy(target, seed + 1, scale=0.05)
    save_pair(out, tokenizer, target, draft)
    return cycle


def build_repository(root: Path) -> Path:
    repo = root / "models"
    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    pairs = root / "pairs"
    target = llama(vocab, 11, layers=2, hidden=64, max_positions=512,
                   eos_token_id=tokenizer.eos_token_id)
    save_pair(pairs / "exspec", tokenizer, target, noisy_copy(target, 12, scale=0.05))
    scripted_pair(pairs / "scripted", tokenizer)
    small = gpt2(vocab, 21, layers=2, hidden=64, max_positions=256,
                 eos_token_id=tokenizer.eos_token_id)
    save_pair(pairs / "small", tokenizer, small, noisy_copy(small, 22, scale=0.1))

    for name, engine in MODELS.items():
        write_model(repo, name, pairs / name, engine)
    write_model(repo, "tokenwise", pairs / "exspec", {**MODELS["exspec"], "stream_granularity": "token"},
                config_extra=REPORT_CUSTOM_METRICS)
    vllm = {"model": str(pairs / "exspec" / "target"), "tokenizer": str(pairs / "exspec" / "tokenizer"),
            **VLLM_SAMPLE}
    write_model_json(repo, "vllm_plain", vllm)
    write_model_json(repo, "vllm_spec", {**vllm, "disable_log_stats": True, "speculative_config": {
        "model": str(pairs / "exspec" / "draft"), "num_speculative_tokens": 4}})
    # prompt lookup on the scripted target, whose output cycles: proposals are accepted
    write_model_json(repo, "vllm_ngram", {
        "model": str(pairs / "scripted" / "target"), "tokenizer": str(pairs / "scripted" / "tokenizer"),
        **VLLM_SAMPLE, "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                              "prompt_lookup_max": 4, "prompt_lookup_min": 2}})
    copy_unary(repo)
    return repo


@pytest.fixture(scope="session")
def repository(tmp_path_factory) -> Path:
    return build_repository(tmp_path_factory.mktemp("exspec-it"))


@pytest.fixture(scope="session")
def server(repository):
    log = repository.parent / "tritonserver.log"
    with TritonServer(repository, free_ports=True, startup_timeout_s=300, log_path=log,
                      extra_args=["--exit-timeout-secs=20"]) as srv:
        yield srv
        if os.environ.get("EXSPEC_KEEP_LOG"):
            shutil.copy(log, os.environ["EXSPEC_KEEP_LOG"])


@pytest.fixture(scope="session")
def pair_dir(repository) -> Path:
    return repository.parent / "pairs"


@pytest.fixture(scope="session")
def engine(pair_dir):
    """The same engine, in process, on the `exspec` pair: served output must equal it."""
    from exspec import EngineConfig
    from exspec.engine.llm_engine import LLMEngine
    pair = pair_dir / "exspec"
    return LLMEngine(EngineConfig.from_dict({
        "target_model": str(pair / "target"), "draft_model": str(pair / "draft"),
        "tokenizer": str(pair / "tokenizer"), **MODELS["exspec"]}))


@pytest.fixture(scope="session")
def hf_target(pair_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    pair = pair_dir / "exspec"
    model = AutoModelForCausalLM.from_pretrained(pair / "target", dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(pair / "tokenizer")


def scrape(server, name: str, **labels) -> float:
    """One sample of a metric (summed over label sets matching `labels`)."""
    with urllib.request.urlopen(server.urls["metrics"], timeout=10) as r:
        text = r.read().decode()
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
            found = True
    if not found:
        raise AssertionError(f"metric {name}{labels} not in the scrape")
    return total


def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def fill_pool_and_queue(server, model: str, pool, send, slots: int, queue: int) -> list:
    """Runs send(i) on the executor `pool` until `model` runs `slots` sequences and holds `queue`
    requests waiting, and returns their futures. In two waves, seen in the metrics: requests
    not yet admitted count against the queue. The sends must hold for seconds (slowed ticks)."""
    gauge = lambda name: scrape(server, name, model=model)   # noqa: E731
    calls = [pool.submit(send, i) for i in range(slots)]
    wait_for(lambda: gauge("exspec:num_requests_running") == slots, timeout_s=30,
             what=f"{model}'s pool to fill")
    calls += [pool.submit(send, slots + i) for i in range(queue)]
    wait_for(lambda: gauge("exspec:num_requests_waiting") == queue, timeout_s=30,
             what=f"{model}'s queue to fill")
    return calls
