#!/usr/bin/env python
"""Train the real pair's draft: a narrow Llama that shares SmolLM2-135M-Instruct's tokenizer,
distilled from the target's own chat answers. Reproducible from the seed, no network (the
target comes from `python -m exspec.models.real_pair`).

Steps (each one's output is kept in --work and reused by a later run with the same settings):
 1. questions  the target writes user turns itself: its chat template's user header plus an
               opening word from OPENERS, sampled at T = 1, top-p 0.95; duplicates and the
               benchmark's QUESTIONS (held out for measuring) are dropped.
 2. answers    the target answers each one through the chat template (3 in 4 greedy, 1 in 4
               sampled at T = 0.7, as served requests are), up to --answer-tokens tokens,
               keeping its top-TOP_K log-probabilities at every answer position.
 3. draft      embeddings (tied to the head) = the target's embeddings projected on their top
               --hidden principal directions, so the draft starts in the target's token space;
               decoder layers random. Loss per answer position: cross-entropy against the
               target's top-TOP_K distribution plus cross-entropy on its argmax.
 4. measure    draft/target decode cost at B = 1 (measure_costs) and greedy acceptance at k = 4
               on the held-out QUESTIONS (simulate_acceptance), one torch thread.

Output (default model_repository/exspec/1/smollm2_draft/): model.safetensors (float16; the
config says float32, so it loads and runs in float32), config.json, generation_config.json,
metrics.json, model_card.md, loss_curve.png. `python -m exspec.models.real_pair` installs it next to
the converted target.

    python scripts/train_smollm2_draft.py                 # full run, ~1 h 45 min on 2 cores
    python scripts/train_smollm2_draft.py --tiny --out /tmp/d --work /tmp/w   # smoke, ~1 min
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_pair import (dir_size, lr_at, machine_info, make_opt,  # noqa: E402
                             measure_costs, simulate_acceptance)

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "backend"))
from exspec.models.real_pair import DRAFT_DIR, IM_END, PAIR_DIR, QUESTIONS, chat_prompt  # noqa: E402

TOP_K = 32
OPENERS = ["Write", "How", "What", "Explain", "Can you", "Give me", "Why", "List", "Describe",
           "Create", "Summarize", "Compare", "Help me", "Tell me", "Is it", "Suggest", "I need",
           "Please", "Who", "When", "Which", "Translate", "Rewrite", "Generate", "Solve",
           "Calculate", "Define", "Plan", "Design", "Fix", "Implement", "Recommend"]


def make_questions(target, tok, n, batch, seed, exclude=frozenset()):
    """n distinct user turns written by the target, none of them in `exclude` (see step 1)."""
    header = chat_prompt(tok, "X").split("<|im_start|>user")[0] + "<|im_start|>user\n"
    held_out = {q for _, q in QUESTIONS}
    rng = random.Random(seed)
    torch.manual_seed(seed)
    seen, out = set(exclude), []
    bar = tqdm(total=n, desc="questions", dynamic_ncols=True)
    while len(out) < n:
        openers = [rng.choice(OPENERS) for _ in range(batch)]
        enc = tok([header + o for o in openers], return_tensors="pt", padding=True,
                  add_special_tokens=False)
        gen = target.generate(**enc, max_new_tokens=48, do_sample=True, temperature=1.0,
                              top_p=0.95, eos_token_id=IM_END, pad_token_id=IM_END)
        for o, row in zip(openers, gen[:, enc["input_ids"].shape[1]:]):
            ids = row.tolist()
            if IM_END not in ids:        # cut off mid-question: not a whole turn
                continue
            q = (o + tok.decode(ids[: ids.index(IM_END)])).strip()
            if len(q.split()) < 4 or q in seen or q in held_out:
                continue
            seen.add(q)
            out.append(q)
            bar.update(1)
    bar.close()
    return out[:n]


def load_or_make_data(target, tok, work: Path, seed, n_questions, answer_tokens, earlier):
    """One data chunk (questions, answers) for a seed, made once and kept in `work`; a stage
    reused from there reports the time it took when it was made. Questions already in
    `earlier` chunks are not asked again."""
    key = f"seed{seed}-q{n_questions}"
    qpath = work / f"questions-{key}.json"
    apath = work / f"answers-{key}-a{answer_tokens}.pt"
    times_path = work / f"times-{key}-a{answer_tokens}.json"
    times = json.loads(times_path.read_text()) if times_path.exists() else {}
    if not qpath.exists():
        t0 = time.monotonic()
        qs = make_questions(target, tok, n_questions, 64, seed, exclude=set(earlier))
        qpath.write_text(json.dumps(qs))
        times["questions"] = time.monotonic() - t0
    questions = json.loads(qpath.read_text())
    if not apath.exists():
        t0 = time.monotonic()
        torch.save(make_answers(target, tok, questions, answer_tokens, 32, seed), apath)
        times["answers"] = time.monotonic() - t0
    times_path.write_text(json.dumps(times))
    return torch.load(apath), times, questions


@torch.no_grad()
def make_answers(target, tok, questions, max_tokens, batch, seed):
    """Per question: ids (prompt + answer), answer start, and the target's top-TOP_K
    log-probabilities (indices, values) predicting each answer token (see step 2)."""
    torch.manual_seed(seed)
    prompts = [chat_prompt(tok, q) for q in questions]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # less padding
    examples = [None] * len(prompts)
    for start in tqdm(range(0, len(order), batch), desc="answers", dynamic_ncols=True):
        idx = order[start: start + batch]
        sampled = (start // batch) % 4 == 3
        enc = tok([prompts[i] for i in idx], return_tensors="pt", padding=True,
                  add_special_tokens=False)
        gen = target.generate(**enc, max_new_tokens=max_tokens, do_sample=sampled,
                              temperature=0.7 if sampled else None, top_p=None, top_k=None,
                              eos_token_id=IM_END, pad_token_id=IM_END, output_logits=True,
                              return_dict_in_generate=True)
        logp = torch.stack(gen.logits, 1).float().log_softmax(-1)   # (batch, steps, vocab)
        top_v, top_i = logp.topk(TOP_K, dim=-1)
        plen = enc["input_ids"].shape[1]
        for r, i in enumerate(idx):
            answer = gen.sequences[r, plen:].tolist()
            n = answer.index(IM_END) + 1 if IM_END in answer else len(answer)
            prompt = enc["input_ids"][r][enc["attention_mask"][r].bool()].tolist()
            examples[i] = {"ids": torch.tensor(prompt + answer[:n], dtype=torch.int32),
                           "start": len(prompt), "sampled": sampled,
                           "top_i": top_i[r, :n].to(torch.int32).clone(),
                           "top_v": top_v[r, :n].half().clone()}
    return examples


def make_draft(target, hidden, layers, inter, heads, kv_heads):
    """A Llama with the target's tokenizer and rotary settings, narrower and shallower; its
    embeddings are the target's projected on their top principal directions."""
    from transformers import LlamaConfig, LlamaForCausalLM
    tc = target.config
    cfg = LlamaConfig(vocab_size=tc.vocab_size, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=hidden // heads,
                      max_position_embeddings=tc.max_position_embeddings,
                      rope_parameters=dict(tc.rope_parameters), rms_norm_eps=tc.rms_norm_eps,
                      tie_word_embeddings=True, bos_token_id=tc.bos_token_id,
                      eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id)
    draft = LlamaForCausalLM(cfg)
    emb = target.get_input_embeddings().weight.detach().float()
    _, _, v = torch.linalg.svd(emb - emb.mean(0), full_matrices=False)
    proj = emb @ v[:hidden].T
    proj *= emb.std() / proj.std()
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(proj)
    return draft


def batches(examples, batch, rng):
    """Length-bucketed batches in a shuffled order: (ids, attention mask, rows, cols, top_i,
    top_v), rows/cols naming the positions that predict an answer token."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["ids"]))
    chunks = [order[i: i + batch] for i in range(0, len(order), batch)]
    rng.shuffle(chunks)
    for chunk in chunks:
        ex = [examples[i] for i in chunk]
        width = max(len(e["ids"]) for e in ex)
        ids = torch.full((len(ex), width), IM_END, dtype=torch.long)
        mask = torch.zeros((len(ex), width), dtype=torch.long)
        rows, cols = [], []
        for r, e in enumerate(ex):
            ids[r, : len(e["ids"])] = e["ids"].long()
            mask[r, : len(e["ids"])] = 1
            n = len(e["top_i"])
            rows += [r] * n
            cols += range(e["start"] - 1, e["start"] - 1 + n)
        yield (ids, mask, torch.tensor(rows), torch.tensor(cols),
               torch.cat([e["top_i"] for e in ex]).long(),
               torch.cat([e["top_v"] for e in ex]).float())


def distil_loss(draft, ids, mask, rows, cols, top_i, top_v):
    """(soft + hard cross-entropy, top-1 agreement with the target) at the answer positions;
    the head runs only where there is a target to match."""
    hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state[rows, cols]
    logq = draft.lm_head(hidden).float().log_softmax(-1)
    p = top_v.softmax(-1)                       # the target's top-K, renormalised
    soft = -(p * logq.gather(-1, top_i)).sum(-1).mean()
    hard = F.nll_loss(logq, top_i[:, 0])
    agree = (logq.argmax(-1) == top_i[:, 0]).float().mean()
    return soft + hard, agree


@torch.no_grad()
def held_out_agreement(draft, examples, batch):
    draft.eval()
    hits = total = 0
    for b in batches(examples, batch, random.Random(0)):
        _, agree = distil_loss(draft, *b)
        hits += agree.item() * len(b[2])
        total += len(b[2])
    draft.train()
    return hits / max(1, total)


def train(draft, train_set, val_set, epochs, batch, lr, seed):
    torch.manual_seed(seed)
    rng = random.Random(seed)
    steps = epochs * ((len(train_set) + batch - 1) // batch)
    opt = make_opt(draft, lr)
    curve = {"step": [], "loss": [], "agree": [], "val_step": [], "val_agree": []}
    draft.train()
    bar = tqdm(total=steps, desc="draft", dynamic_ncols=True)
    step = 0
    for epoch in range(epochs):
        for b in batches(train_set, batch, rng):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps, lr)
            loss, agree = distil_loss(draft, *b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
            curve["step"].append(step)
            curve["loss"].append(round(loss.item(), 4))
            curve["agree"].append(round(agree.item(), 4))
            step += 1
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}", agree=f"{agree.item():.3f}")
        curve["val_step"].append(step)
        curve["val_agree"].append(round(held_out_agreement(draft, val_set, batch), 4))
        tqdm.write(f"epoch {epoch}: held-out top-1 agreement {curve['val_agree'][-1]:.3f}")
    bar.close()
    return curve


def plot_curve(curve, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    ax[0].plot(curve["step"], curve["loss"], lw=0.8)
    ax[0].set(xlabel="step", ylabel="loss (soft + hard CE)", title="training loss")
    ax[1].plot(curve["step"], curve["agree"], lw=0.6, alpha=0.5, label="train batch")
    ax[1].plot(curve["val_step"], curve["val_agree"], "o-", label="held-out answers")
    ax[1].set(xlabel="step", ylabel="top-1 agreement with target", title="agreement")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def save_draft(draft, out: Path):
    from transformers import GenerationConfig
    out.mkdir(parents=True, exist_ok=True)
    draft.generation_config = GenerationConfig(eos_token_id=IM_END, pad_token_id=IM_END,
                                               bos_token_id=draft.config.bos_token_id)
    draft.to(torch.float16).save_pretrained(out, safe_serialization=True)
    draft.to(torch.float32)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = "float32"   # float16 on disk, float32 when loaded
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def write_card(out: Path, m: dict):
    s, cost, acc = m["settings"], m["cost"], m["acceptance"]
    lines = [
        "# Draft for SmolLM2-135M-Instruct (exspec's real pair)",
        "",
        "A narrow Llama sharing the target's tokenizer (vocabulary 49,152, ChatML template),",
        "distilled from the target's own answers to questions the target wrote itself; made by",
        "`scripts/train_smollm2_draft.py` (seed %d). Weights float16 on disk (%.1f MB), float32"
        % (s["seed"], m["weights_bytes"] / 1e6),
        "when loaded. Licence: derived from SmolLM2-135M-Instruct (Apache-2.0).",
        "",
        "| | target | draft |",
        "|---|---|---|",
        f"| layers / hidden / MLP / heads (kv) | 30 / 576 / 1536 / 9 (3) | {s['layers']} / "
        f"{s['hidden']} / {s['inter']} / {s['heads']} ({s['kv_heads']}) |",
        f"| parameters | {m['target_params']:,} | {m['draft_params']:,} |",
        f"| decode forward, B = 1, 1 thread | {cost['target_decode_ms']:.1f} ms | "
        f"{cost['draft_decode_ms']:.2f} ms (ratio {cost['ratio_decode']:.3f}) |",
        "",
        f"Data: {m['questions']} questions (data seeds "
        f"{', '.join(map(str, s.get('data_seeds', [s['seed']])))}), {m['answer_tokens']:,} answer tokens "
        f"({m['sampled_share']:.0%} of answers sampled at T = 0.7), {m['val_examples']} held "
        f"out. Training: {s['epochs']} epochs, batch {s['batch']}, AdamW peak lr {s['lr']}.",
        f"Times: questions {m['time_questions_s'] / 60:.1f} min, answers "
        f"{m['time_answers_s'] / 60:.1f} min, training {m['time_train_s'] / 60:.1f} min "
        f"({m['machine']['cpu']}, {s['threads']} torch threads).",
        "",
        f"Held-out top-1 agreement with the target per epoch: "
        f"{', '.join(f'{a:.3f}' for a in m['curve']['val_agree'])} (loss_curve.png).",
        f"Greedy speculative decoding at k = {acc['k']} on the benchmark's held-out questions "
        f"({acc['prompts']} prompts, {acc['tokens']} tokens): acceptance rate "
        f"{acc['acceptance_rate']:.3f}, {acc['mean_accepted_length']:.2f} tokens per step.",
        "",
    ]
    (out / "model_card.md").write_text("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DRAFT_DIR)
    ap.add_argument("--work", type=Path, default=PAIR_DIR.parent / "smollm2-draft-work")
    ap.add_argument("--pair", type=Path, default=PAIR_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for making data "
                    "and training (measurements always use 1)")
    ap.add_argument("--questions", type=int, default=2400, help="questions per data seed")
    ap.add_argument("--data-seeds", type=lambda v: [int(x) for x in v.split(",")], default=[0, 1],
                    help="one chunk of --questions answered questions per seed, e.g. 0,1; the "
                    "held-out answers are always the first seed's")
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--tiny", action="store_true", help="a minute-long smoke run")
    args = ap.parse_args(argv)
    if args.tiny:
        args.questions, args.answer_tokens, args.epochs, args.layers = 24, 16, 1, 1
        args.data_seeds = [0]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.pair / "target")
    tok.padding_side = "left"
    target = AutoModelForCausalLM.from_pretrained(args.pair / "target", dtype=torch.float32)
    target.eval()
    args.work.mkdir(parents=True, exist_ok=True)

    # data comes in chunks of --questions, one per data seed; the held-out answers are always
    # the first seed's (the same 5% whatever is added), so agreement compares across data sizes
    examples, times, questions = [], {}, []
    for data_seed in args.data_seeds:
        chunk, chunk_times, chunk_questions = load_or_make_data(
            target, tok, args.work, data_seed, args.questions, args.answer_tokens, questions)
        random.Random(data_seed).shuffle(chunk)
        examples.append(chunk)
        questions += chunk_questions
        for k, v in chunk_times.items():
            times[k] = times.get(k, 0.0) + v
    n_val = max(1, len(examples[0]) // 20)
    val_set = examples[0][:n_val]
    train_set = examples[0][n_val:] + [e for chunk in examples[1:] for e in chunk]
    examples = [e for chunk in examples for e in chunk]
    torch.manual_seed(args.seed)
    draft = make_draft(target, args.hidden, args.layers, args.inter, args.heads, args.kv_heads)
    t0 = time.monotonic()
    curve = train(draft, train_set, val_set, args.epochs, args.batch, args.lr, args.seed)
    times["train"] = time.monotonic() - t0
    save_draft(draft, args.out)
    plot_curve(curve, args.out / "loss_curve.png")

    torch.set_num_threads(1)
    draft.eval()
    cost = measure_costs(target, draft, len(tok), 60, context=200, prefill=32)
    acc = simulate_acceptance(target, draft, tok, [chat_prompt(tok, q) for _, q in QUESTIONS],
                              96, 4)
    acc["k"] = 4
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "work", "pair")}
    metrics = {
        "settings": settings, "cost": cost, "acceptance": acc, "curve": curve,
        "questions": len(questions), "val_examples": n_val,
        "answer_tokens": sum(len(e["top_i"]) for e in examples),
        "sampled_share": statistics.mean(e["sampled"] for e in examples),
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "weights_bytes": (args.out / "model.safetensors").stat().st_size,
        "total_bytes": dir_size(args.out), "machine": machine_info(),
        **{f"time_{k}_s": round(v, 1) for k, v in times.items()},  # absent: made before times were kept
    }
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    write_card(args.out, metrics)
    print(json.dumps({"cost": cost, "acceptance": acc, "val_agree": curve["val_agree"],
                      "times": times}, indent=1))


if __name__ == "__main__":
    main()
