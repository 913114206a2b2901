#!/usr/bin/env python
"""Train an EAGLE-3 head for SmolLM2-135M-Instruct (models/eagle3.py, models/eagle3_training.py).
Reproducible from the seed, no network (the target comes from `python -m exspec.models.real_pair`).

Steps (each one's output is kept and reused by a later run with the same settings):
 1. data      user turns the target wrote (the benchmark's QUESTIONS held out, as for the draft:
              scripts/train_smollm2_draft.py), and its answers made by the engine itself at
              batch 32, target only: greedy, every fourth question sampled at temperature 0.7.
              Both are kept in --data (default scripts/data/smollm2_eagle3/, committed): the
              questions as text, the answers as token ids in chunks of CHUNK questions, each
              written as it is done, so a run (or a session) that stops goes on from there and
              a larger --questions only adds chunks (`--data-only` makes them and stops).
 2. features  the target once over every example: its layers' inputs at the head's layer ids
              (vLLM's defaults 2, 15, 27) in float16 and its top-32 log-probabilities per answer
              position (the soft labels; with --questions-too the question's positions as
              well), kept in --work: not recomputed per batch (a target
              forward costs ~3x a head training step here).
 3. vocab     the draft vocabulary: the --draft-vocab ids the target picks most often in the
              training answers (the coverage of held-out picks is reported for it and for
              2k-32k ids, to size the next one by).
 4. train     training-time test over --steps unrolled steps (loss weights 0.8^j), soft labels =
              the target's top-32 distribution renormalised over the draft vocabulary; lm_head
              and norm start from the target's, fc from the high layer; AdamW, warm-up + cosine;
              a checkpoint every --save-every batches in --work (a rerun resumes there).
 5. measure   held-out agreement per unrolled step (the curve), then acceptance through the
              engine on the held-out QUESTIONS at k = 4 (B = 1, greedy, fixed k).

Output (default model_repository/exspec/1/smollm2_eagle3/): config.json + model.safetensors in
vLLM's llama_eagle3 layout (float16; embeddings shared with the target, not saved),
metrics.json, curve.png.

    python scripts/train_smollm2_eagle3.py                  # with the committed data, ~50 min on
                                                            # 2 cores (AMD EPYC)
    python scripts/train_smollm2_eagle3.py --init model_repository/exspec/1/smollm2_eagle3
                                                            # 2 more epochs (~30 min): the
                                                            # committed head is the two in turn
    python scripts/train_smollm2_eagle3.py --tiny --out /tmp/h --work /tmp/w   # smoke, ~2-3 min
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_pair import lr_at, machine_info, make_opt  # noqa: E402
from train_smollm2_draft import TOP_K, make_questions  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "backend"))
from exspec.models.eagle3 import head_for, load_head, save_head  # noqa: E402
from exspec.models.eagle3_training import ttt_loss  # noqa: E402
from exspec.models.layer_inputs import LayerInputs  # noqa: E402
from exspec.models.real_pair import HEAD_DIR, IM_END, PAIR_DIR, QUESTIONS, chat_prompt  # noqa: E402

CHUNK = 64   # questions answered per kept file
# The questions and the answers' token ids are committed here (~25 KB per CHUNK): a session
# makes what it has time for and the next goes on from there; the target's top-32 per answer
# position (~1.5 MB per CHUNK) is recomputed with the features, from the ids.
DATA_DIR = Path(__file__).resolve().parent / "data" / "smollm2_eagle3"


def load_or_make_questions(target, tok, data: Path, n: int, seed: int = 0) -> list[str]:
    """The first n questions of the kept pool, written by the target where it is short."""
    path = data / f"questions-seed{seed}.json"
    pool = json.loads(path.read_text()) if path.exists() else []
    while len(pool) < n:   # kept every 5 chunks' worth; a new seed each, so they are new draws
        pool += make_questions(target, tok, min(5 * CHUNK, n - len(pool)), 64, seed + len(pool),
                               exclude=set(pool))
        path.write_text(json.dumps(pool, indent=0) + "\n")
    return pool[:n]


def seed_questions(committed: Path, data: Path, n: int, seed: int = 0) -> None:
    """A smoke run's questions: the committed pool's first n, so that it writes only its short
    answers (the target writes a question in ~18 s on a 2-core CPU)."""
    path = data / f"questions-seed{seed}.json"
    if not path.exists():
        data.mkdir(parents=True, exist_ok=True)
        pool = json.loads((committed / path.name).read_text())[:n]
        path.write_text(json.dumps(pool, indent=0) + "\n")


def answer_chunk_path(data: Path, seed: int, answer_tokens: int, start: int) -> Path:
    return data / f"answers-seed{seed}-a{answer_tokens}-{start:05d}.npz"


def save_answer_chunk(path: Path, answers: list[list[int]], sampled: list[bool]) -> None:
    flat = [t for a in answers for t in a]
    assert max(flat, default=0) < 2 ** 16, "token ids must fit uint16"
    np.savez_compressed(path, tokens=np.array(flat, dtype=np.uint16),
                        lengths=np.array([len(a) for a in answers], dtype=np.int32),
                        sampled=np.array(sampled, dtype=bool))


def load_answer_chunk(path: Path) -> tuple[list[list[int]], list[bool]]:
    kept = np.load(path)
    ends = np.cumsum(kept["lengths"])
    tokens = kept["tokens"].astype(np.int64)
    answers = [tokens[e - n:e].tolist() for e, n in zip(ends, kept["lengths"])]
    return answers, kept["sampled"].tolist()


def answer_engine(pair: Path, threads: int):
    """The engine itself, target only, at batch 32: it makes the answers."""
    from exspec import EngineConfig, LLMEngine
    return LLMEngine(EngineConfig(target_model=str(pair / "target"), method="autoregressive",
                                  max_batch_size=32, torch_threads=threads))


def make_answer_chunk(engine, prompts: list[list[int]], first: int, answer_tokens: int, seed: int):
    """Greedy answers, but every fourth question sampled (temperature 0.7, its own seed) for
    broader text; each stops after the target's <|im_end|>, which it keeps."""
    from exspec import SamplingParams
    sampled = [(first + i) % 4 == 3 for i in range(len(prompts))]
    params = [SamplingParams(max_tokens=answer_tokens, stop_token_ids=[IM_END],
                             temperature=0.7 if s else 0.0, seed=seed + first + i)
              for i, s in enumerate(sampled)]
    return [o.token_ids for o in engine.generate(prompts, params)], sampled


def load_or_make_data(target, tok, pair: Path, data: Path, n_questions: int, answer_tokens: int,
                      threads: int, seed: int = 0):
    """n_questions examples: prompt + answer ids and the answer's start. Answers come from the
    chunks kept in `data`; a missing chunk is made (and kept there) by the engine."""
    # whole chunks only, so a later run with more questions finds every kept chunk complete
    questions = load_or_make_questions(target, tok, data, -(-n_questions // CHUNK) * CHUNK, seed)
    prompts = [tok(chat_prompt(tok, q), add_special_tokens=False)["input_ids"] for q in questions]
    starts = range(0, len(questions), CHUNK)
    missing = [s for s in starts if not answer_chunk_path(data, seed, answer_tokens, s).exists()]
    engine, made = (answer_engine(pair, threads) if missing else None), 0
    bar = tqdm(total=len(questions), desc="answers", unit="q", dynamic_ncols=True)
    bar.update(len(questions) - sum(len(prompts[s:s + CHUNK]) for s in missing))
    t0 = time.monotonic()
    for s in missing:
        answers, sampled = make_answer_chunk(engine, prompts[s:s + CHUNK], s, answer_tokens, seed)
        save_answer_chunk(answer_chunk_path(data, seed, answer_tokens, s), answers, sampled)
        made += sum(map(len, answers))
        bar.update(len(answers))
        bar.set_postfix(tokens_per_s=f"{made / (time.monotonic() - t0):.0f}")
    bar.close()
    examples = []
    for s in starts:
        answers, sampled = load_answer_chunk(answer_chunk_path(data, seed, answer_tokens, s))
        for prompt, answer, was_sampled in zip(prompts[s:s + CHUNK], answers, sampled):
            examples.append({"ids": torch.tensor(prompt + answer, dtype=torch.int32),
                             "start": len(prompt), "sampled": was_sampled})
    return examples[:n_questions], ({"answers": time.monotonic() - t0} if missing else {})


def learn_from(examples, questions_too: bool) -> None:
    """Sets each example's first labelled token: its answer's first, or with `questions_too` its
    question's (the target wrote those too; the chat template before them is the same in every
    example, nothing to learn)."""
    shared = len(os.path.commonprefix([e["ids"][:e["start"]].tolist() for e in examples]))
    for e in examples:
        e["learn_from"] = shared if questions_too else e["start"]


@torch.no_grad()
def make_features(target, examples, layer_ids, batch: int = 16):
    """Per example: [T, 3 x hidden] float16, the inputs of the head's target layers, and the
    target's top-TOP_K log-probabilities predicting each token from its "learn_from" on (indices
    int32, values float16), from one forward over prompt + answer. Each is a view into one tensor allocated
    up front: thousands of small copies between each batch's large temporaries fragmented the
    heap until 3,200 examples filled 24 GB."""
    tap = LayerInputs(target, layer_ids)
    lengths = [len(e["ids"]) for e in examples]
    labelled = [n - e["learn_from"] for n, e in zip(lengths, examples)]
    at = [0] + list(itertools.accumulate(lengths))
    at_label = [0] + list(itertools.accumulate(labelled))
    width3 = len(layer_ids) * target.config.hidden_size
    all_features = torch.empty(at[-1], width3, dtype=torch.float16)
    all_top_i = torch.empty(at_label[-1], TOP_K, dtype=torch.int32)
    all_top_v = torch.empty(at_label[-1], TOP_K, dtype=torch.float16)
    order = sorted(range(len(examples)), key=lambda i: lengths[i])
    for start in tqdm(range(0, len(order), batch), desc="features", dynamic_ncols=True):
        idx = order[start:start + batch]
        width = max(lengths[i] for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, :lengths[i]], mask[r, :lengths[i]] = examples[i]["ids"].long(), 1
        hidden = target.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        states = torch.cat(tap.take(), dim=-1)
        for r, i in enumerate(idx):
            n, s = lengths[i], examples[i]["learn_from"]
            all_features[at[i]:at[i + 1]] = states[r, :n]
            # position s + t - 1 predicts labelled token t
            logp = target.lm_head(hidden[r, s - 1:n - 1]).float().log_softmax(-1)
            v, t = logp.topk(TOP_K, dim=-1)
            all_top_i[at_label[i]:at_label[i + 1]] = t
            all_top_v[at_label[i]:at_label[i + 1]] = v
    features = [all_features[at[i]:at[i + 1]] for i in range(len(examples))]
    top = [(all_top_i[at_label[i]:at_label[i + 1]], all_top_v[at_label[i]:at_label[i + 1]])
           for i in range(len(examples))]
    return features, top


def answer_picks(e) -> list[int]:
    """The target's argmax at each answer position (the labels may start in the question)."""
    return e["top_i"][e["start"] - e["learn_from"]:, 0].tolist()


def draft_vocab(examples, size: int) -> list[int]:
    """The `size` ids the target picks most often in these answers (its argmax per position)."""
    counts = Counter()
    for e in examples:
        counts.update(answer_picks(e))
    return sorted(t for t, _ in counts.most_common(size))


def coverage(examples, vocab: list[int]) -> float:
    inside = set(vocab)
    picks = [t for e in examples for t in answer_picks(e)]
    return sum(t in inside for t in picks) / max(1, len(picks))


def make_batch(examples, features, index, to_draft: torch.Tensor, draft_size: int,
               answers_only: bool = False):
    """Tokens [B, T], layer inputs [B, T, 3H], the target's distribution over the draft
    vocabulary at each position [B, T, draft], and the positions that count [B, T] (labelled
    positions, or with `answers_only` answer positions, whose top-32 reaches the draft
    vocabulary)."""
    width = max(len(examples[i]["ids"]) for i in index)
    b = len(index)
    tokens = torch.zeros(b, width, dtype=torch.long)
    states = torch.zeros(b, width, features[index[0]].shape[-1])
    probs = torch.zeros(b, width, draft_size)
    mask = torch.zeros(b, width, dtype=torch.bool)
    for r, i in enumerate(index):
        e = examples[i]
        n, start = len(e["ids"]), e["learn_from"]
        tokens[r, :n] = e["ids"].long()
        states[r, :n] = features[i].float()
        # top_i[t] is the target's distribution predicting labelled token t: position start + t - 1
        rows = torch.arange(len(e["top_i"])) + start - 1
        ids = to_draft[e["top_i"].long()]                       # [n_labelled, 32], -1 outside
        p = e["top_v"].float().exp() * (ids >= 0)
        total = p.sum(-1, keepdim=True)
        p = p / total.clamp_min(1e-9)
        dense = torch.zeros(len(rows), draft_size)
        dense.scatter_add_(1, ids.clamp_min(0), p)
        probs[r, rows] = dense
        mask[r, rows] = total[:, 0] > 0
        if answers_only:
            mask[r, :e["start"] - 1] = False
    return tokens, states, probs, mask


@torch.no_grad()
def agreement(head, examples, features, index, to_draft, draft_size, steps, batch):
    head.eval()
    agree, counted = [0.0] * steps, [0.0] * steps
    for s in range(0, len(index), batch):
        tokens, states, probs, mask = make_batch(examples, features, index[s:s + batch], to_draft,
                                                 draft_size, answers_only=True)   # what serving drafts
        _, a, c = ttt_loss(head, tokens, states, probs, mask, steps)
        agree = [x + y for x, y in zip(agree, a)]
        counted = [x + y for x, y in zip(counted, c)]
    head.train()
    return [a / max(1.0, c) for a, c in zip(agree, counted)]


def new_head(target, layer_ids, vocab: list[int]):
    head = head_for(target, layer_ids, draft_ids=vocab)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[vocab])
        head.norm.weight.copy_(target.model.norm.weight)
        hidden = head.config.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, -hidden:] = torch.eye(hidden)   # start from the high layer's state
    head.embed_tokens.weight.requires_grad_(False)
    return head


def continued_head(folder: Path, target, vocab: list[int]):
    """A head trained before (--init), to train on: a session too short for the whole schedule
    leaves a head that the next one continues (the optimizer's moments start afresh)."""
    head = load_head(str(folder), target, torch.float32, "cpu").requires_grad_(True)   # loaded to serve
    if head.draft_ids.tolist() != vocab:
        raise SystemExit(f"--init {folder}: its draft vocabulary ({len(head.draft_ids)} ids) is not "
                         f"this data's {len(vocab)} most-picked ids; train it with the data it was "
                         "trained on (--questions, --draft-vocab) or start afresh without --init")
    head.embed_tokens.weight.requires_grad_(False)
    return head


def train(head, examples, features, train_idx, val_idx, to_draft, args, ckpt: Path):
    draft_size = head.config.draft_vocab_size
    trainable = [p for p in head.parameters() if p.requires_grad]
    opt = make_opt(head, args.lr)   # the shared embeddings are frozen: no gradient, no step
    rng = random.Random(args.seed)
    batches_per_epoch = len(train_idx) // args.batch
    total = batches_per_epoch * args.epochs
    state = {"step": 0, "curve": {"step": [], "loss": [], "val_step": [], "val_agree": []}}
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        head.load_state_dict(saved["head"], strict=False)
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        print(f"resumed at batch {state['step']} of {total}")
    order = []
    for epoch in range(args.epochs):   # the whole schedule up front: a resume skips into it
        chunk = list(train_idx)
        rng.shuffle(chunk)
        order += [chunk[i:i + args.batch] for i in range(0, batches_per_epoch * args.batch, args.batch)]
    bar = tqdm(total=total, initial=state["step"], desc="train", dynamic_ncols=True)
    head.train()
    running = []
    while state["step"] < total:
        step = state["step"]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, args.lr)
        tokens, states, probs, mask = make_batch(examples, features, order[step], to_draft, draft_size)
        loss, agree, counted = ttt_loss(head, tokens, states, probs, mask, args.steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        running.append(float(loss))
        state["step"] += 1
        bar.update(1)
        bar.set_postfix(loss=f"{sum(running[-20:]) / len(running[-20:]):.3f}",
                        agree0=f"{agree[0] / max(1.0, counted[0]):.2f}")
        if state["step"] % 10 == 0:
            state["curve"]["step"].append(state["step"])
            state["curve"]["loss"].append(sum(running[-10:]) / len(running[-10:]))
        if state["step"] % args.eval_every == 0 or state["step"] == total:
            val = agreement(head, examples, features, val_idx, to_draft, draft_size, args.steps, args.batch)
            state["curve"]["val_step"].append(state["step"])
            state["curve"]["val_agree"].append(val)
            bar.write(f"batch {state['step']}: held-out agreement per unrolled step "
                      + " ".join(f"{v:.3f}" for v in val))
        if state["step"] % args.save_every == 0 or state["step"] == total:
            own = {n: t for n, t in head.state_dict().items() if n != "embed_tokens.weight"}   # the target's
            torch.save({"head": own, "opt": opt.state_dict(), "state": state}, ckpt)
    bar.close()
    return state["curve"]


def plot_curve(curve, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(curve["step"], curve["loss"])
    a.set_xlabel("batch")
    a.set_ylabel("training-time-test loss")
    a.set_title("loss")
    for j in range(len(curve["val_agree"][0]) if curve["val_agree"] else 0):
        b.plot(curve["val_step"], [v[j] for v in curve["val_agree"]], marker="o", label=f"draft {j + 1}")
    b.set_xlabel("batch")
    b.set_ylabel("agreement with the target's argmax")
    b.set_title("held-out agreement per unrolled step")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def engine_acceptance(pair: Path, head_dir: Path, tok, k: int, max_tokens: int) -> dict:
    """Greedy acceptance through the engine at fixed k, B = 1, on the held-out QUESTIONS."""
    from exspec import EngineConfig, LLMEngine, SamplingParams
    engine = LLMEngine(EngineConfig(target_model=str(pair / "target"), draft_model=str(head_dir),
                                    proposer="eagle3", method="exspec", num_speculative_tokens=k,
                                    adaptive_k=False, max_batch_size=1, torch_threads=1))
    prompts = [tok(chat_prompt(tok, q), add_special_tokens=False)["input_ids"] for _, q in QUESTIONS]
    engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    s = engine.stats()
    steps = s["steps"] - s.get("plain_steps", 0)
    return {"k": k, "questions": len(prompts), "draft_tokens": s["draft_tokens"],
            "accepted_tokens": s["accepted_tokens"],
            "acceptance": s["accepted_tokens"] / max(1, s["draft_tokens"]),
            "mean_accepted_length": 1 + s["accepted_tokens"] / max(1, steps)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HEAD_DIR)
    ap.add_argument("--work", type=Path, default=PAIR_DIR.parent / "smollm2-eagle3-work")
    ap.add_argument("--pair", type=Path, default=PAIR_DIR)
    ap.add_argument("--data", type=Path, default=DATA_DIR, help="questions and answers (committed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--questions", type=int, default=3200, help="questions (data seed 0)")
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3, help="training-time-test unrolled steps")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--init", type=Path, help="continue training this head (e.g. the committed one, "
                    "--out's default) instead of starting from the target's lm_head")
    ap.add_argument("--questions-too", action="store_true",
                    help="train on the question's positions as well as the answer's (the held-out "
                    "agreement and the draft vocabulary stay the answers')")
    ap.add_argument("--tiny", action="store_true", help="a smoke run of a few minutes")
    ap.add_argument("--data-only", action="store_true", help="make the data and stop")
    args = ap.parse_args(argv)
    if args.tiny:
        args.questions, args.answer_tokens, args.epochs, args.draft_vocab = 48, 32, 1, 2048
        args.eval_every = args.save_every = 4
        if args.data == DATA_DIR:   # a smoke run's answers are not the committed data
            args.data = args.work / "data"
            seed_questions(DATA_DIR, args.data, CHUNK)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.pair / "target")
    tok.padding_side = "left"
    target = AutoModelForCausalLM.from_pretrained(args.pair / "target", dtype=torch.float32).eval()
    target.requires_grad_(False)
    args.work.mkdir(parents=True, exist_ok=True)
    args.data.mkdir(parents=True, exist_ok=True)
    times = {}
    examples, data_times = load_or_make_data(target, tok, args.pair, args.data, args.questions,
                                             args.answer_tokens, args.threads)
    times.update(data_times)
    if args.data_only:
        return
    learn_from(examples, args.questions_too)
    random.Random(0).shuffle(examples)
    n_val = max(2, len(examples) // 20)
    val_idx, train_idx = list(range(n_val)), list(range(n_val, len(examples)))
    layers = target.config.num_hidden_layers
    layer_ids = (2, layers // 2, layers - 3)
    fpath = args.work / (f"features-q{args.questions}-a{args.answer_tokens}-{'-'.join(map(str, layer_ids))}"
                         f"{'-qa' if args.questions_too else ''}.pt")
    t0 = time.monotonic()
    if not fpath.exists():
        torch.save(make_features(target, examples, layer_ids), fpath)
        times["features"] = time.monotonic() - t0
    features, top = torch.load(fpath)
    for e, (top_i, top_v) in zip(examples, top):
        e["top_i"], e["top_v"] = top_i, top_v
    vocab = draft_vocab([examples[i] for i in train_idx], args.draft_vocab)
    to_draft = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    to_draft[torch.tensor(vocab)] = torch.arange(len(vocab))
    head = new_head(target, layer_ids, vocab) if args.init is None else continued_head(args.init, target, vocab)
    # a continuation's checkpoint names the head it started from: a second --init in the same
    # work folder continues the new head instead of finding the first run's schedule finished
    init = (f"-init{hashlib.sha256((args.init / 'model.safetensors').read_bytes()).hexdigest()[:8]}"
            if args.init else "")
    ckpt = args.work / (f"ckpt-v{args.draft_vocab}-s{args.steps}-e{args.epochs}-b{args.batch}"
                        f"-lr{args.lr}-seed{args.seed}-q{args.questions}"
                        f"{'-qa' if args.questions_too else ''}{init}.pt")
    t0 = time.monotonic()
    curve = train(head, examples, features, train_idx, val_idx, to_draft, args, ckpt)
    times["train"] = time.monotonic() - t0
    head.eval()
    save_head(head, args.out)
    plot_curve(curve, args.out / "curve.png")
    acceptance = engine_acceptance(args.pair, args.out, tok, 4, 32 if args.tiny else 96)
    metrics = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                     if k not in ("out", "work", "pair", "data")},
        "layer_ids": list(layer_ids), "examples": len(examples), "val_examples": n_val,
        "answer_tokens": sum(len(answer_picks(examples[i])) for i in train_idx),
        "trained_positions": sum(len(examples[i]["top_i"]) for i in train_idx),
        "vocab_coverage_held_out": coverage([examples[i] for i in val_idx], vocab),
        # what another --draft-vocab would cover (its lm_head costs 2 x hidden bytes per id)
        "vocab_coverage_held_out_by_size": {
            size: coverage([examples[i] for i in val_idx], draft_vocab([examples[i] for i in train_idx], size))
            for size in (2048, 4096, 8192, 16384, 32768)},
        "held_out_agreement_per_step": curve["val_agree"][-1] if curve["val_agree"] else None,
        "engine_acceptance": acceptance, "curve": curve,
        "head_params": sum(p.numel() for n, p in head.named_parameters() if n != "embed_tokens.weight"),
        "weights_bytes": (args.out / "model.safetensors").stat().st_size,
        "machine": machine_info(), **{f"time_{k}_s": round(v, 1) for k, v in times.items()},
    }
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(json.dumps({k: metrics[k] for k in ("vocab_coverage_held_out_by_size", "held_out_agreement_per_step",
                                              "engine_acceptance", "weights_bytes")}, indent=1))


if __name__ == "__main__":
    main()
