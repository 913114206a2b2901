"""Token distributions and the two couplings of draft and target, as pure functions over tensors.

Both couplings process logits the same way (temperature, top-k, top-p: `processed_logits`).

- gumbel (the default): every token is argmax(processed logits + g), with counter-based Gumbel
  noise g fixed by (request seed, absolute position, token id) (noise.py). That is an exact
  sample from p, and the draft proposes with the same noise, so verification is the greedy rule
  (accept while the draft's token equals the target's) and the output is the target-only seeded
  output token for token, whatever k, batch or schedule. Greedy rows are the same rule without
  noise.
- rejection: speculative rejection sampling (accept with min(1, p/q), residual, bonus) on
  uniforms from a per-request generator; exact in distribution only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..utils.transfer import float_bits, floats_from_bits

COUPLINGS = ("gumbel", "rejection")
MAX_TOP_K = 2**31 - 1   # past any vocabulary: top_k at or beyond it keeps every token


@dataclass
class RowSampling:
    """Per-row sampling settings of a group, as device tensors (built once per group from its
    step's one upload; an all-greedy group, which never reads them, builds none)."""
    greedy: torch.Tensor | None       # [B] bool
    temperature: torch.Tensor | None  # [B] float (1.0 where greedy, unused there)
    top_k: torch.Tensor | None        # [B] long, 0 = off
    top_p: torch.Tensor | None        # [B] float
    seed: torch.Tensor | None         # [B] long, the key of each row's Gumbel noise
    all_greedy: bool                  # known on the host: no device sync to take the greedy shortcut
    # known on the host too, from the sampled rows: whether any cuts by top-p (a full sort of
    # the vocabulary), and the largest top-k (0: none cuts by top-k)
    any_top_p: bool = True
    max_top_k: int = 0

    COLUMNS = 5   # greedy, top_k, seed, and the float32 bits of temperature and top_p

    @staticmethod
    def host_columns(params_list, seeds: list[int]) -> list[int] | None:
        """The settings as host ints ([COLUMNS, B], row-major) for an upload (transfer.Upload),
        floats as their bits; None when every row is greedy (nothing to send)."""
        if all(p.greedy for p in params_list):
            return None
        return ([int(p.greedy) for p in params_list] + [_top_k(p) for p in params_list]
                + list(seeds)
                + float_bits([p.temperature if not p.greedy else 1.0 for p in params_list])
                + float_bits([p.top_p for p in params_list]))

    @classmethod
    def from_columns(cls, columns: torch.Tensor | None, params_list) -> "RowSampling":
        """From `host_columns` on the device ([COLUMNS, B]; None: every row greedy); the host
        flags (any top-p, largest top-k) from the same rows' params, so no read back."""
        if columns is None:
            return cls(None, None, None, None, None, all_greedy=True)
        floats = floats_from_bits(columns[3:])
        sampled = [p for p in params_list if not p.greedy]
        return cls(greedy=columns[0].bool(), temperature=floats[0], top_k=columns[1],
                   top_p=floats[1], seed=columns[2], all_greedy=False,
                   any_top_p=any(p.top_p < 1 for p in sampled),
                   max_top_k=max(_top_k(p) for p in sampled))

    @classmethod
    def from_params(cls, params_list, device, seeds: list[int] | None = None,
                    to_device=None) -> "RowSampling":
        """Outside a step (references, tests): the settings in one copy (`to_device`, default
        `.to(device)`)."""
        columns = cls.host_columns(params_list, seeds or [0] * len(params_list))
        if columns is None:
            return cls.from_columns(None, params_list)
        to_device = to_device or (lambda t: t.to(device))
        return cls.from_columns(to_device(torch.tensor(columns, dtype=torch.long).view(cls.COLUMNS, -1)),
                                params_list)


def processed_logits(logits: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """[B, T, V] logits -> [B, T, V] float32 log p (up to a constant per row) after temperature,
    top-k and top-p; dropped tokens (and -inf logits) are -inf. The vocabulary is sorted only
    where a row cuts by top-p; top-k alone takes the k largest (a tie at the k-th value keeps
    every tied token, as vLLM does)."""
    scaled = logits.float() / rows.temperature[:, None, None]
    if rows.any_top_p:
        return _top_k_top_p(scaled, rows)
    if rows.max_top_k:
        return _keep_top_k(scaled, rows)
    return scaled


def _top_k(params) -> int:
    """A row's top_k as it goes up (0: off). Any k at or past the vocabulary keeps every token,
    so a k beyond any vocabulary is cut to one that still is (an int64 holds it)."""
    return min(max(params.top_k, 0), MAX_TOP_K)


def _keep_top_k(scaled: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """Each row's logits below its k-th largest dropped (rows with top-k off keep all)."""
    largest = scaled.topk(min(rows.max_top_k, scaled.shape[-1]), dim=-1).values   # [B, T, kmax]
    k = rows.top_k.clamp(1, largest.shape[-1])
    kth = largest.gather(-1, (k - 1)[:, None, None].expand(-1, scaled.shape[1], 1))
    kth = kth.masked_fill((rows.top_k == 0)[:, None, None], float("-inf"))
    return scaled.masked_fill(scaled < kth, float("-inf"))


def _top_k_top_p(scaled: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """Top-k and top-p by one full sort of the vocabulary."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=scaled.device)
    k = torch.where(rows.top_k > 0, rows.top_k, torch.full_like(rows.top_k, vocab))
    drop = rank >= k[:, None, None]
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # top-p keeps the smallest prefix whose mass reaches top_p (always at least one token)
    drop = drop | ((sorted_probs.cumsum(-1) - sorted_probs) >= rows.top_p[:, None, None])
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def point_mass(tokens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, T] tokens -> [B, T, width] float32, all the mass on each token: a greedy row's
    distribution, and the draft distribution q of a proposal made without a model (a lookup's,
    a hybrid's suffix rows), which rejection sampling then accepts with probability p(token)."""
    return torch.nn.functional.one_hot(tokens, width).float()


def probs_from_logits(logits: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """[B, T, V] logits -> [B, T, V] float32 probabilities after temperature, top-k and top-p
    (one-hot at the argmax for greedy rows of a mixed group)."""
    one_hot = point_mass(logits.argmax(-1), logits.shape[-1])
    if rows.all_greedy:
        return one_hot
    return torch.where(rows.greedy[:, None, None], one_hot, processed_logits(logits, rows).softmax(-1))


def perturbed_scores(logits: torch.Tensor, rows: RowSampling, noise: torch.Tensor) -> torch.Tensor:
    """The scores the gumbel coupling maximises: processed logits + noise for sampled rows, the
    raw logits for greedy rows. logits [B, T, V]; noise [B, T, >= V], the Gumbel noise of the
    positions being chosen (noise.gumbel; a token's noise does not depend on the width, so a
    draft with a smaller vocabulary takes the first V columns)."""
    logits = logits.float()
    if rows.all_greedy:
        return logits
    noisy = processed_logits(logits, rows) + noise[..., :logits.shape[-1]]
    return torch.where(rows.greedy[:, None, None], logits, noisy)


def coupled_tokens(logits: torch.Tensor, rows: RowSampling, noise: torch.Tensor | None) -> torch.Tensor:
    """[B, T] tokens under the gumbel coupling (the argmax alone for an all-greedy group,
    which needs no noise)."""
    if rows.all_greedy:
        return logits.argmax(-1)
    return perturbed_scores(logits, rows, noise).argmax(-1)


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [..., V], u [...] uniform in [0, 1) -> token ids [...]."""
    cdf = probs.cumsum(-1)
    u = u.unsqueeze(-1) * cdf[..., -1:]  # scale by the total so rounding never runs off the end
    return (cdf <= u).sum(-1).clamp_max(probs.shape[-1] - 1)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what to sample from after a rejection."""
    r = (p - q).clamp_min(0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(1e-30), p)


def accept(draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
           u_accept: torch.Tensor, u_final: torch.Tensor):
    """Speculative rejection sampling for a group.

    draft_tokens [B, k], q [B, k, V] (draft probs), p [B, k+1, V] (target probs),
    u_accept [B, k], u_final [B]. Returns (num_accepted [B], tokens [B, k+1]) where row b's
    committed tokens are tokens[b, :num_accepted[b] + 1].

    Accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection sample
    from norm(max(0, p_j - q_j)); if all k are accepted, sample the bonus token from p_k.
    """
    batch, k = draft_tokens.shape
    p_d = p[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    q_d = q.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    ok = u_accept * q_d < p_d            # u < p/q without dividing by a zero q
    num_accepted = ok.long().cumprod(-1).sum(-1)
    rows = torch.arange(batch, device=p.device)
    p_at = p[rows, num_accepted]
    q_at = q[rows, num_accepted.clamp_max(k - 1)] * (num_accepted < k).unsqueeze(-1)
    final = sample(residual_distribution(p_at, q_at), u_final)
    tokens = torch.cat([draft_tokens, draft_tokens[:, :1]], dim=1)
    tokens.scatter_(1, num_accepted.unsqueeze(-1), final.unsqueeze(-1))
    return num_accepted, tokens
