"""The compiled decode path on a GPU (`make gpu-check`; skipped without CUDA): bf16 equivalence
on a Qwen3-shaped tiny pair (head_dim 128; 8 KV heads in the target, 4 in the draft) under each
SDPA backend with the step's 4D mask, every divergence reported and checked against the
benchmark's near-tie rule; and the decode path free of host syncs (sync debug mode "error").
Written without a GPU at hand: unverified until gpu-check has run on one."""
from __future__ import annotations

import pytest
import torch

from exspec import EngineConfig, LLMEngine, SamplingParams
from enginekit import bf16_divergence, make_prompts

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
    original = runner.forward

    def forward_under_sync_check(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            calls.append(1)
            return original(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    runner.forward = forward_under_sync_check
    runner.step(group, 3)
    assert calls, "no forward ran"


def test_warm_up_captures_cuda_graphs(qwen3_pair):
    """EXSPEC's compiled path on CUDA captures graphs before READY and skips none (cudagraph
    trees skip a graph silently, e.g. on a mutated non-static input; the engine refuses to load
    then, and this test says which)."""
    from exspec.models import compiled
    eng = engine(qwen3_pair, "exspec")
    captured = eng.warm_up.cuda_graphs
    print(f"warm-up: {eng.warm_up.describe()}")
    assert captured is not None and captured["recorded"] > 0 and captured["skips"] == 0, captured
    assert all(f.cuda_graphs for f in eng.runner.decode_forwards.values())
    # the warm-up built every shape: serving captures nothing (ragged rows, several batch sizes)
    prompts = [p for p in make_prompts(320, None, seed=5, count=4) if len(p) > 1]
    for batch in (1, 3, len(prompts)):
        eng.generate(prompts[:batch], SamplingParams(max_tokens=24, ignore_eos=True))
    assert compiled.cuda_graph_counts()["recorded"] == captured["recorded"], "captured after READY"
    assert not any(f.eager_shapes for f in eng.runner.decode_forwards.values())


def test_cuda_graph_capture_and_replay_do_not_sync(qwen3_pair, monkeypatch):
    """Capture and replay under sync debug mode "error": the warmed engine's graphs are dropped
    (its compiled code stays, so nothing compiles here) and recaptured during decode steps, with
    every compiled forward run under "error". The step's own device-to-host copy (accepted
    counts and tokens) is outside the compiled forwards, under "warn"-free default mode."""
    from torch._inductor import cudagraph_trees
    from exspec.models import compiled

    eng = engine(qwen3_pair, "exspec")
    cudagraph_trees.reset_cudagraph_trees()
    call = compiled.CompiledForward.__call__

    def under_sync_error(self, **inputs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return call(self, **inputs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    monkeypatch.setattr(compiled.CompiledForward, "__call__", under_sync_error)
    prompts = [p for p in make_prompts(320, None, seed=9, count=3) if len(p) > 1]
    outs = eng.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert compiled.cuda_graph_counts()["recorded"] > 0, "nothing was captured again"
