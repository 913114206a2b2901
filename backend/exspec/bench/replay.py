"""`python -m exspec.bench.replay`: how many tokens a host proposer (n-gram prompt lookup,
suffix decoding) would commit per target step on recorded traffic, offline, without a model.

Each trace's output is replayed as the greedy target produced it: the first token comes from
the prefill, then at every step the proposer proposes from what it would have seen in serving
(the row's prompt and output so far; suffix decoding's global tree, the outputs of the traces
before it), and the step commits the longest prefix of the proposal that the recorded output
continues with, plus the target's own next token. The engine's proposers run as they run in
serving (`LookupProposer.propose_row`), so on greedy traces the replay's steps are the engine's
steps at that fixed k, one request at a time (tests/engine/test_replay.py checks it on the
engine).

Tokens per step is the speed-up's ceiling where a verification costs what a plain step costs
(a GPU at small batch, memory-bound, comes near it; on a CPU a wide verification costs more,
and exspec-bench measures the real thing). It answers, before a deployment: does my traffic
repeat itself enough for suffix decoding or prompt lookup to pay, at which k, after how much
history. A sampled output (the engine's default gumbel coupling) replays as exactly: there a
proposed token is kept where it equals the token the target draws at its position, which is
the recorded one (under the rejection coupling: the same in expectation, not step for step).

Traces: JSONL, one request a line, in the order they were served: "prompt" (text as the model
saw it, chat template applied) or "prompt_token_ids"; "output" (text) or "output_token_ids";
"category" (optional: a column each). Text goes through --tokenizer. Or, with --prompt-set, the
target's own greedy answers to a set shipped with exspec-bench, made here first (--pair,
--num-prompts, --max-tokens as exspec-bench takes them; --save-traces keeps them as JSONL).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .flags import at_least, input_file, int_list, model_source, read_jsonl, writable
# the count itself (replay_one too: tests/engine/test_replay.py reaches it here)
from .replay_steps import Tally, Trace, proposer_of, replay, replay_one  # noqa: F401

DEFAULT_CONFIGS = ('{"method": "ngram", "num_speculative_tokens": 5}',
                   '{"method": "suffix", "num_speculative_tokens": 5}')


def trace_rows(path: Path) -> list[tuple[int, dict]]:
    """The traces with an output, with their line numbers, each checked (a ValueError names the
    line): a prompt and an output, each as text or as token ids."""
    rows = []
    for n, row in read_jsonl(path):
        for part in ("prompt", "output"):
            ids, text = row.get(f"{part}_token_ids"), row.get(part)
            if ids is not None:
                if not isinstance(ids, list) or any(type(t) is not int or t < 0 for t in ids):
                    raise ValueError(f"{path}:{n}: {part}_token_ids must be a list of token ids")
            elif not isinstance(text, str):
                raise ValueError(f"{path}:{n}: no \"{part}\" (text) nor \"{part}_token_ids\"")
        if row.get("output_token_ids") or row.get("output"):   # else no step to replay
            rows.append((n, row))
    if not rows:
        raise ValueError(f"{path} holds no trace with an output")
    return rows


def read_traces(path: Path, tokenizer_path: str | None) -> list[Trace]:
    """The traces (`trace_rows`), their text through the tokenizer."""
    tokenizer = None
    traces = []
    for _, row in trace_rows(path):
        ids = {}
        for part in ("prompt", "output"):
            if row.get(f"{part}_token_ids") is not None:
                ids[part] = row[f"{part}_token_ids"]
            else:
                if tokenizer is None:
                    from transformers import AutoTokenizer
                    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
                ids[part] = tokenizer.encode(row[part], add_special_tokens=False)
        traces.append(Trace(ids["prompt"], ids["output"], str(row.get("category", ""))))
    return traces


def traces_from_prompt_set(args) -> list[Trace]:
    """The target's greedy answers to a shipped prompt set (exspec-bench's prompts and pair)."""
    from . import cli
    from .methods import HFModels
    bench = cli.parse_args(["--pair", args.pair, "--prompt-set", args.prompt_set,
                            "--num-prompts", str(args.num_prompts), "--max-tokens",
                            str(args.max_tokens), "--threads", str(args.threads)]
                           + (["--no-progress"] if args.no_progress else []))
    cli.set_up(bench)
    cli.resolve_pair(bench)
    bench.prompts = cli.PROMPT_SETS / f"{args.prompt_set}.jsonl"
    hf = HFModels(bench)
    prompts = cli.usable_prompts(bench, hf)
    from tqdm import tqdm
    return [Trace(p.ids, hf.generate([p.ids], args.max_tokens)[0], p.category)
            for p in tqdm(prompts, desc="traces (target greedy)", unit="prompt",
                          disable=args.no_progress)]


def table(rows: list[tuple[str, dict[str, Tally]]]) -> str:
    """Markdown: per configuration, tokens per step (kept share of proposed tokens) per category."""
    categories = sorted({c for _, t in rows for c in t} - {"all"})
    head = ["all", *categories] if categories else ["all"]
    lines = ["| tokens per target step (proposed tokens kept) | " + " | ".join(head) + " |",
             "|---|" + "---|" * len(head)]
    for label, tallies in rows:
        cells = []
        for c in head:
            t = tallies.get(c)
            cells.append("–" if t is None or t.tokens_per_step is None else
                         f"{t.tokens_per_step:.2f} ({t.kept_share or 0:.0%})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m exspec.bench.replay", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--traces", type=Path, help="JSONL of served requests, in order")
    source.add_argument("--prompt-set", choices=("grounded", "open", "agentic", "multiturn",
                                                 "code_edit", "repeated"),
                        help="make traces here: the target's greedy answers to a shipped set")
    ap.add_argument("--tokenizer", help="for traces that hold text")
    ap.add_argument("--speculative-config", action="append", metavar="JSON",
                    help="vLLM's speculative_config of a host proposer (method ngram or suffix, "
                         "their keys, num_speculative_tokens: the fixed k); once per row of the "
                         f"table (default: {' and '.join(DEFAULT_CONFIGS)})")
    ap.add_argument("-k", default=None,
                    help="comma list: each configuration replayed at each k (its "
                         "num_speculative_tokens replaced)")
    ap.add_argument("--warm", type=int, default=0, metavar="N",
                    help="the first N traces are served, not counted (suffix decoding learns "
                         "from them: a server that served them before)")
    ap.add_argument("--pair", choices=("demo", "smollm2"), default="smollm2",
                    help="--prompt-set: whose target answers (default smollm2)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for making traces")
    ap.add_argument("--save-traces", type=Path, help="--prompt-set: write the traces made here")
    ap.add_argument("--out", type=Path, help="also write the tallies as JSON here")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        args.configs = [json.loads(c) for c in args.speculative_config or DEFAULT_CONFIGS]
    except json.JSONDecodeError as e:
        ap.error(f"--speculative-config: not JSON ({e})")
    if any(not isinstance(c, dict) for c in args.configs):
        ap.error("--speculative-config: a JSON object, as vLLM's speculative_config")
    if args.k is not None:
        ks = int_list(ap, "-k", args.k, "k", 1)
        args.configs = [dict(c, num_speculative_tokens=k) for c in args.configs for k in ks]
    try:   # each configuration as the engine would take it: refused before any work
        args.labels = [label(spec, proposer_of(spec)[1]) for spec in args.configs]
    except ValueError as e:
        ap.error(f"--speculative-config: {e}")
    at_least(ap, {"--warm": args.warm}, 0)
    at_least(ap, {"--num-prompts": args.num_prompts, "--max-tokens": args.max_tokens,
                  "--threads": args.threads}, 1)
    if args.save_traces and not args.prompt_set:
        ap.error("--save-traces writes the traces --prompt-set makes; --traces are yours already")
    writable(ap, "--save-traces", args.save_traces)
    writable(ap, "--out", args.out)
    model_source(ap, "--tokenizer", args.tokenizer)
    count = args.num_prompts
    if args.traces:
        rows = input_file(ap, "--traces", trace_rows, args.traces)
        text = [n for n, row in rows if any(row.get(f"{p}_token_ids") is None for p in ("prompt", "output"))]
        if text and not args.tokenizer:
            ap.error(f"--traces: {args.traces}:{text[0]} holds text: give --tokenizer")
        count = len(rows)
    if args.warm >= count:
        ap.error(f"--warm {args.warm} leaves none of the {count} traces to count")
    return args


def label(spec: dict, k: int) -> str:
    """The table's name for a configuration: its method, the k it runs at (vLLM's default where
    it gives none: suffix decoding proposes up to its tree's depth) and the keys it sets."""
    rest = {key: v for key, v in spec.items() if key not in ("method", "num_speculative_tokens")}
    extra = "".join(f", {key} {v}" for key, v in rest.items())
    return f"{spec['method']}, k = {k}{extra}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.traces:
        traces = read_traces(args.traces, args.tokenizer)
    else:
        traces = traces_from_prompt_set(args)
        if args.save_traces:
            args.save_traces.write_text("".join(
                json.dumps({"prompt_token_ids": t.prompt_ids, "output_token_ids": t.output_ids,
                            "category": t.category}) + "\n" for t in traces))
    if args.warm >= len(traces):   # --prompt-set: prompts too long for the pair were skipped
        raise SystemExit(f"replay: --warm {args.warm} leaves none of the {len(traces)} traces to count")
    rows = [(name, replay(spec, traces, args.warm)) for name, spec in zip(args.labels, args.configs)]
    print(f"{len(traces) - args.warm} traces replayed (after {args.warm} served first), one "
          f"request at a time, each at its fixed k; a decode step commits the kept proposal and "
          f"one token (the prefill's first token is not a step)\n")
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(
            [{"config": spec, "tallies": {c: {"steps": t.steps, "tokens": t.tokens,
                                               "proposed": t.proposed, "kept": t.kept,
                                               "tokens_per_step": t.tokens_per_step}
                                           for c, t in tallies.items()}}
             for spec, (_, tallies) in zip(args.configs, rows)], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
