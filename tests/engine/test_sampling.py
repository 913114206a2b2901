"""Both couplings reproduce the target's distribution exactly.

A vocabulary of 12 tokens makes the exact joint distribution of the first three output tokens
computable from the target alone; 20,000 seeded requests through the engine must match it
(chi-square), with a draft that is rejected often and accepted often (bonus tokens).
- rejection: replacing the residual norm(max(0, p - q)) by p must make the same test fail;
- gumbel: noise that repeats across positions (the counter ignoring the position) must fail it,
  and, one token at a time, the sampler's own draws must follow p (top-k, top-p, -inf logits).
"""
import pytest
import torch
from scipy.stats import chisquare

import exspec.engine.runner
import exspec.sampling.sampler
from exspec import EngineConfig, LLMEngine, SamplingParams
from exspec.sampling.noise import gumbel, uniforms
from exspec.sampling.sampler import RowSampling, coupled_tokens, probs_from_logits
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


def target_joint(target_path, vocab: int = VOCAB, penalties: dict | None = None) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) under the same temperature / top-k / top-p transform (after
    vLLM's repetition / frequency / presence penalties, written out here, when given)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    sp = SamplingParams(**PARAMS)

    def dist(prefixes):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(prefixes)).logits[:, -1:]
        if penalties:
            logits = torch.stack([penalized(row, prefix, **penalties) for row, prefix in zip(logits, prefixes)])
        rows = RowSampling.from_params([sp] * len(prefixes), "cpu")
        return probs_from_logits(logits, rows)[:, 0].double()

    p1 = dist([PROMPT])[0]
    p2 = dist([PROMPT + [a] for a in range(vocab)])
    p3 = dist([PROMPT + [a, b] for a in range(vocab) for b in range(vocab)]).view(vocab, vocab, vocab)
    return p1[:, None, None] * p2[:, :, None] * p3


def penalized(logits, prefix, repetition_penalty, frequency_penalty, presence_penalty):
    """vLLM's three penalties on [1, V] logits, the output being what follows PROMPT."""
    counts = torch.bincount(torch.tensor(prefix[len(PROMPT):], dtype=torch.long), minlength=logits.shape[-1])
    seen = (counts > 0) | torch.bincount(torch.tensor(PROMPT), minlength=logits.shape[-1]).bool()
    x = torch.where(seen, torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty), logits)
    return x - frequency_penalty * counts - presence_penalty * (counts > 0)


def sample_engine(pair, seeds, coupling, vocab: int = VOCAB, extra: dict | None = None,
                  method: str = "eqspec", proposer: str = "draft_model") -> tuple[torch.Tensor, dict]:
    target, draft, tokenizer = pair
    engine = LLMEngine(EngineConfig(target_model=target, draft_model=draft, tokenizer=tokenizer,
                                    method=method, num_speculative_tokens=1, adaptive_k=False,
                                    max_batch_size=256, max_num_seqs=256, max_queue_len=SAMPLES + 1,
                                    sampling_coupling=coupling, proposer=proposer))
    outs = engine.generate([PROMPT] * len(seeds),
                           [SamplingParams(max_tokens=3, seed=s, ignore_eos=True, **PARAMS, **(extra or {}))
                            for s in seeds])
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


@pytest.mark.parametrize("coupling", ["rejection", "gumbel"])
def test_joint_distribution_of_three_tokens_matches_target(small_vocab_pair, coupling):
    counts, stats = sample_engine(small_vocab_pair, range(SAMPLES), coupling)
    # k = 1: tokens 2-3 come from one speculative step: a rejection (t2 from the residual) or
    # an acceptance (t3 is the bonus token). Both branches must be common.
    accepted_share = stats["acceptance_rate"]
    assert 0.10 <= accepted_share <= 0.70, f"acceptance {accepted_share:.2f} exercises too little"
    pvalue = chi2_pvalue(counts, target_joint(small_vocab_pair[0]))
    assert pvalue > 1e-3, f"engine samples differ from the target distribution (p={pvalue:.2e})"


@pytest.mark.parametrize("coupling", ["rejection", "gumbel"])
def test_an_eagle3_heads_drafts_keep_the_target_distribution(small_vocab_pair, tmp_path, coupling):
    """An EAGLE-3 head as the proposer (EXSPEC), over a reduced draft vocabulary of 8 of the 12
    ids: its q is zero at the other 4, which the target still samples (through rejections'
    residuals and bonus tokens). The joint distribution of three tokens stays the target's."""
    from transformers import AutoModelForCausalLM
    from exspec.models.eagle3 import head_for, save_head
    target_path, _, tokenizer = small_vocab_pair
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    torch.manual_seed(5)
    head = head_for(target, (0, 1, 1), draft_ids=[0, 1, 2, 3, 5, 7, 8, 10])
    with torch.no_grad():
        head.lm_head.weight.mul_(0.05)   # flat: kept about as often as rejected
    save_head(head, tmp_path / "head", dtype=torch.float32)
    counts, stats = sample_engine((target_path, str(tmp_path / "head"), tokenizer), range(SAMPLES),
                                  coupling, method="exspec", proposer="eagle3")
    assert 0.10 <= stats["acceptance_rate"] <= 0.70, stats["acceptance_rate"]
    assert counts[[4, 6, 9, 11]].sum() > 0   # a token the head never proposes is still sampled
    pvalue = chi2_pvalue(counts, target_joint(target_path))
    assert pvalue > 1e-3, f"engine samples differ from the target distribution (p={pvalue:.2e})"


PENALTIES = dict(repetition_penalty=1.8, frequency_penalty=1.2, presence_penalty=0.6)


@pytest.mark.parametrize("coupling", ["rejection", pytest.param("gumbel", marks=pytest.mark.slow)])
def test_penalized_joint_distribution_matches_target(small_vocab_pair, coupling):
    """Penalties at verification positions see the drafts before them: the three tokens' joint
    distribution is the target's under the penalties, and not the unpenalised one."""
    counts, _ = sample_engine(small_vocab_pair, range(SAMPLES), coupling, extra=PENALTIES)
    penalised = target_joint(small_vocab_pair[0], penalties=PENALTIES)
    pvalue = chi2_pvalue(counts, penalised)
    assert pvalue > 1e-3, f"penalised samples differ from the target's (p={pvalue:.2e})"
    assert chi2_pvalue(counts, target_joint(small_vocab_pair[0])) < 1e-6, "the penalties change nothing here"


def test_residual_replaced_by_p_is_detected(small_vocab_pair, monkeypatch):
    monkeypatch.setattr(exspec.sampling.sampler, "residual_distribution", lambda p, q: p)
    counts, _ = sample_engine(small_vocab_pair, range(SAMPLES), "rejection")
    pvalue = chi2_pvalue(counts, target_joint(small_vocab_pair[0]))
    assert pvalue < 1e-6, f"a broken residual went unnoticed (p={pvalue:.2e})"


def test_gumbel_noise_repeated_across_positions_is_detected(small_vocab_pair, monkeypatch):
    monkeypatch.setattr(exspec.engine.runner, "gumbel",
                        lambda seeds, positions, vocab: gumbel(seeds, positions * 0, vocab))
    counts, _ = sample_engine(small_vocab_pair, range(SAMPLES), "gumbel")
    pvalue = chi2_pvalue(counts, target_joint(small_vocab_pair[0]))
    assert pvalue < 1e-6, f"noise shared by every position went unnoticed (p={pvalue:.2e})"


DRAWS = 100_000
# one row of logits: a -inf entry (a padded vocabulary id), top-k and top-p both binding
LOGITS = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.7, float("-inf"), 0.3, 0.0, -0.5, -1.0, -2.0, 1.2])
ONE_TOKEN = dict(temperature=0.8, top_k=8, top_p=0.9)


def coupled_counts(params: dict) -> torch.Tensor:
    """Draws of the coupled sampler at one position over DRAWS seeds (one row per seed)."""
    rows = RowSampling.from_params([SamplingParams(**params)] * DRAWS, "cpu",
                                   [(2**62 + 7919 * s) if s % 2 else s for s in range(DRAWS)])
    noise = gumbel(rows.seed, torch.full((DRAWS, 1), 17), VOCAB)
    tokens = coupled_tokens(LOGITS.expand(DRAWS, 1, -1), rows, noise)
    return torch.bincount(tokens[:, 0], minlength=VOCAB).double()


def test_noise_is_a_function_of_seed_position_and_token_only():
    """The same bits alone or in a batch, at any vocabulary width (a padded vocabulary takes a
    prefix), and different bits for another seed or position; seeds up to 2^63 - 1."""
    seeds = torch.tensor([0, 1, 2**63 - 1, 987654321])
    positions = torch.tensor([[0, 1, 2], [0, 1, 2], [5, 6, 2**31 - 1], [40, 41, 42]])
    batch = uniforms(seeds, positions, 4096)
    for row in range(4):
        alone = uniforms(seeds[row:row + 1], positions[row:row + 1, 1:], 1000)
        assert torch.equal(alone[0], batch[row, 1:, :1000]), f"row {row} depends on its batch"
    assert not torch.equal(batch[0], batch[1]), "seeds 0 and 1 share their noise"
    assert not torch.equal(batch[0, 0], batch[0, 1]), "positions 0 and 1 share their noise"
    assert 0 < float(batch.min()) and float(batch.max()) < 1
    assert abs(float(batch.mean()) - 0.5) < 0.01 and abs(float(batch.var()) - 1 / 12) < 0.005


def test_coupled_sampler_draws_follow_p_with_top_k_top_p_and_minus_inf():
    p = probs_from_logits(LOGITS.view(1, 1, -1),
                          RowSampling.from_params([SamplingParams(**ONE_TOKEN)], "cpu"))[0, 0].double()
    assert torch.isfinite(p).all() and 2 < int((p > 0).sum()) < 8, "top-k and top-p both cut"
    counts = coupled_counts(ONE_TOKEN)
    assert counts[p == 0].sum() == 0, f"a token outside top-k / top-p (or -inf) was drawn: {counts}"
    pvalue = chi2_pvalue(counts, p)
    assert pvalue > 1e-3, f"coupled draws differ from p (p={pvalue:.2e}): {counts} vs {p * DRAWS}"
    # negative control: the same draws judged against the distribution at another temperature
    other = probs_from_logits(LOGITS.view(1, 1, -1), RowSampling.from_params(
        [SamplingParams(**{**ONE_TOKEN, "temperature": 1.0})], "cpu"))[0, 0].double()
    assert chi2_pvalue(counts, other) < 1e-6, "the chi-square cannot tell temperature 0.8 from 1.0"


def test_rejection_seeded_request_is_independent_of_its_batch(pairs):
    config = dict(target_model=pairs["llama", "target"], draft_model=pairs["llama", "noisy"],
                  tokenizer=pairs["tokenizer"], method="eqspec", adaptive_k=False, max_batch_size=8,
                  sampling_coupling="rejection")
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=1234)
    alone = LLMEngine(EngineConfig(**config)).generate([[5, 6, 7]], params)[0].token_ids
    others = [SamplingParams(max_tokens=30, temperature=1.0, seed=s) for s in range(5)]
    crowd = LLMEngine(EngineConfig(**config)).generate(
        [[9, 9], [5, 6, 7], [1] * 11, [4, 2], [8] * 5, [3]], [others[0], params] + others[1:])
    assert crowd[1].token_ids == alone
    again = LLMEngine(EngineConfig(**config)).generate([[5, 6, 7]], params)[0].token_ids
    assert again == alone


class SortCalls(torch.overrides.TorchFunctionMode):
    """Counts full-vocabulary sorts (torch.sort / Tensor.sort) run inside it."""

    def __init__(self):
        super().__init__()
        self.sorts = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.sort, torch.Tensor.sort):
            self.sorts += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("top_ks, top_p, sorts", [
    ([0, 0, 0, 0], 1.0, 0),      # temperature alone: no sort, no top-k
    ([0, 3, 50, 7], 1.0, 0),     # top-k alone (one row off): torch.topk, no sort
    ([0, 3, 50, 7], 0.9, 1)])    # top-p: the one full sort
def test_processed_logits_sort_only_for_top_p_and_match_the_full_sort(top_ks, top_p, sorts):
    """The shortcuts give the full sort's distribution (logits without ties), and the full sort
    runs only where a sampled row cuts by top-p; a greedy row's top-p does not count. (At
    top_p = 1 the sort also drops the far tail whose cumulative mass rounds to 1 in float32:
    tokens below ~1e-7 of the mass, hence the tolerance.)"""
    logits = torch.randn(4, 3, 300, generator=torch.Generator().manual_seed(5)) * 3
    logits[0, 0, 7] = float("-inf")
    params = [SamplingParams(temperature=0.7, top_k=k, top_p=top_p) for k in top_ks]
    rows = RowSampling.from_params(params + [SamplingParams(temperature=0.0, top_p=0.5)], "cpu")
    logits = torch.cat([logits, logits[:1]])
    with SortCalls() as calls:
        got = exspec.sampling.sampler.processed_logits(logits, rows)
    assert calls.sorts == sorts, f"{calls.sorts} sorts for top_k {top_ks}, top_p {top_p}"
    want = exspec.sampling.sampler._top_k_top_p(logits.float() / rows.temperature[:, None, None], rows)
    torch.testing.assert_close(got[:4].softmax(-1), want[:4].softmax(-1), rtol=0, atol=1e-6)
    # negative control: a top-k the shortcut ignored would differ from the sort
    if any(top_ks) and top_p == 1.0:
        rows.max_top_k = 0
        with pytest.raises(AssertionError):
            torch.testing.assert_close(exspec.sampling.sampler.processed_logits(logits, rows)[:4].softmax(-1),
                                       want[:4].softmax(-1), rtol=0, atol=1e-6)
