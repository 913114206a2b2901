"""A tiny EAGLE-3 head trained for a test target with the project's own training code
(exspec.models.eagle3_training), so that its drafts are kept often enough for equality to
prove something, and the offline reference of what a head drafts."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from exspec.models.eagle3 import head_for, save_head
from exspec.models.eagle3_training import shifted_features, ttt_loss, unrolled
from exspec.models.layer_inputs import LayerInputs


def continuations(target, prompts: list[list[int]], tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt with the target's greedy continuation, right-padded [N, T], and which
    positions are continuation tokens' predecessors (the head's training positions) [N, T]."""
    seqs = []
    with torch.no_grad():
        for p in prompts:
            out = target.generate(torch.tensor([p]), max_new_tokens=tokens, min_new_tokens=tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
            seqs.append(out[0].tolist())
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for row, (s, p) in enumerate(zip(seqs, prompts)):
        ids[row, :len(s)] = torch.tensor(s)
        mask[row, len(p) - 1:len(s) - 1] = True
    return ids, mask


def train_head(target, out: str, layer_ids: tuple[int, ...], prompts: list[list[int]],
               draft_size: int | None = None, batches: int = 300, seed: int = 0) -> str:
    """Train a head on the target's (a model, or its folder) greedy continuations of `prompts`
    (3 unrolled steps); `draft_size`: a reduced draft vocabulary (the target's most picked ids,
    through d2t), else the whole. Returns `out`."""
    torch.manual_seed(seed)
    if isinstance(target, str):
        target = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    seqs, mask = continuations(target, prompts, 40)
    with torch.no_grad():
        tap = LayerInputs(target, layer_ids)
        probs = target(input_ids=seqs, use_cache=False).logits.softmax(-1)
        states = torch.cat(tap.take(), dim=-1)
    picks = torch.bincount(probs.argmax(-1)[mask], minlength=probs.shape[-1])
    draft_ids = sorted(picks.argsort(descending=True)[:draft_size].tolist()) if draft_size else None
    head = head_for(target, layer_ids, draft_ids=draft_ids)
    head.embed_tokens.weight.requires_grad_(False)
    if draft_ids is not None:
        probs = probs[..., draft_ids]
        probs = probs / probs.sum(-1, keepdim=True)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    order = torch.Generator().manual_seed(seed)
    head.train()
    for _ in range(batches):
        rows = torch.randperm(len(seqs), generator=order)[:16]
        loss, _, _ = ttt_loss(head, seqs[rows], states[rows], probs[rows], mask[rows], steps=3)
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_head(head.eval(), out, dtype=torch.float32)
    return out


@torch.no_grad()
def first_drafts(target, head, sequence: list[int]) -> list[int]:
    """What the head drafts first at every position of a sequence, computed offline in one pass
    (the training code's step 0): entry e's draft predicts token e + 1."""
    tap = LayerInputs(target, head.layer_ids)
    ids = torch.tensor([sequence])
    target(input_ids=ids, use_cache=False)
    features = shifted_features(head, torch.cat(tap.take(), dim=-1))
    return head.target_logits(unrolled(head, ids, features, 1)[0])[0].argmax(-1).tolist()
