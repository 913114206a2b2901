"""Training an EAGLE-3 head on its target's hidden states (models/eagle3.py; the script:
scripts/train_smollm2_eagle3.py; tests train tiny ones with it).

The head's entries are exspec's (models/eagle3.py): entry e holds (token e, feature of target
position e - 1), zero for e = 0, at rotary position e, and predicts the target's distribution at
position e (its next token).

Training-time test (Li et al., 2025): the head is unrolled `steps` times on its own outputs, as
it drafts. Step 0 is a causal forward over every entry with the true features. Step j >= 1
stands at every base entry e at once: its entry e + j takes token e + j (the true one: a draft
only matters while it is accepted) and, as feature, step j - 1's output at e; it attends to
the true entries 0 .. e (step 0's keys) and to its own entries of steps 1 .. j at e (the
provisional entries the cache holds when drafting), and predicts the target's distribution at
e + j. The loss of step j is weighted 0.8^j (SpecForge's).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .eagle3 import Eagle3Head

STEP_WEIGHT = 0.8


def shifted_features(head: Eagle3Head, layer_inputs: torch.Tensor) -> torch.Tensor:
    """Entry features [B, T, hidden] from the target's layer inputs [B, T, 3 x target hidden]:
    entry e takes position e - 1's projection, entry 0 a zero vector."""
    projected = head.fc(layer_inputs)
    return F.pad(projected[:, :-1], (0, 0, 1, 0))


def _qkv(head: Eagle3Head, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor):
    layer = head.layers[0]
    attn = layer.self_attn
    b, t = tokens.shape
    normed = layer.hidden_norm(features)
    residual = normed if layer.norm_before_residual else features
    x = torch.cat([layer.input_layernorm(head.embed_tokens(tokens)), normed], dim=-1)
    q = attn.q_proj(x).view(b, t, -1, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(b, t, -1, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(b, t, -1, attn.head_dim).transpose(1, 2)
    cos, sin = head.rotary_emb(x, positions)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    groups = q.shape[1] // k.shape[1]
    return q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), residual


def _finish(head: Eagle3Head, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    layer = head.layers[0]
    b, _, t, _ = attended.shape
    x = residual + layer.self_attn.o_proj(attended.transpose(1, 2).reshape(b, t, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def unrolled(head: Eagle3Head, tokens: torch.Tensor, features: torch.Tensor, steps: int):
    """The draft logits [B, T, draft vocabulary] of each unrolled step (module doc): step j's row
    e predicts the target's token after position e + j. `features`: shifted_features()."""
    b, t = tokens.shape
    device = tokens.device
    base = torch.arange(t, device=device)
    causal = base[None, :] <= base[:, None]                     # [query e, key e']
    scale = 1.0 / math.sqrt(head.layers[0].self_attn.head_dim)
    outs, diag_k, diag_v = [], [], []
    k0 = v0 = None
    for j in range(steps):
        step_tokens = F.pad(tokens[:, j:], (0, j), value=0)
        q, k, v, residual = _qkv(head, step_tokens, features, (base + j)[None].expand(b, -1))
        if j == 0:
            k0, v0 = k, v
            scores = (q @ k0.transpose(-1, -2)) * scale
            weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            attended = weights @ v0
        else:
            diag_k.append(k)
            diag_v.append(v)
            scores = (q @ k0.transpose(-1, -2)) * scale
            scores = scores.masked_fill(~causal, float("-inf"))
            own = torch.stack([(q * dk).sum(-1) for dk in diag_k], -1) * scale   # [B, h, T, j]
            weights = torch.cat([scores, own], -1).softmax(-1)
            attended = weights[..., :t] @ v0 + (weights[..., t:, None] * torch.stack(diag_v, -2)).sum(-2)
        hidden = _finish(head, attended, residual)
        outs.append(head.lm_head(head.norm(hidden)))
        features = hidden
    return outs


def ttt_loss(head: Eagle3Head, tokens, layer_inputs, target_probs, mask, steps: int):
    """Training-time-test loss and per-step agreement. `target_probs` [B, T, draft vocabulary]:
    the target's distribution at each position over the draft vocabulary (renormalised);
    `mask` [B, T]: positions that count. Returns (loss, [agreement of step j's argmax with the
    target's argmax], [positions counted per step])."""
    outs = unrolled(head, tokens, shifted_features(head, layer_inputs), steps)
    loss, agree, counted = 0.0, [], []
    for j, logits in enumerate(outs):
        probs = F.pad(target_probs[:, j:], (0, 0, 0, j))
        m = F.pad(mask[:, j:], (0, j)).float()
        ce = -(probs * logits.float().log_softmax(-1)).sum(-1)
        n = m.sum().clamp_min(1.0)
        loss = loss + STEP_WEIGHT ** j * (ce * m).sum() / n
        agree.append(float(((logits.argmax(-1) == probs.argmax(-1)).float() * m).sum()))
        counted.append(float(m.sum()))
    return loss, agree, counted
