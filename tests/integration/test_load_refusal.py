"""A model the layouts cannot serve exactly fails its load in Triton, with the reason, instead of
reporting READY and failing every request (design: "Models").

One server, two models: `local` (a tiny GPT-Neo pair with a local attention layer, whose window
comes from column indices inside the model, not from the mask) must be UNAVAILABLE with the engine's ModelLoadError as the reason, in the repository index and in
the log; `exspec` beside it loads and serves as usual."""
from __future__ import annotations

import urllib.error
import urllib.request

import tritonclient.grpc as grpcclient
from transformers import GPTNeoConfig, GPTNeoForCausalLM

from clients import grpc_one
from serverkit import MODELS
from exspec.demo.tiny import _init, build_tokenizer, llama, noisy_copy, save_pair
from exspec.serving.launcher import TritonServer
from modelrepo import write_model

REASON = "its local attention layers build their window from column indices"


def local_attention_pair(out, tokenizer):
    config = GPTNeoConfig(vocab_size=len(tokenizer), hidden_size=64, num_layers=2, num_heads=4,
                          attention_types=[[["global", "local"], 1]], window_size=16,
                          max_position_embeddings=256)
    target = _init(GPTNeoForCausalLM(config))
    save_pair(out, tokenizer, target, noisy_copy(target, 2))


def ready(server, model: str) -> bool:
    try:
        with urllib.request.urlopen(f"{server.urls['http']}/v2/models/{model}/ready", timeout=5) as r:
            return r.status == 200
    except urllib.error.HTTPError:
        return False


def test_unservable_model_fails_its_load_with_the_reason(tmp_path):
    tokenizer = build_tokenizer()
    local_attention_pair(tmp_path / "pairs" / "local", tokenizer)
    target = llama(len(tokenizer), 11, eos_token_id=tokenizer.eos_token_id)
    save_pair(tmp_path / "pairs" / "exspec", tokenizer, target, noisy_copy(target, 12))
    repo = tmp_path / "models"
    write_model(repo, "local", tmp_path / "pairs" / "local", {"method": "eqspec"})
    write_model(repo, "exspec", tmp_path / "pairs" / "exspec", MODELS["exspec"])
    log = tmp_path / "tritonserver.log"
    # Triton's defaults exit (or never turn ready) when a model fails: serve the others.
    with TritonServer(repo, free_ports=True, startup_timeout_s=300, log_path=log,
                      extra_args=["--exit-on-error=false", "--strict-readiness=false"]) as server:
        assert not ready(server, "local")
        assert ready(server, "exspec")
        client = grpcclient.InferenceServerClient(server.urls["grpc"])
        index = {m.name: m for m in client.get_model_repository_index().models}
        assert index["local"].state == "UNAVAILABLE", index["local"]
        assert "GPTNeoForCausalLM" in index["local"].reason, index["local"].reason
        assert REASON in index["local"].reason, index["local"].reason
        assert index["exspec"].state == "READY"
        call = grpc_one(server.urls["grpc"], "exspec", prompt="hello", stream=False,
                        sampling={"max_tokens": 4})
        assert call.finished and all(r.error is None for r in call.responses) and call.ids()
    text = log.read_text()
    assert REASON in text and "ModelLoadError" in text, text[-3000:]
