#!/usr/bin/env python
"""Train exspec's built-in demo model pair: a small code-completion target and a much cheaper
draft distilled from it, both Llama-architecture, on the Python standard library's own source.

Everything comes from the running interpreter (no network): the .py files under
``sysconfig.get_paths()["stdlib"]``. Output (default ``model_repository/exspec/1/demo/``):

    tokenizer/        byte-level BPE (PreTrainedTokenizerFast), EOS = BOS = PAD = <|endoftext|>
    target/           LlamaForCausalLM, float16 safetensors, config dtype float32 (+ tokenizer)
    draft/            LlamaForCausalLM sharing the vocabulary (+ tokenizer)
    prompts.jsonl     held-out prompts in SpecBench's format
    model_card.md     corpus, settings, seed, timings, losses, cost ratio, acceptance
    metrics.json      the same numbers, machine-readable

Steps: tokenizer -> target (next-token LM) -> draft distilled from the target (forward KL to the
target's logits plus cross-entropy on its argmax, on corpus windows and on the target's own
greedy continuations of function/class beginnings) -> measurements on held-out prompts.

    python scripts/train_demo_pair.py                    # full run, about 25 min on 1 thread
    python scripts/train_demo_pair.py --tiny --out /tmp/demo   # end-to-end smoke, < 1 min
    python scripts/train_demo_pair.py --measure-only     # re-measure cost ratio + acceptance
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import random
import re
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

EOS = "<|endoftext|>"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "model_repository" / "exspec" / "1" / "demo"

# Top-level stdlib folders left out of the corpus: generated codec tables and doc dumps
# (not code anyone completes), test suites (huge, repetitive), third-party site-packages.
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
                 "encodings", "pydoc_data", "lib2to3", "ensurepip", "config-3"}
HOLDOUT_MOD = 10  # a file is held out when sha1(relative path) % HOLDOUT_MOD == 0


@dataclasses.dataclass
class Settings:
    vocab_size: int = 4096
    max_file_bytes: int = 400_000
    seq_len: int = 256
    batch_size: int = 16
    # target
    t_layers: int = 8
    t_hidden: int = 256
    t_inter: int = 704
    t_heads: int = 4
    t_steps: int = 300
    t_lr: float = 2e-3
    # draft
    d_layers: int = 1
    d_hidden: int = 128
    d_inter: int = 512
    d_heads: int = 2
    d_steps: int = 280   # the committed pair used 320 (30.5 min on a loaded 2-core box); 280 keeps a default run under 30 min
    d_lr: float = 3e-3
    gen_prompts: int = 640      # training prompts the target continues greedily for distillation
    gen_batch: int = 32
    gen_new_tokens: int = 64
    # evaluation
    n_prompts: int = 40
    eval_new_tokens: int = 64
    k: int = 5
    val_windows: int = 32
    cost_reps: int = 100
    max_files: int = 0          # 0 = all files passing the rules
    max_position_embeddings: int = 2048


TINY = dict(vocab_size=512, max_file_bytes=60_000, seq_len=64, batch_size=8, t_layers=2, t_hidden=64,
            t_inter=128, t_heads=2, t_steps=8, d_layers=1, d_hidden=32, d_inter=64, d_heads=1,
            d_steps=8, gen_prompts=8, gen_batch=8, gen_new_tokens=16, n_prompts=6,
            eval_new_tokens=16, val_windows=4, cost_reps=5, max_files=24,
            max_position_embeddings=256)


# ----------------------------------------------------------------------------------- corpus
def list_corpus(settings: Settings):
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("config-"))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            rel = (rel_dir / fn).as_posix()
            if fn.startswith("test_"):
                continue
            p = root / rel
            size = p.stat().st_size
            if size == 0 or size > settings.max_file_bytes:
                continue
            files.append(rel)
    files.sort()
    if settings.max_files:
        # a deterministic spread over the sorted list, not just the first folder
        step = max(1, len(files) // settings.max_files)
        files = files[::step][: settings.max_files]
    train, held = [], []
    for rel in files:
        h = int(hashlib.sha1(rel.encode()).hexdigest(), 16)
        (held if h % HOLDOUT_MOD == 0 else train).append(rel)
    if not held:  # tiny subsets: make sure something is held out
        held, train = train[-2:], train[:-2]
    texts = {}
    for rel in files:
        texts[rel] = (root / rel).read_text(encoding="utf-8", errors="replace")
    return root, train, held, texts


PROMPT_START = re.compile(r"^(\s*)(def |class |async def )\w")


def extract_prompts(text: str, max_lines: int = 6, max_chars: int = 320):
    """Beginnings of functions/classes: the def/class line and the next few lines."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if not PROMPT_START.match(line):
            continue
        indent = len(line) - len(line.lstrip())
        chunk = [line.rstrip()]
        for ln in lines[i + 1: i + max_lines]:
            # stay inside the block: stop at a blank line or a dedent to the def's level
            if not ln.strip() or len(ln) - len(ln.lstrip()) <= indent:
                break
            if sum(len(c) + 1 for c in chunk) + len(ln) + 1 > max_chars:
                break
            chunk.append(ln.rstrip())
        # need a body line to follow (so the model is completing inside the block)
        if len(chunk) < 2 or not chunk[0].rstrip().endswith(":") and len(chunk) < 3:
            continue
        prompt = "\n".join(chunk) + "\n"
        if len(prompt) < 40:
            continue
        out.append(prompt)
    return out


# -------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from exspec.demo.tiny import CHAT_TEMPLATE

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS,
                                   pad_token=EOS, unk_token=None, padding_side="left",
                                   model_max_length=2048, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE   # saved as chat_template.jinja
    return fast


def encode_stream(tokenizer, texts):
    eos = tokenizer.eos_token_id
    ids = []
    for e in tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False):
        ids.extend(e.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def sample_windows(stream: torch.Tensor, n: int, seq_len: int, gen: torch.Generator):
    hi = stream.numel() - seq_len - 1
    starts = torch.randint(0, hi, (n,), generator=gen)
    return torch.stack([stream[s: s + seq_len + 1] for s in starts.tolist()])


# ----------------------------------------------------------------------------------- models
def make_llama(vocab, layers, hidden, inter, heads, tokenizer, max_pos):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads, max_position_embeddings=max_pos,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, initializer_range=0.02)
    return LlamaForCausalLM(cfg)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def lr_at(step, total, peak):
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    prog = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))


def make_opt(model, lr):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


@torch.no_grad()
def eval_loss(model, windows):
    model.eval()
    losses = []
    for i in range(0, windows.shape[0], 8):
        w = windows[i: i + 8]
        logits = model(w[:, :-1]).logits
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1)).item())
    model.train()
    return float(statistics.mean(losses))


def train_target(model, stream, s: Settings, gen, val):
    opt = make_opt(model, s.t_lr)
    model.train()
    ema = None
    bar = tqdm(range(s.t_steps), desc="target", dynamic_ncols=True)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, s.t_steps, s.t_lr)
        w = sample_windows(stream, s.batch_size, s.seq_len, gen)
        logits = model(w[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
    return ema, eval_loss(model, val)


@torch.no_grad()
def greedy_continuations(target, tokenizer, prompts, new_tokens, batch, desc):
    """Target greedy continuations (HF generate), left-padded batches. Returns id lists
    (prompt ids + continuation ids, continuation stops after EOS)."""
    target.eval()
    eos = tokenizer.eos_token_id
    seqs = []
    for i in tqdm(range(0, len(prompts), batch), desc=desc, dynamic_ncols=True):
        enc = tokenizer(prompts[i: i + batch], return_tensors="pt", padding=True,
                        add_special_tokens=False)
        out = target.generate(**enc, max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=eos, eos_token_id=eos)
        plen = enc["input_ids"].shape[1]
        for r in range(out.shape[0]):
            p = enc["input_ids"][r][enc["attention_mask"][r].bool()].tolist()
            c = out[r, plen:].tolist()
            if eos in c:
                c = c[: c.index(eos) + 1]
            seqs.append(p + c)
    return seqs


def train_draft(draft, target, corpus_stream, gen_stream, s: Settings, gen, val):
    opt = make_opt(draft, s.d_lr)
    draft.train()
    target.eval()
    ema = None
    n_gen = (3 * s.batch_size) // 4   # most of each batch: the target's own greedy text
    bar = tqdm(range(s.d_steps), desc="draft (distil)", dynamic_ncols=True)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, s.d_steps, s.d_lr)
        w = torch.cat([sample_windows(corpus_stream, s.batch_size - n_gen, s.seq_len, gen),
                       sample_windows(gen_stream, n_gen, s.seq_len, gen)])
        x = w[:, :-1]
        with torch.no_grad():
            t_logits = target(x).logits
            t_logp = F.log_softmax(t_logits.float(), dim=-1)
            t_arg = t_logits.argmax(-1)
        d_logits = draft(x).logits
        d_logp = F.log_softmax(d_logits, dim=-1)
        V = d_logits.shape[-1]
        kl = F.kl_div(d_logp.reshape(-1, V), t_logp.reshape(-1, V), log_target=True,
                      reduction="batchmean")
        ce = F.nll_loss(d_logp.reshape(-1, V), t_arg.reshape(-1))
        loss = kl + ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            agree = (d_logits.argmax(-1) == t_arg).float().mean().item()
        ema = (loss.item(), kl.item(), agree) if ema is None else tuple(
            0.95 * a + 0.05 * b for a, b in zip(ema, (loss.item(), kl.item(), agree)))
        bar.set_postfix(loss=f"{ema[0]:.3f}", kl=f"{ema[1]:.3f}", agree=f"{ema[2]:.3f}")
    return ema, eval_loss(draft, val)


# ------------------------------------------------------------------------------ measurement
@torch.no_grad()
def simulate_acceptance(target, draft, tokenizer, prompts, new_tokens, k):
    """Greedy speculative decoding, simulated exactly: target-only greedy continuation (HF
    generate, batch 1), then the draft's teacher-forced argmax along it. A draft proposal d_j is
    only looked at when d_1..d_{j-1} matched, i.e. when its prefix is the true prefix, so the
    teacher-forced argmax *is* what the draft would propose. Each step commits the longest
    matching prefix (<= k) plus the target's bonus token."""
    target.eval()
    draft.eval()
    eos = tokenizer.eos_token_id
    steps = committed = proposed = accepted = 0
    per_prompt = []
    for p in tqdm(prompts, desc="acceptance (k=%d)" % k, dynamic_ncols=True):
        ids = tokenizer(p, return_tensors="pt", add_special_tokens=False)["input_ids"]
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=eos, eos_token_id=eos)
        plen = ids.shape[1]
        cont = out[0, plen:]
        n = cont.numel()
        if n == 0:
            continue
        d_pred = draft(out).logits[0].argmax(-1)         # prediction for position i+1
        match = (d_pred[plen - 1: plen - 1 + n] == cont).tolist()
        pos = ps = 0
        while pos < n:
            a = 0
            while a < k and pos + a < n and match[pos + a]:
                a += 1
            c = min(a + 1, n - pos)
            proposed += k
            accepted += min(a, c)
            committed += c
            steps += 1
            ps += 1
            pos += c
        per_prompt.append(n / ps)
    return {"mean_accepted_length": committed / max(1, steps),
            "acceptance_rate": accepted / max(1, proposed),
            "steps": steps, "tokens": committed, "prompts": len(per_prompt),
            "per_prompt_min": min(per_prompt) if per_prompt else None,
            "per_prompt_max": max(per_prompt) if per_prompt else None}


@torch.no_grad()
def measure_costs(target, draft, vocab, reps, context=64, prefill=32, seed=0):
    """Median wall time of (a) one single-token decode forward with a KV cache holding
    `context` tokens and (b) a `prefill`-token prefill, at batch 1, float32. The models alternate
    in blocks of 10 back-to-back forwards (so slow drifts in machine load hit both alike) and each
    block starts with one untimed warm-up forward: alternating every single forward would time
    the draft with its weights just evicted from the CPU caches by the target's, which is not how
    a speculative step runs it (k draft forwards in a row)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, context + 1), generator=g)
    res = {}
    for m in (target, draft):
        m.eval()
    caches = {}
    for name, m in (("target", target), ("draft", draft)):
        o = m(ids[:, :context], use_cache=True)
        caches[name] = getattr(o, "cache", None) or o.past_key_values
        for _ in range(3):  # warm-up
            m(ids[:, context:], cache=caches[name], use_cache=True)
            caches[name].crop(-1)
            m(ids[:, :prefill])
    times = {f"{n}_{w}": [] for n in ("target", "draft") for w in ("decode", "prefill")}
    block = 10  # a model runs `block` forwards back to back (as the draft does k in a row), then the other
    for _ in range(max(1, reps // block)):
        for name, m in (("target", target), ("draft", draft)):
            m(ids[:, context:], cache=caches[name], use_cache=True)  # re-warm after the other model
            caches[name].crop(-1)
            for _ in range(block):
                t0 = time.perf_counter()
                m(ids[:, context:], cache=caches[name], use_cache=True)
                times[f"{name}_decode"].append(time.perf_counter() - t0)
                caches[name].crop(-1)
            m(ids[:, :prefill])
            for _ in range(block):
                t0 = time.perf_counter()
                m(ids[:, :prefill])
                times[f"{name}_prefill"].append(time.perf_counter() - t0)
    for key, v in times.items():
        res[key + "_ms"] = statistics.median(v) * 1e3
    res["ratio_decode"] = res["draft_decode_ms"] / res["target_decode_ms"]
    res["ratio_prefill"] = res["draft_prefill_ms"] / res["target_prefill_ms"]
    res.update(context=context, prefill=prefill, reps=reps, threads=torch.get_num_threads())
    return res


# ------------------------------------------------------------------------------------ output
def save_model(model, path: Path, tokenizer):
    from transformers import GenerationConfig
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False)
    half = model.to(torch.float16)
    half.save_pretrained(path, safe_serialization=True)
    model.to(torch.float32)
    # weights are float16 on disk; by default load (and run) in float32 on CPU
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(path)


def dir_size(path: Path):
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def load_pair(out: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(out / "draft", dtype=torch.float32)
    return tok, target, draft


def fmt_ms(x):
    return f"{x:.3f} ms"


def write_card(out: Path, m: dict):
    s = m["settings"]
    c = m["corpus"]
    cost = m["cost"]
    acc = m["acceptance"]
    lines = [
        "# exspec demo pair: stdlib code-completion target + distilled draft",
        "",
        "A small **target** (LlamaForCausalLM) and a much cheaper **draft** (LlamaForCausalLM,",
        "same tokenizer and vocabulary) trained from scratch on the Python standard library's",
        "source, so that exspec runs out of the box on a machine without network access. It is a",
        "toy: it completes Python-looking code, it is not a useful assistant.",
        "",
        "| | target | draft |",
        "|---|---|---|",
        f"| layers / hidden / MLP / heads | {s['t_layers']} / {s['t_hidden']} / {s['t_inter']} / {s['t_heads']}"
        f" | {s['d_layers']} / {s['d_hidden']} / {s['d_inter']} / {s['d_heads']} |",
        f"| parameters (tied embeddings) | {m['target_params']:,} | {m['draft_params']:,} |",
        f"| training steps (batch {s['batch_size']} x {s['seq_len']} tokens) | {s['t_steps']} | {s['d_steps']} |",
        f"| final train loss (EMA) | {m['target_train_loss']:.3f} | {m['draft_train_loss']:.3f} (KL+CE to target) |",
        f"| held-out LM loss (nats/token) | {m['target_val_loss']:.3f} | {m['draft_val_loss']:.3f} |",
        f"| training wall time | {m['time_target_s'] / 60:.1f} min | {m['time_draft_s'] / 60:.1f} min (incl. {m['time_gen_s'] / 60:.1f} min generating) |",
        "",
        "Layout: `tokenizer/`, `target/`, `draft/` (each model folder also carries the tokenizer, so",
        "either loads like a hub model), `prompts.jsonl`, `metrics.json`. Weights are stored as",
        "float16 safetensors; `config.json` says `dtype: float32`, so `from_pretrained` loads and",
        "runs them in float32 unless asked otherwise (`dtype=torch.bfloat16` etc.).",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "tok = AutoTokenizer.from_pretrained(\"model_repository/exspec/1/demo/tokenizer\")",
        "target = AutoModelForCausalLM.from_pretrained(\"model_repository/exspec/1/demo/target\")",
        "draft = AutoModelForCausalLM.from_pretrained(\"model_repository/exspec/1/demo/draft\")",
        "```",
        "",
        "## Measured",
        "",
        f"- **Draft/target cost ratio** at batch 1, float32, `torch.set_num_threads({cost['threads']})`,"
        f" median of {cost['reps']} repetitions (blocks of 10 back-to-back forwards per model,"
        " alternating models, one untimed warm-up per block):",
        f"  - single-token decode forward with a KV cache of {cost['context']} tokens: draft "
        f"{fmt_ms(cost['draft_decode_ms'])}, target {fmt_ms(cost['target_decode_ms'])}, "
        f"**ratio {cost['ratio_decode']:.3f}** (1/{1 / cost['ratio_decode']:.1f});",
        f"  - {cost['prefill']}-token prefill: draft {fmt_ms(cost['draft_prefill_ms'])}, target "
        f"{fmt_ms(cost['target_prefill_ms'])}, **ratio {cost['ratio_prefill']:.3f}** (1/{1 / cost['ratio_prefill']:.1f}).",
        f"  - CPU: {m['machine']['cpu']}; torch {m['machine']['torch']}, transformers {m['machine']['transformers']}.",
        f"  - Re-measure: `python scripts/train_demo_pair.py --measure-only --threads {cost['threads']}`.",
        f"- **Simulated greedy speculative decoding, k = {s['k']}**, on the {acc['prompts']} held-out prompts of",
        f"  `prompts.jsonl`: target-only greedy continuation of {s['eval_new_tokens']} tokens (HF `generate`,",
        "  batch 1, float32), then each step commits the longest prefix of the draft's greedy",
        "  proposals that matches it, plus the target's bonus token.",
        f"  **mean_accepted_length = {acc['mean_accepted_length']:.2f}** committed tokens per step"
        f" (bonus included; per prompt {acc['per_prompt_min']:.2f} to {acc['per_prompt_max']:.2f}),"
        f" acceptance_rate = {acc['acceptance_rate']:.3f} (accepted / proposed drafts),"
        f" {acc['steps']} steps for {acc['tokens']} tokens. The last step of a continuation is cut",
        "  at its end, which slightly lowers the mean.",
        f"- Size of all files in this folder: {m['total_bytes'] / 1e6:.2f} MB.",
        "",
        "## Corpus",
        "",
        f"- Python {m['machine']['python']} standard library at `{c['stdlib']}` (the `.py` files of",
        "  the interpreter that ran the script; no network).",
        f"- Left out: top-level/sub folders {', '.join(sorted(EXCLUDED_DIRS))}; files named `test_*.py`;",
        f"  files over {s['max_file_bytes']:,} bytes{'; subset of ' + str(s['max_files']) + ' files' if s['max_files'] else ''}.",
        f"- Held out: files with sha1(relative path) % {HOLDOUT_MOD} == 0, used only for the prompts",
        "  and the held-out loss.",
        f"- Training: {c['train_files']} files, {c['train_bytes']:,} bytes, {c['train_tokens']:,} tokens;"
        f" held out: {c['heldout_files']} files, {c['heldout_bytes']:,} bytes, {c['heldout_tokens']:,} tokens.",
        f"- Tokens seen in training: target {s['t_steps'] * s['batch_size'] * s['seq_len']:,},"
        f" draft {s['d_steps'] * s['batch_size'] * s['seq_len']:,} (a quarter corpus windows, three quarters the"
        f" target's greedy continuations of {c['gen_sequences']} function/class beginnings from training files).",
        "",
        "## Training",
        "",
        f"- Seed {m['seed']} (Python `random`, `torch.manual_seed`, a seeded `torch.Generator` for"
        " batches). Threads: " + str(m["threads"]) + ".",
        f"- Tokenizer: byte-level BPE (`tokenizers`), vocabulary {m['vocab_size']} (asked {s['vocab_size']}),"
        f" min frequency 2, one special token `{EOS}` = EOS = BOS = PAD; files are joined with it.",
        "  Saved as `PreTrainedTokenizerFast`; no token is added automatically when encoding.",
        f"- Target: next-token cross-entropy, AdamW (betas 0.9/0.95, weight decay 0.1 on matrices),"
        f" peak lr {s['t_lr']}, 5% linear warm-up, cosine to 10%, grad-clip 1.0, float32.",
        f"- Draft: distilled from the finished target. Loss = KL(target || draft) over the full"
        f" vocabulary + cross-entropy on the target's argmax, at every position of batches that are"
        f" a quarter random corpus windows and three quarters the target's greedy continuations"
        f" ({s['gen_new_tokens']} new tokens) of {s['gen_prompts']} prompts taken from training files."
        f" Peak lr {s['d_lr']}, same schedule and optimizer.",
        f"- Total wall time {m['time_total_s'] / 60:.1f} min on {m['machine']['cpu']}.",
        "- All settings: `metrics.json` → `settings`.",
        "",
        "Command: `" + m["command"] + "`" + (
            "" if not m.get("reused_target") else
            f" (draft only; tokenizer and target from `{m['reused_target']['target_from_command']}`,"
            f" whose draft had {m['reused_target']['previous_draft_steps']} steps and mean_accepted_length"
            f" {m['reused_target']['previous_mean_accepted_length']:.2f}; the target's training time above is"
            " that run's; batch sampling then differs from a single full run)"),
        "",
        "## Licence",
        "",
        "The training corpus is the CPython standard library, © Python Software Foundation, under",
        "the PSF License Agreement (https://docs.python.org/3/license.html). These weights, the",
        "tokenizer and `prompts.jsonl` (verbatim excerpts of held-out stdlib files) are derived",
        "from it; keep the PSF notice when redistributing them. The training script is part of",
        "exspec and under the project's licence.",
        "",
    ]
    (out / "model_card.md").write_text("\n".join(lines))


def cpu_name():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cores visible)"
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_info():
    import transformers
    return {"cpu": cpu_name(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__}


def read_prompts(out: Path):
    return [json.loads(l)["turns"][0] for l in (out / "prompts.jsonl").read_text().splitlines() if l.strip()]


def measure_only(out: Path, s: Settings):
    tok, target, draft = load_pair(out)
    cost = measure_costs(target, draft, len(tok), s.cost_reps)
    acc = simulate_acceptance(target, draft, tok, read_prompts(out), s.eval_new_tokens, s.k)
    print(json.dumps({"cost": cost, "acceptance": acc}, indent=2))
    mpath = out / "metrics.json"
    if mpath.exists():  # refresh the record of this pair
        metrics = json.loads(mpath.read_text())
        metrics.update(cost=cost, acceptance=acc, machine=machine_info())
        metrics["total_bytes"] = dir_size(out)
        write_card(out, metrics)
        mpath.write_text(json.dumps(metrics, indent=2) + "\n")


# -------------------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps-target", type=int, default=None)
    ap.add_argument("--steps-draft", type=int, default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny configuration for tests (< 1 min)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--reuse-target", action="store_true",
                    help="keep tokenizer and target already in --out (from a full run) and "
                         "retrain only the draft")
    ap.add_argument("--measure-only", action="store_true",
                    help="load the pair in --out and re-measure cost ratio and acceptance")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    s = Settings(**TINY) if args.tiny else Settings()
    if args.steps_target is not None:
        s.t_steps = args.steps_target
    if args.steps_draft is not None:
        s.d_steps = args.steps_draft
    out: Path = args.out
    if args.measure_only:
        measure_only(out, s)
        return 0

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    rng = random.Random(args.seed)
    t_start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)

    # corpus + prompts
    root, train_files, held_files, texts = list_corpus(s)
    print(f"corpus: {len(train_files)} training files, {len(held_files)} held out, under {root}", flush=True)
    held_prompts = []
    for rel in held_files:
        cands = extract_prompts(texts[rel])
        rng.shuffle(cands)
        held_prompts.append([(rel, c) for c in cands])
    prompts = []
    # round-robin over held-out files so the prompts spread over many files
    while len(prompts) < s.n_prompts and any(held_prompts):
        for lst in held_prompts:
            if lst and len(prompts) < s.n_prompts:
                prompts.append(lst.pop())
    with open(out / "prompts.jsonl", "w") as f:
        for i, (rel, p) in enumerate(prompts):
            f.write(json.dumps({"question_id": i, "category": "code", "turns": [p]}) + "\n")
    train_prompts = [p for rel in train_files for p in extract_prompts(texts[rel])]
    rng.shuffle(train_prompts)
    train_prompts = train_prompts[: s.gen_prompts]

    # tokenizer
    t0 = time.perf_counter()
    if args.reuse_target:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
    else:
        tokenizer = train_tokenizer([texts[r] for r in train_files], s.vocab_size)
        tokenizer.save_pretrained(out / "tokenizer")
    vocab = len(tokenizer)
    stream = encode_stream(tokenizer, [texts[r] for r in train_files])
    held_stream = encode_stream(tokenizer, [texts[r] for r in held_files])
    print(f"tokenizer: vocab {vocab}, {stream.numel():,} training tokens, "
          f"{held_stream.numel():,} held-out tokens ({time.perf_counter() - t0:.1f}s)", flush=True)
    vgen = torch.Generator().manual_seed(args.seed + 1)
    val = sample_windows(held_stream, s.val_windows, min(s.seq_len, held_stream.numel() // 2 - 2), vgen)

    # target
    t0 = time.perf_counter()
    if args.reuse_target:
        # keep the target (and its record) from an earlier run; retrain only the draft
        from transformers import AutoModelForCausalLM
        prev = json.loads((out / "metrics.json").read_text())
        target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32)
        s.t_steps = prev["settings"]["t_steps"]
        t_train, time_target = prev["target_train_loss"], prev["time_target_s"]
        t_val = eval_loss(target, val)
        reused = {"target_from_command": prev["command"], "previous_draft_steps": prev["settings"]["d_steps"],
                  "previous_mean_accepted_length": prev["acceptance"]["mean_accepted_length"]}
    else:
        target = make_llama(vocab, s.t_layers, s.t_hidden, s.t_inter, s.t_heads, tokenizer,
                            s.max_position_embeddings)
        t_train, t_val = train_target(target, stream, s, gen, val)
        time_target = time.perf_counter() - t0
        reused = None
    print(f"target: train loss {t_train:.3f}, held-out {t_val:.3f}, {time_target / 60:.1f} min", flush=True)

    # draft: target continuations, then distillation
    t0 = time.perf_counter()
    target.eval()
    gen_seqs = greedy_continuations(target, tokenizer, train_prompts, s.gen_new_tokens, s.gen_batch,
                                    "target continuations")
    time_gen = time.perf_counter() - t0
    gen_stream = torch.tensor([t for sq in gen_seqs for t in sq + [tokenizer.eos_token_id]], dtype=torch.long)
    while gen_stream.numel() < s.seq_len + 2:
        gen_stream = torch.cat([gen_stream, gen_stream])
    draft = make_llama(vocab, s.d_layers, s.d_hidden, s.d_inter, s.d_heads, tokenizer, s.max_position_embeddings)
    (d_train, d_kl, d_agree), d_val = train_draft(draft, target, stream, gen_stream, s, gen, val)
    time_draft = time.perf_counter() - t0
    print(f"draft: train loss {d_train:.3f} (KL {d_kl:.3f}, argmax agreement {d_agree:.3f}), "
          f"held-out LM loss {d_val:.3f}, {time_draft / 60:.1f} min", flush=True)
    time_train = time.perf_counter() - t_start

    # save, reload from disk exactly as users will, and measure
    for name, model in (("target", target), ("draft", draft)):
        if name == "target" and args.reuse_target:
            continue
        save_model(model, out / name, tokenizer)
    del target, draft
    tok2, target, draft = load_pair(out)
    assert target.config.vocab_size == draft.config.vocab_size == len(tok2)
    cost = measure_costs(target, draft, len(tok2), s.cost_reps)
    print("cost: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in cost.items()}), flush=True)
    acc = simulate_acceptance(target, draft, tok2, [p for _, p in prompts], s.eval_new_tokens, s.k)
    print(f"simulated k={s.k}: mean_accepted_length {acc['mean_accepted_length']:.3f}, "
          f"acceptance_rate {acc['acceptance_rate']:.3f}", flush=True)

    # the command that reproduces this run, with every setting that has a flag spelled out
    cmd = (f"python scripts/train_demo_pair.py --seed {args.seed} --threads {args.threads}"
           f" --steps-target {s.t_steps} --steps-draft {s.d_steps}"
           + (" --tiny" if args.tiny else "") + (" --reuse-target" if args.reuse_target else "")
           + ("" if out.resolve() == DEFAULT_OUT.resolve() else f" --out {out}"))
    metrics = {
        "seed": args.seed, "threads": args.threads, "tiny": args.tiny, "command": cmd.strip(),
        "reused_target": reused,
        "settings": dataclasses.asdict(s), "vocab_size": vocab,
        "corpus": {"stdlib": str(root), "train_files": len(train_files), "heldout_files": len(held_files),
                   "train_bytes": sum(len(texts[r].encode()) for r in train_files),
                   "heldout_bytes": sum(len(texts[r].encode()) for r in held_files),
                   "train_tokens": int(stream.numel()), "heldout_tokens": int(held_stream.numel()),
                   "gen_sequences": len(gen_seqs), "gen_tokens": int(gen_stream.numel()),
                   "prompt_files": sorted({rel for rel, _ in prompts})},
        "target_params": n_params(target), "draft_params": n_params(draft),
        "target_train_loss": t_train, "target_val_loss": t_val,
        "draft_train_loss": d_train, "draft_train_kl": d_kl, "draft_train_agreement": d_agree,
        "draft_val_loss": d_val,
        "time_target_s": time_target, "time_gen_s": time_gen, "time_draft_s": time_draft,
        "time_total_s": time_train, "cost": cost, "acceptance": acc, "machine": machine_info(),
    }
    metrics["total_bytes"] = 0
    write_card(out, metrics)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    # the size line in the card includes the card and metrics themselves: settle it in two passes
    for _ in range(2):
        metrics["total_bytes"] = dir_size(out)
        write_card(out, metrics)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(f"saved to {out} ({metrics['total_bytes'] / 1e6:.2f} MB) in {(time.perf_counter() - t_start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
