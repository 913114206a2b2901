"""`exspec-bench`: throughput, output equivalence and overheads, method by method and batch size
by batch size. Terms: (design: "Definitions"); output files: (design: "Names other parts rely on").

Methods: the engine's `autoregressive`, `eqspec` and `exspec`, and two Hugging Face baselines:
`hf_generate` (batched, left-padded, greedy, no draft) and `hf_assisted` (assisted generation
with the draft, batch size 1 only). Every run puts the same prompts (token ids, so every method
sees identical inputs) through one method at one batch size. Within each batch size, after one
untimed run of the workload per method, every repeat runs all methods side by side, one tick of
each in turn (--interleave tick: the host's speed swings within seconds, and only methods timed
at the same moments compare fairly), each round of ticks in a new seeded order (a tick runs
faster after one that touched the same weights; `run_interleaved`); with --interleave run the
order is rotated each repeat (A B C, B C A, C A B, ...). The median over --repeats of each
method's tokens/s is reported.

Output equivalence is measured against target-only greedy Hugging Face `generate` at batch
size 1, once per prompt; every divergent row is listed with the reference's top-2 logit gap at
the first differing token, relative to the logit range. The analytic ideal of an engine run sums,
over the steps it actually ran, the measured cost of that step's forwards (CostModel) plus the
run's measured prefill time.

Sampled runs (--temperature > 0) time the engine's methods once per --sampling-couplings
entry, prompt i seeded args.seed + i, and compare every row with the target-only seeded output
(the autoregressive path at batch size 1, gumbel coupling); the Hugging Face baselines are greedy
only and are left out.

    exspec-bench                                  # the demo pair, CPU, defaults (< 10 min)
    exspec-bench --batch-sizes 1,8 --methods autoregressive,exspec --out bench_out/quick
    exspec-bench --pair deep-narrow --paths eager,compiled --batch-sizes 1,8 \
        --methods autoregressive,eqspec,exspec --out bench_out/paths
    exspec-bench --temperature 0.7 --top-p 0.95 --sampling-couplings gumbel,rejection \
        --methods autoregressive,eqspec,exspec --out bench_out/t07
    exspec-bench --pair smollm2 --tokens-per-step -k 4 --num-prompts 4 --max-tokens 64 \
        --out bench_out/tokens_per_step   # per prompt category, every method, nothing timed
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import EngineConfig
from ..models.eagle3 import load_head
from ..models.loading import DTYPES, load_pair
from ..sampling.sampler import COUPLINGS
from ..utils.machine import processor_name
from ..utils.threads import apply_threads, choose_threads
from .equivalence import Reference
from .flags import at_least, input_file, int_list, model_source, writable
from .ideal import CostModel, describes
from .methods import (HF_METHODS, METHODS, PATHS, SPECULATIVE_METHODS, CellKey, EngineMethod, HFModels, Prompt,
                      Run, in_place_kv_tokens, make_method, missing_models, model_of, reads_in_place,
                      run_interleaved)
from .paths import forward_costs
# the prompts live in prompt_sets.py; these names stay reachable here (tests, replay.py)
from .prompt_sets import (PROMPT_SET_NAMES, PROMPT_SETS, chat_of_turns, read_prompts,  # noqa: F401
                          usable_prompts)

DEMO_DIR = Path(__file__).resolve().parents[3] / "model_repository" / "exspec" / "1" / "demo"
SPECULATIVE = (*SPECULATIVE_METHODS, "hf_assisted")
DEFAULT_METHODS = ",".join(m for m in METHODS if not m.endswith(("_suffix", "_eagle3")))


def _draft_stop(value: str):
    return value if value == "auto" else float(value)


# -- the cells -------------------------------------------------------------------------------------
def cell_keys(methods: list[str], batch_size: int, k: int,
              couplings: list[str | None] = (None,), paths: list[str] = ("eager",),
              fixed_ks: list[int] | None = None) -> list[CellKey]:
    """Cells of one batch size; engine cells once per coupling (None: a greedy run) and per
    decode path (the Hugging Face baselines have only their own, eager; the in_place path only
    EXSPEC's methods, whose block store it reads). A speculative method
    runs adaptive (k at most `k`) and at each fixed k of `fixed_ks` (default: k alone); Hugging
    Face assisted generation's fixed schedule only at `k`."""
    keys = []
    for method in methods:
        engine = method not in HF_METHODS
        for coupling, path in ((c, p) for c in (couplings if engine else (None,))
                               for p in (paths if engine else ("eager",))
                               if p != "in_place" or reads_in_place(method)):
            if method in ("autoregressive", "hf_generate"):
                keys.append(CellKey(method, batch_size, 0, None, coupling, path))
            elif method in SPECULATIVE and (method != "hf_assisted" or batch_size == 1):
                keys.append(CellKey(method, batch_size, k, True, coupling, path))
                ks = fixed_ks if fixed_ks and method != "hf_assisted" else [k]
                keys += [CellKey(method, batch_size, kk, False, coupling, path) for kk in ks]
    return keys


def rotated(keys: list, repeat: int) -> list:
    """Repeat r's order: the keys rotated by r. This machine's speed drifts within seconds, and
    a method always run right after a heavy one, or first in a repeat, would carry that bias."""
    shift = repeat % len(keys) if keys else 0
    return keys[shift:] + keys[:shift]


def summarize(key: CellKey, runs: list[Run], reference: Reference,
              costs: CostModel) -> tuple[dict, list[dict]]:
    """One results.json cell (speedups are filled in once every cell is known)."""
    tps_runs = [run.tokens / run.seconds for run in runs]
    exact, prefix, divergences = reference.compare(key, runs)
    cell = {"method": key.method, "batch_size": key.batch_size, "k": key.k,
            "adaptive_k": key.adaptive_k, "sampling_coupling": key.coupling, "path": key.path,
            "tokens_per_s": statistics.median(tps_runs),
            "tokens_per_s_runs": tps_runs, "speedup_vs_autoregressive": None,
            "speedup_vs_batch1": None, "exact_match_share": exact, "prefix_match_mean": prefix,
            "acceptance_rate": None, "mean_accepted_length": None, "acceptance_by_depth": None,
            "draft_ms_per_forward": None, "step_ms": None, "draft_cost_vs_target_step": None,
            "realign_share": None,
            "equal_length_step_share": None, "ideal_tokens_per_s": None, "ideal_share": None}
    if runs[0].stats is not None:
        total = {name: sum(run.stats[name] for run in runs)
                 for name in runs[0].stats if name not in ("steps_by_shape", "drafts_by_depth")}
        row_steps = sum(rows * n for run in runs for (rows, _), n in run.stats["steps_by_shape"].items())
        if total["draft_tokens"]:
            cell["acceptance_rate"] = total["accepted_tokens"] / total["draft_tokens"]
        if key.adaptive_k is not None and row_steps:
            cell["mean_accepted_length"] = total["committed_tokens"] / row_steps
        depths = {}
        for run in runs:
            for depth, (verified, kept) in run.stats.get("drafts_by_depth", {}).items():
                depths[depth] = [a + b for a, b in zip(depths.get(depth, [0, 0]), (verified, kept))]
        if depths:   # of the row-drafts verified at position j, the share kept
            cell["acceptance_by_depth"] = [kept / verified for _, (verified, kept) in sorted(depths.items())]
        if total.get("draft_forwards"):
            cell["draft_ms_per_forward"] = 1000 * total["time_draft_s"] / total["draft_forwards"]
        if total["steps"]:
            cell["step_ms"] = 1000 * total["time_step_s"] / total["steps"]
        if total["time_step_s"]:
            cell["realign_share"] = total["time_realign_s"] / total["time_step_s"]
        if total["steps"]:
            cell["equal_length_step_share"] = total["equal_length_steps"] / total["steps"]
        if row_steps and describes(key.method, key.path):
            ideal = statistics.median(run.tokens / costs.ideal_seconds(run.stats) for run in runs)
            cell["ideal_tokens_per_s"] = ideal
            cell["ideal_share"] = cell["tokens_per_s"] / ideal
    return cell, divergences


def add_speedups(cells: list[dict]) -> None:
    """Against autoregressive on the same decode path (the in_place path: on the compiled one,
    since it cannot read a block store), and the same method at batch size 1."""
    by = {(c["method"], c["batch_size"], c["k"], c["adaptive_k"], c["sampling_coupling"], c["path"]): c
          for c in cells}
    for c in cells:
        path = "compiled" if c["path"] == "in_place" else c["path"]
        ar = by.get(("autoregressive", c["batch_size"], 0, None, c["sampling_coupling"], path))
        if ar:
            c["speedup_vs_autoregressive"] = c["tokens_per_s"] / ar["tokens_per_s"]
            if c["draft_ms_per_forward"] and ar["step_ms"]:   # a draft token against a target step
                c["draft_cost_vs_target_step"] = c["draft_ms_per_forward"] / ar["step_ms"]
        b1 = by.get((c["method"], 1, c["k"], c["adaptive_k"], c["sampling_coupling"], c["path"]))
        if b1:
            c["speedup_vs_batch1"] = c["tokens_per_s"] / b1["tokens_per_s"]


# -- the command -----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="exspec-bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="target model (default: the demo pair's)")
    ap.add_argument("--draft", help="draft model (default: the demo pair's)")
    ap.add_argument("--tokenizer", help="tokenizer (default: the demo pair's, else the target's)")
    ap.add_argument("--eagle3", help="an EAGLE-3 head's folder for the *_eagle3 and *_eagle3_suffix "
                    "methods (default with --pair smollm2: the shipped head, where there is one)")
    ap.add_argument("--prompts", type=Path, help="SpecBench JSONL (default: the demo prompts)")
    ap.add_argument("--prompt-set", choices=PROMPT_SET_NAMES,
                    help="a prompt set shipped here instead of --prompts, each turn put through "
                         "the tokenizer's chat template: grounded (outputs repeat the input: "
                         "n-gram proposals pay), open, agentic (JSON extraction, SQL over one "
                         "schema and tool calls, interleaved: outputs repeat earlier requests' "
                         "formats, what suffix decoding's global tree learns), multiturn (a "
                         "second turn asks for the first answer again with a change; the first "
                         "is answered by the target, greedy, before the run), code_edit "
                         "(rewrite the given code with one change) or repeated (8 tool calls, "
                         "SQL queries and small functions, asked three times in other words, "
                         "round after round: what many users of one agent send; with "
                         "--warm-prompts 8 the first round is the history)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--warm-prompts", type=int, default=0, metavar="N",
                    help="the first N of the prompts are not timed: before each run (warm-up "
                         "and repeats) they are served, untimed, to the cells whose proposer "
                         "learns across requests (suffix decoding's global tree), as a server "
                         "that served them before; the rest are the timed workload (default 0)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("-k", type=int, default=5, help="speculative tokens (max k when adaptive)")
    ap.add_argument("--fixed-k", default=None,
                    help="comma list of fixed k's to run beside adaptive k (default: -k alone); "
                         "results.md then compares adaptive with the best of them. 0: the "
                         "method's own layout without speculation (what speculation adds)")
    ap.add_argument("--batch-sizes", default=None,
                    help="comma list (default: 1,2,4,8,16; with --tokens-per-step only: 1)")
    ap.add_argument("--methods", default=None,
                    help=f"comma list of {', '.join(METHODS)} (default: all but the *_suffix "
                    "ones, whose global tree needs a workload that repeats across requests, and "
                    "the *_eagle3 ones, which need a head: --eagle3; with --pair smollm2 and its "
                    "shipped head, those too; with --tokens-per-step, every exspec_* method whose "
                    "draft or head is at hand)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft-stop", type=_draft_stop, default=None, metavar="auto|C",
                    help="adaptive k's draft stop (model.json draft_stop_confidence): auto, or a "
                         "confidence in [0, 1), 0 = off (default: the engine's, off)")
    ap.add_argument("--interleave", choices=("tick", "run"), default="tick",
                    help="tick (default): each repeat runs its cells side by side, one tick (an "
                         "engine step, a Hugging Face generate call) of each in turn, each tick "
                         "timed alone, so every cell sees the host at the same moments; run: one "
                         "cell after another, each alone (a lone server's absolute speed, but "
                         "ratios carry the host's drift between runs)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=100, help="sampled runs: prompt i gets seed + i")
    ap.add_argument("--sampling-couplings", default="gumbel",
                    help=f"sampled runs: comma list of {', '.join(COUPLINGS)}, each timed interleaved")
    ap.add_argument("--paths", default="eager",
                    help="decode paths, comma list of eager, compiled (enforce_eager false/true), "
                         "in_place (compiled, reading the block store in place: attention_backend "
                         "FLEX_ATTENTION, exspec methods only): each engine cell runs on each; "
                         "compiled adds per-forward costs and warm-ups")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend of the compiled path (eager / aot_eager: Dynamo's "
                         "graphs without generated code, for a quick check of the machinery)")
    ap.add_argument("--pair", choices=("demo", "deep-narrow", "smollm2"), default="demo",
                    help="without --target: the demo pair, smollm2 (the real pair, exspec.models.real_pair, "
                         "on its chat prompts), or a deep, narrow random pair built here "
                         f"({DEEP_NARROW['target_layers']} and {DEEP_NARROW['draft_layers']} layers, "
                         f"hidden {DEEP_NARROW['hidden']}: the launch-bound regime of a GPU, on a CPU)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: the server's rule: $OMP_NUM_THREADS, else 1)")
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("--tokens-per-step", nargs="?", const="only", choices=("only", "also"),
                    help="tokens per target step per prompt category, every speculative method "
                         "side by side (bench/tokens_per_step.py): batch 1 (--batch-sizes: a "
                         "table per batch size), fixed -k, greedy, no "
                         "timing; rows the shipped prompt sets (--prompt-set: that one; --prompts: "
                         "the file's categories), --num-prompts of each. Alone (or 'only'): this "
                         "table only, in results.json and results.md (the real pair, 4 prompts "
                         "of 64 tokens a set: ~10 minutes on 2 CPU cores); 'also': after the "
                         "timed run, beside its cells")
    args = ap.parse_args(argv)
    args.prompts_given = args.prompts is not None
    at_least(ap, {"-k": args.k, "--num-prompts": args.num_prompts, "--max-tokens": args.max_tokens,
                  "--repeats": args.repeats, "--threads": args.threads}, 1)
    at_least(ap, {"--warm-prompts": args.warm_prompts, "--seed": args.seed}, 0)
    if args.warm_prompts >= args.num_prompts:
        ap.error(f"--warm-prompts {args.warm_prompts} leaves none of --num-prompts "
                 f"{args.num_prompts} to time: raise --num-prompts above it")
    # --tokens-per-step: one table per batch size given (default batch 1 only)
    args.tps_batch_sizes = int_list(ap, "--batch-sizes", args.batch_sizes or "1", "batch sizes", 1)
    args.batch_sizes = int_list(ap, "--batch-sizes", args.batch_sizes or "1,2,4,8,16", "batch sizes", 1)
    args.methods_given = args.methods is not None
    args.methods = [m.strip() for m in (args.methods or DEFAULT_METHODS).split(",") if m.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        ap.error(f"unknown methods {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if args.fixed_k is not None:   # at most -k: adaptive k is compared with each
        args.fixed_k = int_list(ap, "--fixed-k", args.fixed_k, "k's", 0, args.k)
    if args.temperature < 0:
        ap.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.tokens_per_step and args.temperature > 0:
        ap.error("--tokens-per-step counts greedy steps: drop --temperature")
    if args.tokens_per_step and args.methods_given and not set(args.methods) & set(SPECULATIVE_METHODS):
        ap.error(f"--tokens-per-step: --methods names no speculative engine method; choose from "
                 f"{', '.join(SPECULATIVE_METHODS)}")
    if not 0 < args.top_p <= 1:
        ap.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.draft_stop not in (None, "auto") and not 0 <= args.draft_stop < 1:
        ap.error(f"--draft-stop: auto or a confidence in [0, 1), got {args.draft_stop}")
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not args.paths or set(args.paths) - set(PATHS):
        ap.error(f"--paths: a comma list of {', '.join(PATHS)}")
    if "in_place" in args.paths and not any(map(reads_in_place, args.methods)):
        ap.error("--paths in_place reads EXSPEC's block store: add an exspec method to --methods")
    if {"compiled", "in_place"} & set(args.paths):
        from torch._dynamo import list_backends
        if args.compile_backend not in list_backends(exclude_tags=()):
            ap.error(f"--compile-backend {args.compile_backend!r}: not a torch.compile backend "
                     f"({', '.join(list_backends(exclude_tags=()))})")
    args.sampling_couplings = [c.strip() for c in args.sampling_couplings.split(",") if c.strip()]
    if not args.sampling_couplings or set(args.sampling_couplings) - set(COUPLINGS):
        ap.error(f"--sampling-couplings: a comma list of {', '.join(COUPLINGS)}")
    if args.temperature > 0:
        dropped = [m for m in args.methods if m in HF_METHODS]
        if dropped:
            warnings.warn(f"sampled run: leaving out {', '.join(dropped)} (greedy baselines)", stacklevel=2)
        args.methods = [m for m in args.methods if m not in HF_METHODS]
        if not args.methods:
            ap.error("a sampled run needs at least one engine method")
    check_files(ap, args)
    return args


def check_files(ap: argparse.ArgumentParser, args) -> None:
    """The models, the head, the prompts and the output folder, before any of them is loaded
    or written (a missing one used to stop the run after the pair had loaded)."""
    for flag in ("target", "draft", "tokenizer", "eagle3"):
        model_source(ap, f"--{flag}", getattr(args, flag))
    if args.eagle3 is not None and not (Path(args.eagle3).expanduser() / "config.json").exists():
        ap.error(f"--eagle3 {args.eagle3}: no config.json there (an EAGLE-3 head's folder)")
    if args.prompts is not None:
        input_file(ap, "--prompts", read_prompts, args.prompts, args.num_prompts)
    writable(ap, "--out", args.out, folder=True)
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        ap.error(f"--device {args.device!r}: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: this machine has no CUDA GPU")


def resolve_pair(args) -> str:
    """Fill in the models: the demo pair, else (with a warning) a tiny pair in a temp dir."""
    if args.target:
        args.draft = args.draft or None
        args.tokenizer = args.tokenizer or args.target
        if args.prompts is None and (DEMO_DIR / "prompts.jsonl").exists():
            args.prompts = DEMO_DIR / "prompts.jsonl"
        return "given"
    if args.pair == "deep-narrow":
        pair, name = build_deep_narrow_pair(tempfile.mkdtemp(prefix="exspec-bench-")), "deep-narrow"
    elif args.pair == "smollm2":
        from ..models.real_pair import ensure_pair
        pair, name = ensure_pair(), "smollm2"
        args.tokenizer = args.tokenizer or str(pair / "target")
        args.prompts = args.prompts or pair / "prompts.jsonl"
        from ..models.real_pair import HEAD_DIR
        if args.eagle3 is None and (HEAD_DIR / "config.json").exists():
            args.eagle3 = str(HEAD_DIR)
            if not args.methods_given:   # the real pair's default: its head beside its draft
                args.methods += ["eqspec_eagle3", "exspec_eagle3"]
    elif (DEMO_DIR / "target" / "config.json").exists() and (DEMO_DIR / "draft" / "config.json").exists():
        pair, name = DEMO_DIR, "demo"
    else:
        from ..demo.tiny import build_demo_pair
        pair = build_demo_pair(tempfile.mkdtemp(prefix="exspec-bench-"))
        name = "tiny"
        warnings.warn(f"no trained demo pair in {DEMO_DIR}; benchmarking a tiny random pair "
                      f"built in {pair} (its draft costs as much as its target)", stacklevel=2)
    args.target = args.target or str(pair / "target")
    args.draft = args.draft or str(pair / "draft")
    args.tokenizer = args.tokenizer or str(pair / "tokenizer")
    if args.prompts is None and (DEMO_DIR / "prompts.jsonl").exists():
        args.prompts = DEMO_DIR / "prompts.jsonl"
    return name


DEEP_NARROW = {"target_layers": 36, "draft_layers": 28, "hidden": 64}


def build_deep_narrow_pair(out_dir: str) -> Path:
    """Qwen3-8B / 0.6B depths at hidden 64: per forward, kernel launches dominate, as on a GPU."""
    from ..demo.tiny import build_tokenizer, llama, save_pair
    tokenizer = build_tokenizer()
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    target = llama(vocab, 0, layers=DEEP_NARROW["target_layers"], hidden=DEEP_NARROW["hidden"],
                   max_positions=512, eos_token_id=eos)
    draft = llama(vocab, 1, layers=DEEP_NARROW["draft_layers"], hidden=DEEP_NARROW["hidden"],
                  max_positions=512, eos_token_id=eos)
    return save_pair(out_dir, tokenizer, target, draft)


def machine_info(args, costs: CostModel | None) -> dict:
    cpu = processor_name()
    import transformers
    info = {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "device": args.device,
            "device_name": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else cpu}
    if costs is not None:
        info["forward_ms"] = costs.table_ms()   # the measured costs behind the analytic ideal
    return info


def main(argv: list[str] | None = None) -> int:
    began = time.perf_counter()
    args = parse_args(argv)
    command = "exspec-bench " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    set_up(args)
    progress = not args.no_progress
    pair = resolve_pair(args)
    if args.prompt_set:
        args.prompts = PROMPT_SETS / f"{args.prompt_set}.jsonl"
    if args.tokens_per_step == "only" and not args.methods_given:
        from .tokens_per_step import default_methods
        args.methods = default_methods(args)
    missing = missing_models(args.methods, args)
    if missing:
        raise SystemExit(f"exspec-bench: {missing}")

    hf = HFModels(args)
    # one loaded pair for every engine of the run: compiled once, its graphs shared
    args.model_pair = load_pair(EngineConfig(target_model=args.target, draft_model=args.draft,
                                             tokenizer=args.tokenizer, device=args.device,
                                             dtype=args.dtype,
                                             method="exspec" if args.draft else "autoregressive"))
    if args.eagle3 and any(model_of(m) == "head" for m in args.methods):
        args.model_pair.head = load_head(args.eagle3, args.model_pair.target, DTYPES[args.dtype], args.device)
    from .report import write_outputs
    from .tokens_per_step import measure
    if args.tokens_per_step == "only":   # the table alone: no reference, no timing
        results = {"schema": 1, "command": command, "machine": machine_info(args, None),
                   "config": run_config(args, pair), "cells": [],
                   "tokens_per_step": [measure(args, hf, progress, b) for b in args.tps_batch_sizes]}
        results["config"]["wall_s"] = round(time.perf_counter() - began, 1)
        for path in write_outputs(results, [], args.out):
            print(path)
        return 0
    prompts = usable_prompts(args, hf)
    args.history, prompts = prompts[:args.warm_prompts], prompts[args.warm_prompts:]
    if not prompts:
        raise SystemExit(f"exspec-bench: --warm-prompts {args.warm_prompts} leaves no prompt to "
                         f"time: raise --num-prompts above it")
    sampled = args.temperature > 0
    reference = reference_outputs(args, hf, prompts, sampled, progress)
    # the in_place path's stores have a fixed size: room for every prompt at once, in each model
    longest = max(len(p.ids) for p in prompts + args.history)
    args.in_place_kv_tokens = in_place_kv_tokens(len(prompts), longest, args.max_tokens, args.k)
    typical = round(statistics.mean(len(p.ids) for p in prompts) + args.max_tokens / 2)
    costs = CostModel(hf, typical)

    couplings = args.sampling_couplings if sampled else [None]
    plan = [(b, cell_keys(args.methods, b, args.k, couplings, args.paths, args.fixed_k))
            for b in args.batch_sizes]
    start = time.perf_counter()
    runs, warm_ups = run_plan(plan, args, hf, prompts, costs, progress)
    bench_seconds = time.perf_counter() - start
    paths = path_costs(args, prompts, warm_ups)
    cells, divergences = equivalence_cells(runs, reference, costs, progress)

    config = run_config(args, pair)
    config.update({"prompts": str(args.prompts) if args.prompts else None, "num_prompts": len(prompts),
                   "warm_prompts": len(args.history), "fixed_k": args.fixed_k,
                   "batch_sizes": args.batch_sizes, "paths": args.paths,
                   "compile_backend": args.compile_backend, "repeats": args.repeats,
                   "interleave": args.interleave, "greedy": not sampled,
                   "temperature": args.temperature, "top_p": args.top_p,
                   "seed": args.seed if sampled else None,
                   "sampling_couplings": couplings if sampled else None,
                   "draft_stop": args.draft_stop, "ideal_cache_len": typical,
                   "runs_wall_s": round(bench_seconds, 1)})
    results = {"schema": 1, "command": command, "machine": machine_info(args, costs),
               "config": config, "cells": cells}
    if paths is not None:
        results["paths"] = paths
    if args.tokens_per_step == "also":
        results["tokens_per_step"] = [measure(args, hf, progress, b) for b in args.tps_batch_sizes]
    config["wall_s"] = round(time.perf_counter() - began, 1)
    for path in write_outputs(results, divergences, args.out):
        print(path)
    return 0


def run_config(args, pair: str) -> dict:
    """results.json's config: what every run records (a timed run adds its own)."""
    return {"pair": pair, "target": args.target, "draft": args.draft, "eagle3": args.eagle3,
            "tokenizer": args.tokenizer, "prompts": None,   # --tokens-per-step: each category's own
            "num_prompts": args.num_prompts, "warm_prompts": args.warm_prompts,
            "max_tokens": args.max_tokens, "k": args.k, "methods": args.methods,
            "device": args.device, "dtype": args.dtype, "threads": args.threads, "greedy": True,
            "tokens_per_step": args.tokens_per_step, "wall_s": None}


def set_up(args):
    """Threads (args.threads becomes the intra-op count chosen), quiet transformers, the
    compile backend."""
    threads = apply_threads(choose_threads(args.threads))
    args.threads = threads.intra_op
    print(f"exspec-bench: {threads.describe()}", file=sys.stderr)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()   # weight loading, once per engine
    from ..models import compiled
    compiled.COMPILE_BACKEND = args.compile_backend


def reference_outputs(args, hf: HFModels, prompts: list[Prompt], sampled: bool,
                      progress: bool) -> Reference:
    """Target-only greedy HF generate; sampled: the target-only seeded output (the
    autoregressive path, batch 1, gumbel)."""
    reference_ids = None
    if sampled:
        key = CellKey("autoregressive", 1, 0, None, "gumbel")
        reference_ids = EngineMethod(key, args, len(prompts)).run(prompts, args.max_tokens).outputs
    return Reference(hf, prompts, args.max_tokens, progress, reference_ids)


def run_plan(plan: list, args, hf: HFModels, prompts: list[Prompt], costs: CostModel,
             progress: bool) -> tuple[dict[CellKey, list[Run]], list[dict]]:
    """Every batch size's cells: built and warmed up, then --repeats timed runs each; returns
    the runs per cell and the compiled warm-ups."""
    warm_ups = []
    total = sum(len(keys) * (args.repeats + 1) for _, keys in plan)
    runs: dict[CellKey, list[Run]] = {}
    with tqdm(total=total, desc="runs", unit="run", disable=not progress) as bar:
        for batch_size, keys in plan:
            methods = {}
            for key in keys:                       # build and warm up every method of this size
                bar.set_postfix_str(f"B={batch_size} warm-up {key.label}")
                methods[key] = warmed_up_method(key, args, hf, prompts, warm_ups)
                bar.update()
            for r in range(args.repeats):
                order = rotated(keys, r)
                # tick: the repeat's cells side by side, tick by tick; run: one after another
                for together in ([order] if args.interleave == "tick" else [[key] for key in order]):
                    bar.set_postfix_str(f"B={batch_size} run {r + 1}/{args.repeats} "
                                        + (together[0].label if len(together) == 1 else "all cells"))
                    timed = run_interleaved([methods[key] for key in together], prompts,
                                            args.max_tokens, args.device, seed=r)
                    for key, run in zip(together, timed):
                        if run.stats is not None:   # sample its forward shapes under today's load
                            costs.measure(costs.shapes(run.stats["steps_by_shape"]))
                        runs.setdefault(key, []).append(run)
                        bar.update()
            del methods
    return runs, warm_ups


def warmed_up_method(key: CellKey, args, hf: HFModels, prompts: list[Prompt], warm_ups: list):
    """One cell's method, built (its compiled warm-up appended to warm_ups) and run once
    untimed over the whole workload: what a method learns or caches (adaptive k's step costs
    and hazards, allocator pools) reaches its steady state, as in a server that has been up a
    while (a short warm-up left adaptive k exploring in the timed runs)."""
    method = make_method(key, args, hf, len(prompts))
    warm = getattr(method, "warm_up", None)
    if warm is not None:
        warm_ups.append({"label": key.label, "batch_size": key.batch_size, "graphs": warm.graphs,
                         "graph_breaks": warm.graph_breaks, "seconds": warm.seconds})
    method.run(prompts, args.max_tokens)
    return method


def path_costs(args, prompts: list[Prompt], warm_ups: list) -> dict | None:
    """With the compiled path: per-forward costs, on one compiled engine's runner."""
    if "compiled" not in args.paths:
        return None
    key = CellKey("exspec" if args.draft else "autoregressive", 8, args.k, False, None, "compiled")
    method = EngineMethod(key, args, len(prompts))
    return {"forward_ms": forward_costs(method.engine, [1, 8], args.k), "warm_up": warm_ups}


def equivalence_cells(runs: dict, reference: Reference, costs: CostModel,
                      progress: bool) -> tuple[list[dict], list]:
    """Each cell's summary (speedups added) and the divergent rows of the exact cells."""
    cells, divergences = [], []
    for key, key_runs in tqdm(runs.items(), desc="equivalence", disable=not progress):
        cell, div = summarize(key, key_runs, reference, costs)
        cells.append(cell)
        if key.coupling != "rejection":   # equal in distribution only: every row may differ
            divergences += div
    add_speedups(cells)
    return cells, divergences

if __name__ == "__main__":
    sys.exit(main())
