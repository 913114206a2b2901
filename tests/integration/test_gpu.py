"""KIND_GPU placement and served parity on CUDA (`make gpu-check`); skipped without CUDA."""
from __future__ import annotations

import json

import pytest
import torch

from clients import grpc_stream
from serverkit import REPO, scrape, wait_for

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from exspec.serving.launcher import TritonServer  # noqa: E402
from exspec.demo.tiny import build_tokenizer, llama, noisy_copy, save_pair  # noqa: E402

PROMPTS = ["def add(a, b):", "hello", "The quick brown fox jumps over the lazy"]


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("exspec-gpu")
    tokenizer = build_tokenizer()
    target = llama(len(tokenizer), 31, layers=2, hidden=64, max_positions=512,
                   eos_token_id=tokenizer.eos_token_id)
    pair = save_pair(root / "pair", tokenizer, target, noisy_copy(target, 32, scale=0.05))
    model = root / "models" / "exspec"
    (model / "1").mkdir(parents=True)
    config = (REPO / "model_repository" / "exspec" / "config.pbtxt").read_text()
    config = config.replace("instance_group [ { count: 1 } ]",
                            "instance_group [ { count: 1, kind: KIND_GPU, gpus: [ 0 ] } ]")
    assert "KIND_GPU" in config
    (model / "config.pbtxt").write_text(config)
    (model / "1" / "model.json").write_text(json.dumps({
        "target_model": str(pair / "target"), "draft_model": str(pair / "draft"),
        "tokenizer": str(pair / "tokenizer"), "num_speculative_tokens": 4,
        "max_batch_size": 4, "dtype": "float32"}))
    with TritonServer(root / "models", free_ports=True, startup_timeout_s=300,
                      log_path=root / "tritonserver.log") as server:
        yield server, pair


def test_kind_gpu_instance_runs_the_engine_on_cuda_0(gpu_server):
    server, _ = gpu_server
    assert "exspec: model exspec ready on cuda:0" in server.log_path.read_text()


def test_served_greedy_on_cuda_equals_hf_target_on_cpu(gpu_server):
    server, pair = gpu_server
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(pair / "target", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(pair / "tokenizer")
    calls = grpc_stream(server.urls["grpc"], "exspec",
                        [{"prompt": p, "stream": True, "sampling": {"max_tokens": 24}}
                         for p in PROMPTS])
    for prompt, call in zip(PROMPTS, calls):
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                 do_sample=False, pad_token_id=tokenizer.eos_token_id)
        assert call.ids() == ref[0, ids.shape[1]:].tolist(), f"prompt {prompt!r}"
    wait_for(lambda: scrape(server, "exspec:num_requests_running") == 0
             and scrape(server, "exspec:kv_cache_tokens") == 0,
             what="the pool to be empty again after the run")
