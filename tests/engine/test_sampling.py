"""Speculative rejection sampling reproduces the target's distribution exactly.

A vocabulary of 12 tokens makes the exact joint distribution of the first three output tokens
computable from the target alone; 20,000 seeded requests through the engine must match it
(chi-square), with a draft that is rejected often and accepted often (bonus tokens). Replacing
the residual norm(max(0, p - q)) by p must make the same test fail.
"""
import pytest
import torch
from scipy.stats import chisquare

import exspec.sampler
from exspec import EngineConfig, LLMEngine, SamplingParams
from exspec.sampler import RowSampling, probs_from_logits
from exspec.demo.tiny import llama

VOCAB, SAMPLES = 12, 20_000
PARAMS = dict(temperature=0.7, top_k=9, top_p=0.95)
PROMPT = [3, 7, 1]


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory, pairs):
    root = tmp_path_factory.mktemp("vocab12")
    target = llama(VOCAB, seed=31, layers=2, hidden=32, heads=2, kv_heads=1)
    draft = llama(VOCAB, seed=32, layers=1, hidden=32, heads=2, kv_heads=1)
    with torch.no_grad():  # flatter distributions: many tokens plausible, frequent rejections
        target.lm_head.weight.mul_(0.12)
        draft.lm_head.weight.mul_(0.12)
    for model in (target, draft):
        model.config.eos_token_id = model.generation_config.eos_token_id = None
    target.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    return str(root / "target"), str(root / "draft"), pairs["tokenizer"]


def target_joint(target_path, vocab: int = VOCAB) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) under the same temperature / top-k / top-p transform."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    sp = SamplingParams(**PARAMS)

    def dist(prefixes):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(prefixes)).logits[:, -1:]
        rows = RowSampling.from_params([sp] * len(prefixes), "cpu")
        return probs_from_logits(logits, rows)[:, 0].double()

    p1 = dist([PROMPT])[0]
    p2 = dist([PROMPT + [a] for a in range(vocab)])
    p3 = dist([PROMPT + [a, b] for a in range(vocab) for b in range(vocab)]).view(vocab, vocab, vocab)
    return p1[:, None, None] * p2[:, :, None] * p3


def sample_engine(pair, seeds, vocab: int = VOCAB) -> tuple[torch.Tensor, dict]:
    target, draft, tokenizer = pair
    engine = LLMEngine(EngineConfig(target_model=target, draft_model=draft, tokenizer=tokenizer,
                                    method="eqspec", num_speculative_tokens=1, adaptive_k=False,
                                    max_batch_size=256, max_num_seqs=256, max_queue_len=SAMPLES + 1))
    outs = engine.generate([PROMPT] * len(seeds),
                           [SamplingParams(max_tokens=3, seed=s, ignore_eos=True, **PARAMS) for s in seeds])
    counts = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    for o in outs:
        assert len(o.token_ids) == 3, o
        counts[tuple(o.token_ids)] += 1
    return counts, engine.stats()


def chi2_pvalue(counts, expected_probs) -> float:
    expected = expected_probs.flatten() * counts.sum()
    observed = counts.flatten()
    if observed[expected == 0].sum() > 0:
        return 0.0   # a sample the target gives probability zero (outside top-k / top-p)
    big = expected >= 5
    obs, exp = [observed[big]], [expected[big]]
    if expected[~big].sum() > 0:   # pool the rare cells into one bin
        obs.append(observed[~big].sum().view(1))
        exp.append(expected[~big].sum().view(1))
    obs, exp = torch.cat(obs), torch.cat(exp)
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


def test_joint_distribution_of_three_tokens_matches_target(small_vocab_pair):
    counts, stats = sample_engine(small_vocab_pair, range(SAMPLES))
    # k = 1: tokens 2-3 come from one speculative step: a rejection (t2 from the residual) or
    # an acceptance (t3 is the bonus token). Both branches must be common.
    accepted_share = stats["acceptance_rate"]
    assert 0.10 <= accepted_share <= 0.70, f"acceptance {accepted_share:.2f} exercises too little"
    pvalue = chi2_pvalue(counts, target_joint(small_vocab_pair[0]))
    assert pvalue > 1e-3, f"engine samples differ from the target distribution (p={pvalue:.2e})"


def test_residual_replaced_by_p_is_detected(small_vocab_pair, monkeypatch):
    monkeypatch.setattr(exspec.sampler, "residual_distribution", lambda p, q: p)
    counts, _ = sample_engine(small_vocab_pair, range(SAMPLES))
    pvalue = chi2_pvalue(counts, target_joint(small_vocab_pair[0]))
    assert pvalue < 1e-6, f"a broken residual went unnoticed (p={pvalue:.2e})"


def test_seeded_request_is_independent_of_its_batch(pairs):
    config = dict(target_model=pairs["llama", "target"], draft_model=pairs["llama", "noisy"],
                  tokenizer=pairs["tokenizer"], method="eqspec", adaptive_k=False, max_batch_size=8)
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=1234)
    alone = LLMEngine(EngineConfig(**config)).generate([[5, 6, 7]], params)[0].token_ids
    others = [SamplingParams(max_tokens=30, temperature=1.0, seed=s) for s in range(5)]
    crowd = LLMEngine(EngineConfig(**config)).generate(
        [[9, 9], [5, 6, 7], [1] * 11, [4, 2], [8] * 5, [3]], [others[0], params] + others[1:])
    assert crowd[1].token_ids == alone
    again = LLMEngine(EngineConfig(**config)).generate([[5, 6, 7]], params)[0].token_ids
    assert again == alone
