"""The compiled decode path on a GPU (`make gpu-check`; skipped without CUDA): bf16 equivalence
on a Qwen3-shaped tiny pair (head_dim 128; 8 KV heads in the target, 4 in the draft) under each
SDPA backend with the step's 4D mask, every divergence reported and checked against the
benchmark's near-tie rule; and the decode path free of host syncs (sync debug mode "error").
Written without a GPU at hand: unverified until gpu-check has run on one."""
from __future__ import annotations

import pytest
import torch

from exspec import EngineConfig, LLMEngine, SamplingParams
from conftest import bf16_divergence, make_prompts

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

MAX_TOKENS = 24
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}


@pytest.fixture(scope="module")
def qwen3_pair(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from exspec.demo.tiny import build_tokenizer
    tok = build_tokenizer()
    root = tmp_path_factory.mktemp("qwen3")
    tok.save_pretrained(root / "tokenizer")
    for name, layers, heads, kv_heads, seed in (("target", 4, 16, 8, 0), ("draft", 2, 8, 4, 1)):
        torch.manual_seed(seed)
        cfg = Qwen3Config(vocab_size=len(tok), hidden_size=256, intermediate_size=512,
                          num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=kv_heads, head_dim=128, max_position_embeddings=512,
                          tie_word_embeddings=False, eos_token_id=tok.eos_token_id)
        Qwen3ForCausalLM(cfg).save_pretrained(root / name)
    return {name: str(root / name) for name in ("target", "draft", "tokenizer")}


def engine(pair, method, **extra) -> LLMEngine:
    return LLMEngine(EngineConfig(target_model=pair["target"], draft_model=pair["draft"],
                                  tokenizer=pair["tokenizer"], method=method,
                                  num_speculative_tokens=3, max_batch_size=4, adaptive_k=False,
                                  device="cuda", dtype="bfloat16", enforce_eager=False, **extra))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("method", ["exspec", "eqspec"])
def test_compiled_bf16_divergences_are_near_ties_only(qwen3_pair, method, backend):
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(qwen3_pair["target"], dtype=torch.bfloat16)
    target = target.to("cuda").eval()
    prompts = [p for p in make_prompts(target.config.vocab_size, None, seed=6, count=8) if len(p) > 1]
    with sdpa_kernel([BACKENDS[backend]]):
        outs = engine(qwen3_pair, method).generate(
            prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    report = []
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.error is None, out.error
        found = bf16_divergence(target, prompt, out.token_ids, MAX_TOKENS)
        if found is not None:
            report.append((i, *found))
    print(f"{method} {backend}: divergences (row, at, top-2 gap, top logit, near tie): {report}")
    assert all(tie for *_, tie in report), f"{method} {backend}: a divergence that is no tie: {report}"


@pytest.mark.parametrize("method", ["exspec", "eqspec"])
def test_compiled_decode_steps_do_not_sync(qwen3_pair, method):
    """After the warm-up, decode steps run under sync debug mode "error": any implicit host
    sync inside a forward raises. The step's own device-to-host copy (the accepted counts and
    tokens) is its one allowed sync and happens after the forwards, outside the mode."""
    eng = engine(qwen3_pair, method)
    prompts = [p for p in make_prompts(320, None, seed=7, count=4) if len(p) > 1]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=8, ignore_eos=True))
    eng.step()   # admits and prefills (eager, syncs allowed)
    runner, group = eng.runner, eng.pool.groups[0]
    calls = []
    original = runner._forward

    def forward_under_sync_check(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            calls.append(1)
            return original(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    runner._forward = forward_under_sync_check
    runner.step(group, 3)
    assert calls, "no forward ran"
