"""`exspec-bench --tokens-per-step`: tokens per target step per prompt category, every
speculative method side by side, without timing. Tokens per step does not depend on the host's
speed, so a user can choose a method on a CPU for a deployment elsewhere: it is the speed-up's
ceiling where a verification costs what a plain step costs (a GPU at small batch comes near it).

Rows: the prompt categories, by default the shipped sets (each rendered as `--prompt-set` renders
it: the chat template, multiturn's earlier turns answered by the target, greedy), `--prompt-set`
one of them, `--prompts` the file's own "category" fields; the first `--num-prompts` of each,
served one after another (suffix decoding learns from the category's earlier answers and
forgets between categories; `--warm-prompts N`: each category's first N are served, not
counted); then "all", every category's tokens over every category's steps. Columns: the
proposers of the chosen methods (eqspec_X and exspec_X are one column: at batch 1 the layout
proposes the same), fixed k = -k, greedy; at batch 1 (the default; `--batch-sizes 1,8` gives a
table per batch size, and above 1 every column is the engine's, tokens over row-steps) each
measured where it is cheaper:

- a proposer with a model (the draft model, an EAGLE-3 head, the hybrids): the engine, its own
  stats over the category (committed tokens / steps);
- a lookup proposer (n-gram, suffix decoding): the offline replay (replay.py, replay_steps.py)
  of the target's greedy answers (Hugging Face generate) through the engine's own proposer: on
  greedy traces its steps are the engine's, request by request (tests/engine/test_replay.py).

A step commits its kept drafts and the target's own next token; the prefill's first token is
not a step (as in the replay). Whether every column gave the target's tokens is reported per
category (the engine's outputs against the traces, or against each other).
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

from tqdm.auto import tqdm

from ..speculative import METHODS as PROPOSERS
from .methods import (ENGINE_METHODS, SPECULATIVE_METHODS, CellKey, EngineMethod, HFModels, Prompt,
                      model_of, stats_delta)
from .prompt_sets import PROMPT_SET_NAMES, PROMPT_SETS, usable_prompts
from .replay_steps import Tally, Trace, replay


@dataclass
class Column:
    proposer: str         # EngineConfig.proposer (vLLM's speculative method)
    method: str           # the bench method measured (the first asked for with this proposer)
    methods: list[str]    # every bench method asked for that it stands for
    source: str           # "engine" | "replay"

    @property
    def label(self) -> str:
        return self.proposer + (" (replay)" if self.source == "replay" else "")


def default_methods(args) -> list[str]:
    """Every exspec_* speculative method whose draft or head is at hand."""
    at_hand = {None: True, "draft": bool(args.draft), "head": bool(args.eagle3)}
    return [m for m in SPECULATIVE_METHODS if m.startswith("exspec") and at_hand[model_of(m)]]


def columns(methods: list[str]) -> list[Column]:
    """One column per proposer of the speculative engine methods, in the order asked."""
    found: dict[str, Column] = {}
    for m in methods:
        if m not in SPECULATIVE_METHODS:
            continue
        proposer = ENGINE_METHODS[m][1]
        if proposer in found:
            found[proposer].methods.append(m)
            continue
        lookup = PROPOSERS.declared(proposer).model is None
        found[proposer] = Column(proposer, m, [m], "replay" if lookup else "engine")
    return list(found.values())


def categories(args, hf: HFModels) -> list[tuple[str, str, list[Prompt]]]:
    """(category, where its prompts come from, its prompts as token ids)."""
    if args.prompts_given and not args.prompt_set:
        grouped: dict[str, list[Prompt]] = {}
        for p in usable_prompts(args, hf):
            grouped.setdefault(p.category or "uncategorized", []).append(p)
        return [(name, str(args.prompts), prompts) for name, prompts in grouped.items()]
    found = []
    for name in [args.prompt_set] if args.prompt_set else PROMPT_SET_NAMES:
        view = argparse.Namespace(**{**vars(args), "prompt_set": name,
                                     "prompts": PROMPT_SETS / f"{name}.jsonl"})
        found.append((name, str(view.prompts), usable_prompts(view, hf)))
    return found


def engine_tally(method: EngineMethod, prompts: list[Prompt], max_tokens: int,
                 warm: int, batch: int = 1) -> tuple[Tally, list[list[int]], dict | None]:
    """The prompts served `batch` at a time, wave after wave, by one engine, from a proposer that
    has forgotten what it learnt (the first `warm` first, one by one, not counted); the row-steps
    of the rest (a step of B rows is B row-steps), their outputs, and (a hybrid) how many
    row-steps each source served."""
    engine = method.engine
    engine.proposer.forget()
    waves = [[p] for p in prompts[:warm]] + [prompts[i:i + batch] for i in range(warm, len(prompts), batch)]
    outputs, before, chosen = [], None, None
    for i, wave in enumerate(waves):
        if i == warm:
            before = engine.stats()
            chosen = dict(getattr(engine.proposer, "chosen", None) or {}) or None
        for out in engine.generate([p.ids for p in wave], method.params(len(wave), max_tokens)):
            if out.finish_reason == "error":
                raise RuntimeError(f"{method.key.method}: {out.error}")
            outputs.append(list(out.token_ids))
    delta = stats_delta(before, engine.stats())
    if chosen is not None:
        chosen = {source: engine.proposer.chosen[source] - n for source, n in chosen.items()}
    row_steps = sum(rows * n for (rows, _), n in delta["steps_by_shape"].items())
    return (Tally(row_steps, delta["committed_tokens"], delta["draft_tokens"],
                  delta["accepted_tokens"]), outputs[warm:], chosen)


def cell(tally: Tally, chosen: dict | None = None) -> dict:
    out = dict(asdict(tally), tokens_per_step=tally.tokens_per_step, kept_share=tally.kept_share)
    if chosen is not None:
        out["chosen"] = chosen   # the hybrid's row-steps per source
    return out


def measure(args, hf: HFModels, progress: bool, batch: int = 1) -> dict:
    """One table of results.json's "tokens_per_step" (a list, one per batch size): the columns,
    and per category (then "all") each column's row-steps, tokens, drafts proposed and kept,
    tokens per step and kept share. At a batch size above 1 every column is the engine's (a
    lookup proposer learns across the requests in flight as it serves them, which the replay
    does not model)."""
    cols = columns(args.methods)
    if batch > 1:
        cols = [Column(c.proposer, c.method, c.methods, "engine") for c in cols]
    warm = args.warm_prompts
    cats = categories(args, hf)
    short = [name for name, _, prompts in cats if len(prompts) <= warm]
    if short:
        raise SystemExit(f"exspec-bench: --warm-prompts {warm} leaves none of category "
                         f"{short[0]}'s usable prompts to count: lower it")
    needs_traces = any(c.source == "replay" for c in cols)
    rows = [{"category": name, "source": source, "prompts": len(prompts) - warm, "cells": {},
             "outputs_agree": True} for name, source, prompts in cats]
    traces: list[list[Trace]] = []
    if needs_traces:   # the target's greedy answers, which the lookup proposers replay
        for _, _, prompts in tqdm(cats, desc="traces (target greedy)", disable=not progress):
            traces.append([Trace(p.ids, hf.generate([p.ids], args.max_tokens)[0]) for p in prompts])
    with tqdm(total=len(cols) * len(cats), desc=f"tokens per step, batch {batch}",
              disable=not progress) as bar:
        for col in cols:
            method = None
            if col.source == "engine":
                method = EngineMethod(CellKey(col.method, batch, args.k, False), args, batch)
            spec = {"method": col.proposer, "num_speculative_tokens": args.k}
            for i, (row, (_, _, prompts)) in enumerate(zip(rows, cats)):
                bar.set_postfix_str(f"{col.label}: {row['category']}")
                if method is None:
                    tally, chosen = replay(spec, traces[i], warm).get("all", Tally()), None
                else:
                    tally, outputs, chosen = engine_tally(method, prompts, args.max_tokens, warm, batch)
                    reference = [t.output_ids for t in traces[i][warm:]] if traces else \
                        row.setdefault("outputs", outputs)
                    row["outputs_agree"] &= outputs == reference
                row["cells"][col.proposer] = cell(tally, chosen)
                bar.update()
            del method
    total = {"category": "all", "source": None, "prompts": sum(r["prompts"] for r in rows),
             "cells": {}, "outputs_agree": all(r["outputs_agree"] for r in rows)}
    for col in cols:
        tally = Tally()
        for row in rows:
            tally.add(Tally(**{k: row["cells"][col.proposer][k]
                               for k in ("steps", "tokens", "proposed", "kept")}))
        total["cells"][col.proposer] = cell(tally)
    for row in rows:
        row.pop("outputs", None)
    return {"batch_size": batch, "k": args.k, "max_tokens": args.max_tokens, "warm_prompts": warm,
            "greedy": True, "columns": [asdict(c) | {"label": c.label} for c in cols],
            "rows": rows + [total]}


def section(tables: list[dict] | None) -> list[str]:
    """results.md: per batch size, categories down, methods across, the best of each row in bold."""
    return [line for table in tables or [] for line in _section(table)]


def _section(table: dict) -> list[str]:
    cols = table["columns"]
    batch = table["batch_size"]
    served = ("each category's prompts served one after another" if batch == 1 else
              f"each category's prompts served {batch} at a time (tokens per step per row: "
              f"committed tokens ÷ row-steps)")
    lines = [f"## Tokens per target step by prompt category, batch {batch}", "",
             f"Batch {batch}, fixed k = {table['k']}, greedy, up to {table['max_tokens']} tokens a prompt, "
             f"{served}"
             + (f" after its first {table['warm_prompts']}, served uncounted" if table["warm_prompts"] else "")
             + ". Tokens per step = committed tokens ÷ target steps (the prefill's token is not a "
               "step): the speed-up's ceiling where a verification costs a plain step; in brackets "
               "the share of proposed tokens kept. (replay): the offline replay of the target's "
               "greedy answers through the engine's own proposer; the others: the engine's stats.", "",
             "| category | prompts | " + " | ".join(c["label"] for c in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for row in table["rows"]:
        figures = [row["cells"][c["proposer"]] for c in cols]
        best = max((f["tokens_per_step"] or 0 for f in figures), default=0)
        shown = []
        for f in figures:
            rate = f["tokens_per_step"]
            text = "–" if rate is None else f"{rate:.2f}"
            if rate is not None and rate == best and len(cols) > 1:
                text = f"**{text}**"
            shown.append(text + ("" if f["kept_share"] is None else f" ({f['kept_share']:.0%})"))
        name = row["category"] if row["outputs_agree"] else f"{row['category']} (outputs differ)"
        lines.append(f"| {name} | {row['prompts']} | " + " | ".join(shown) + " |")
    return lines + [""]
