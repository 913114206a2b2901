"""Draft and target whose vocabularies differ only by padding rows (Qwen2.5-7B: 152,064 logits,
Qwen2.5-0.5B: 151,936, one tokenizer) are a valid pair; vocabularies that really differ are
refused at load, naming all three sizes.

The tokenizer has 320 tokens; the models are tiny Llamas built in the test."""
from __future__ import annotations

import pytest
import torch

from exspec import EngineConfig, LLMEngine, ModelLoadError, SamplingParams
from exspec.demo.tiny import build_tokenizer, llama
from exspec.models.loading import ModelPair

from enginekit import make_prompts

REAL = 320
MAX_TOKENS = 24


def resized_copy(model, rows: int, seed: int):
    """`model`'s weights with `rows` embedding / LM-head rows (cut, or random rows added),
    plus noise: a draft that agrees with it as often as a noisy copy does."""
    copy = llama(rows, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    with torch.no_grad():
        for name, p in copy.state_dict().items():
            n = min(p.shape[0], state[name].shape[0])
            p[:n] = state[name][:n] + 0.01 * torch.randn(state[name][:n].shape, generator=gen)
    return copy.eval()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def greedy(model, prompt, max_tokens) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run(target, draft, tokenizer, method, prompts, params=None, unmasked=False):
    engine = LLMEngine(EngineConfig(target_model="target", draft_model="draft", method=method,
                                    num_speculative_tokens=4, max_batch_size=4, adaptive_k=False),
                       pair=ModelPair(tokenizer, target, draft, set(), 256))
    if unmasked:   # negative control: the draft may propose any id the target has
        engine.runner.proposer.vocab.real = engine.runner.proposer.vocab.target_rows
    params = params or SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return engine.generate(prompts, params), engine.stats()


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_wider_target_is_exact_and_its_padding_ids_reach_the_draft_as_real_ids(
        tokenizer, method):
    """Qwen2.5-7B / 0.5B: the target has 336 logits, the draft 320. The target emits padding
    ids here (its padding rows are random), which the draft has no embedding for."""
    target = llama(REAL + 16, seed=41)
    draft = resized_copy(target, REAL, seed=42)
    prompts = make_prompts(REAL, None, seed=3, count=8, max_len=20)
    expected = [greedy(target, p, MAX_TOKENS) for p in prompts]
    assert any(t >= REAL for row in expected for t in row), "no padding id emitted: test too weak"
    outs, stats = run(target, draft, tokenizer, method, prompts)
    for i, (out, want) in enumerate(zip(outs, expected)):
        assert out.error is None and out.token_ids == want, f"row {i}: {out.token_ids} vs {want}"
    # after a padding id the draft's context holds a substitute, so it agrees less from there
    assert stats["acceptance_rate"] > 0.1, stats["acceptance_rate"]


def test_draft_proposes_only_real_ids(tokenizer):
    """Both padded (target 336, draft 344), and a hook makes the draft's padding logits
    outscore every real one: unmasked (the negative control), it proposes only padding ids,
    which the target never accepts."""
    target = llama(REAL + 16, seed=43)
    with torch.no_grad():
        target.lm_head.weight[REAL:] = 0.0     # the target itself never picks a padding id
    draft = resized_copy(target, REAL + 24, seed=44)

    def padding_wins(module, args, logits):
        return logits.index_fill(-1, torch.arange(REAL, REAL + 24), 1e4)

    draft.lm_head.register_forward_hook(padding_wins)
    prompts = make_prompts(REAL, None, seed=4, count=6, max_len=12)
    expected = [greedy(target, p, MAX_TOKENS) for p in prompts]
    outs, stats = run(target, draft, tokenizer, "eqspec", prompts)
    assert [o.token_ids for o in outs] == expected
    assert stats["acceptance_rate"] > 0.2, (
        f"acceptance {stats['acceptance_rate']:.2f}: the draft proposed padding ids")
    outs, stats = run(target, draft, tokenizer, "eqspec", prompts, unmasked=True)
    assert [o.token_ids for o in outs] == expected        # still exact: the target decides
    assert stats["acceptance_rate"] == 0.0, "the negative control proposed real ids"


def test_sampled_rows_run_with_a_zero_padded_draft_distribution(tokenizer):
    target = llama(REAL + 16, seed=45)
    draft = resized_copy(target, REAL, seed=46)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=s, ignore_eos=True)
              for s in range(4)]
    outs, stats = run(target, draft, tokenizer, "exspec", [[5, 6, 7]] * 4, params)
    assert all(o.error is None and len(o.token_ids) == MAX_TOKENS for o in outs)
    assert stats["accepted_tokens"] > 0


def test_vocabularies_that_really_differ_are_refused_naming_all_sizes(tokenizer):
    target = llama(REAL + 16, seed=47)
    draft = llama(REAL - 20, seed=48)    # smaller than the tokenizer: not padding
    with pytest.raises(ModelLoadError, match=r"target has 336 logits, draft has 300, the "
                                             r"tokenizer has 320 tokens"):
        run(target, draft, tokenizer, "eqspec", [[1, 2]])


def word_tokenizer(size: int):
    """A tokenizer of exactly `size` tokens, so a model with more logit rows is padded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")


@pytest.mark.parametrize("coupling", ["rejection", "gumbel"])
def test_sampling_keeps_the_target_distribution_with_padding_rows(tmp_path, coupling):
    """test_sampling's chi-square test of the joint distribution of three tokens, on a 12-token
    tokenizer with a 12-row draft and a 14-row target whose two padding rows get real
    probability: q padded with zeros keeps the rejection rule exact, and the Gumbel noise
    covers the target's padding rows too, padding ids included."""
    from test_sampling import SAMPLES, VOCAB, chi2_pvalue, sample_engine, target_joint
    padded = VOCAB + 2
    target = llama(padded, seed=33, layers=2, hidden=32, heads=2, kv_heads=1)
    draft = llama(VOCAB, seed=34, layers=1, hidden=32, heads=2, kv_heads=1)
    with torch.no_grad():   # flat distributions: frequent rejections
        target.lm_head.weight.mul_(0.12)
        draft.lm_head.weight.mul_(0.12)
    for name, model in (("target", target), ("draft", draft)):
        model.config.eos_token_id = model.generation_config.eos_token_id = None
        model.save_pretrained(tmp_path / name)
    word_tokenizer(VOCAB).save_pretrained(tmp_path / "tokenizer")
    pair = tuple(str(tmp_path / name) for name in ("target", "draft", "tokenizer"))
    counts, stats = sample_engine(pair, range(SAMPLES), coupling, vocab=padded)
    assert 0.10 <= stats["acceptance_rate"] <= 0.70, stats["acceptance_rate"]
    padding_drawn = counts.sum() - counts[:VOCAB, :VOCAB, :VOCAB].sum()
    assert padding_drawn > SAMPLES * 0.02, f"padding ids drawn {padding_drawn:.0f} times"
    pvalue = chi2_pvalue(counts, target_joint(pair[0], vocab=padded))
    assert pvalue > 1e-3, f"engine samples differ from the target distribution (p={pvalue:.2e})"
