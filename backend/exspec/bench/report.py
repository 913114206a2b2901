"""The benchmark's three output files: results.json, results.md, throughput.png (their names
and schema: design: "Names other parts rely on")."""
from __future__ import annotations

import json
import statistics
import warnings
from pathlib import Path

from .methods import PATHS, SPECULATIVE_METHODS
from .tokens_per_step import section as tokens_per_step_section

SPEC_METHODS = (*SPECULATIVE_METHODS, "hf_assisted")


def write_outputs(results: dict, divergences: list[dict], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md", out / "throughput.png"]
    paths[0].write_text(json.dumps(results, indent=2) + "\n")
    paths[1].write_text(markdown(results, divergences))
    if not results["cells"]:   # --tokens-per-step alone: nothing timed to plot
        return paths[:2]
    try:
        plot(results["cells"], paths[2])
    except ImportError:
        warnings.warn("matplotlib is not installed (pip install matplotlib==3.11.2): "
                      "throughput.png not written", stacklevel=2)
        paths.pop()
    return paths


# -- results.md ---------------------------------------------------------------------------------
def _num(value, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _pct(value, digits: int = 0) -> str:
    return "–" if value is None else f"{100 * value:.{digits}f}%"


def label(cell: dict) -> str:
    coupling = cell.get("sampling_coupling")
    path = PATHS[cell.get("path", "eager")]
    path = f", {path}" if path else ""
    if cell["adaptive_k"] is None:
        extra = ", ".join(x for x in (coupling, path[2:]) if x)
        return cell["method"] + (f" ({extra})" if extra else "")
    return (f"{cell['method']} ({'adaptive k≤' if cell['adaptive_k'] else 'k='}{cell['k']}"
            f"{', ' + coupling if coupling else ''}{path})")


def paths_section(paths: dict | None) -> list[str]:
    """Eager against compiled: per-forward cost of each model, and each compiled engine's warm-up."""
    if not paths:
        return []
    lines = ["## Eager against compiled decode path", "",
             "| model | B | tokens per row | eager ms | compiled ms | × |", "|---|---|---|---|---|---|"]
    for row in paths["forward_ms"]:
        lines.append(f"| {row['model']} | {row['batch_size']} | {row['tokens']} | "
                     f"{_num(row['eager_ms'])} | {_num(row['compiled_ms'])} | "
                     f"{_num(row['eager_ms'] / row['compiled_ms'])} |")
    lines += ["", "| compiled engine | B | graphs | graph breaks | warm-up s |", "|---|---|---|---|---|"]
    for w in paths["warm_up"]:
        lines.append(f"| {w['label']} | {w['batch_size']} | {w['graphs']} | {w['graph_breaks']} | "
                     f"{_num(w['seconds'], 1)} |")
    return lines + [""]


def table(cells: list[dict]) -> str:
    head = ("| method | B | tokens/s | × AR | × B=1 | exact | prefix | accept | accepted len "
            "| realign | equal-len steps | ideal tokens/s | of ideal |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in sorted(cells, key=lambda c: (c["batch_size"], order(c))):
        lines.append(
            f"| {label(c)} | {c['batch_size']} | {_num(c['tokens_per_s'], 1)} "
            f"| {_num(c['speedup_vs_autoregressive'])} | {_num(c['speedup_vs_batch1'])} "
            f"| {_pct(c['exact_match_share'])} | {_pct(c['prefix_match_mean'])} "
            f"| {_num(c['acceptance_rate'])} | {_num(c['mean_accepted_length'])} "
            f"| {_pct(c['realign_share'], 1)} | {_pct(c['equal_length_step_share'])} "
            f"| {_num(c['ideal_tokens_per_s'], 1)} | {_pct(c['ideal_share'])} |")
    return "\n".join(lines)


def drafts_section(cells: list[dict]) -> list[str]:
    """Per speculative cell that drafted on the device or looked up: acceptance by draft
    position, the draft's cost per token against a target step, and an analytic projection."""
    drafted = [c for c in cells if c.get("acceptance_by_depth")]
    if not drafted:
        return []
    lines = ["## Drafts by position", "",
             "accept @j = of the row-drafts verified at position j, the share kept; draft ms = one "
             "draft forward (the draft phase's time over its forwards); ÷ step = that over one "
             "autoregressive step at the same batch size (a target step).", "",
             "| method | B | accepted len | accept @1 .. @k | draft ms | ÷ step |", "|---|---|---|---|---|---|"]
    for c in sorted(drafted, key=lambda c: (c["batch_size"], order(c))):
        by = " / ".join(f"{a:.2f}" for a in c["acceptance_by_depth"])
        lines.append(f"| {label(c)} | {c['batch_size']} | {_num(c['mean_accepted_length'])} | {by} "
                     f"| {_num(c.get('draft_ms_per_forward'))} | {_num(c.get('draft_cost_vs_target_step'), 3)} |")
    lines += ["", "Projection (analytic, not measured): where verifying k + 1 tokens costs about one "
              "decode step (a GPU-class target at small batch), a step yields 1 + sum over j <= k "
              "of accept @j tokens per target pass. From each method's widest fixed-k cell:", "",
              "| method | B | k = 1 | 2 | 3 | 4 | 5 | 6 |", "|---|---|---|---|---|---|---|---|"]
    widest = {}
    for c in drafted:
        if c["adaptive_k"] is False and c.get("sampling_coupling") in (None, "gumbel"):
            key = (c["method"], c["batch_size"], variant(c))
            if key not in widest or c["k"] > widest[key]["k"]:
                widest[key] = c
    for (method, batch, _), c in sorted(widest.items(), key=lambda kv: (kv[0][1], order(kv[1]))):
        per = c["acceptance_by_depth"]
        passes = [1 + sum(per[:k]) if k <= len(per) else None for k in range(1, 7)]
        lines.append(f"| {label(c)} | {batch} | " + " | ".join(_num(p) for p in passes) + " |")
    return lines + [""]


def order(cell: dict) -> tuple:
    methods = ("autoregressive", "hf_generate", *SPECULATIVE_METHODS, "hf_assisted")
    rank = methods.index(cell["method"]) if cell["method"] in methods else len(methods)
    return rank, cell["adaptive_k"] is False


def variant(cell: dict) -> tuple:
    """What else a cell of one method and batch size varies in: its coupling and decode path."""
    return cell.get("sampling_coupling"), cell.get("path", "eager")


def findings(cells: list[dict]) -> list[str]:
    """Speculation against autoregressive, batch size by batch size: achieved speedup, the
    analytic ideal's speedup (ideal ÷ ideal) and exspec's realign share relative to eqspec's."""
    by = {(c["method"], c["batch_size"], c["adaptive_k"], variant(c)): c for c in cells}
    sizes = sorted({c["batch_size"] for c in cells})
    couplings = sorted({variant(c) for c in cells}, key=str)   # (coupling, path) pairs
    head = "| × autoregressive (achieved / ideal ÷ ideal) | " + " | ".join(f"B={b}" for b in sizes) + " |"
    lines = [head, "|---|" + "---|" * len(sizes)]
    for method, adaptive, coupling in ((m, a, c) for m in SPECULATIVE_METHODS
                                       for a in (True, False) for c in couplings):
        row = [by.get((method, b, adaptive, coupling)) for b in sizes]
        if not any(row):
            continue
        cells_md = []
        for b, c in zip(sizes, row):   # read in place: against the target alone compiled
            baseline = (coupling[0], "compiled") if coupling[1] == "in_place" else coupling
            ar = by.get(("autoregressive", b, None, baseline))
            ideal = (c["ideal_tokens_per_s"] / ar["ideal_tokens_per_s"]
                     if c and ar and c["ideal_tokens_per_s"] and ar["ideal_tokens_per_s"] else None)
            cells_md.append("–" if c is None else
                            f"{_num(c['speedup_vs_autoregressive'])} / {_num(ideal)}")
        lines.append(f"| {label(next(c for c in row if c))} | " + " | ".join(cells_md) + " |")
    ratios = []
    for b in sizes:
        ex, eq = by.get(("exspec", b, False, couplings[0])), by.get(("eqspec", b, False, couplings[0]))
        ok = ex and eq and ex["realign_share"] is not None and eq["realign_share"]
        ratios.append(f"{_pct(ex['realign_share'], 1)} vs {_pct(eq['realign_share'], 1)}" if ok else "–")
    lines.append("| realign share, exspec vs eqspec (fixed k) | " + " | ".join(ratios) + " |")
    # every proposer's cells (this listed the draft model's alone, and said "nowhere" while
    # prompt lookup ran at 0.82x at B = 16)
    losing = sorted({f"{label(c)} at B={c['batch_size']}" for c in cells
                     if c["method"] in SPECULATIVE_METHODS and c["speedup_vs_autoregressive"] is not None
                     and c["speedup_vs_autoregressive"] < 1})
    lines += ["", "Slower than autoregressive: " + (", ".join(losing) if losing else "nowhere") + "."]
    return lines


def paired(a: dict, b: dict) -> float:
    """Median over repeats of a's tokens/s ÷ b's in the same repeat."""
    return statistics.median(x / y for x, y in zip(a["tokens_per_s_runs"], b["tokens_per_s_runs"]))


def ratio(a: dict | None, b: dict | None) -> str:
    """a ÷ b: the ratio of their medians, and in brackets their paired ratio."""
    if not a or not b:
        return "–"
    return f"{_num(a['tokens_per_s'] / b['tokens_per_s'])} ({_num(paired(a, b))})"


def adaptive_against_fixed(cells: list[dict]) -> list[str]:
    """Adaptive k against the best fixed k of the same method, coupling and batch size (and, at
    B = 1, against Hugging Face assisted generation's own adaptive schedule)."""
    lines = []
    for c in sorted((c for c in cells if c["adaptive_k"] and c["method"] in SPECULATIVE_METHODS),
                    key=lambda c: (c["method"], str(c.get("path")), str(c.get("sampling_coupling")),
                                   c["batch_size"])):
        same = lambda o: (o["batch_size"] == c["batch_size"] and o.get("path") == c.get("path")  # noqa: E731
                          and o.get("sampling_coupling") == c.get("sampling_coupling"))
        fixed = [f for f in cells if f["method"] == c["method"] and f["adaptive_k"] is False and same(f)]
        if not fixed:
            continue
        best = max(fixed, key=lambda f: f["tokens_per_s"])
        ar = next((a for a in cells if a["method"] == "autoregressive" and same(a)), None)
        hf = next((h for h in cells if h["method"] == "hf_assisted" and h["adaptive_k"]
                   and h["batch_size"] == c["batch_size"]), None)
        lines.append(f"| {label(c)} | {c['batch_size']} | {_num(c['tokens_per_s'], 1)} "
                     f"| k={best['k']}: {_num(best['tokens_per_s'], 1)} "
                     f"| {ratio(c, best)} "
                     f"| {_num(c['tokens_per_s'] / ar['tokens_per_s']) if ar else '–'} "
                     f"| {ratio(c, hf)} |")
    if not lines:
        return []
    return (["## Adaptive k against the best fixed k", "",
             "| cell | B | adaptive tokens/s | best fixed k | adaptive ÷ best fixed (paired) "
             "| ÷ autoregressive | ÷ HF assisted (adaptive) (paired) |", "|---|---|---|---|---|---|---|"]
            + lines + ["", "Ratios of the cells' medians; in brackets the median of the ratios of the "
                       "two cells' runs in the same repeat (each repeat runs every cell once, at the "
                       "same moments, so a drift of the machine's speed cancels).", ""])


def history(cfg: dict) -> str:
    """--warm-prompts: the prompts served, untimed, before each run."""
    n = cfg.get("warm_prompts") or 0
    return (f" (after {n} more, served untimed before each run to the proposers that learn "
            f"across requests)") if n else ""


def interleaving(cfg: dict) -> str:
    if cfg.get("interleave", "run") == "tick":
        return ("each repeat running a batch size's cells side by side, one tick of each in turn "
                "(each round in a new seeded order), each tick timed alone")
    return "each repeat running a batch size's cells one after another"


def sampling(cfg: dict) -> str:
    if cfg.get("greedy", True):
        return "greedy"
    return (f"sampled at temperature {cfg['temperature']}, top-p {cfg['top_p']} (prompt i seeded "
            f"{cfg['seed']} + i), couplings {', '.join(cfg['sampling_couplings'])}")


def reference_name(cfg: dict) -> str:
    if cfg.get("greedy", True):
        return "target-only greedy HF generate at batch size 1"
    return ("the target-only seeded output (autoregressive, batch size 1, gumbel coupling; "
            "rejection sampling is not expected to match it)")


def markdown(results: dict, divergences: list[dict]) -> str:
    cfg, machine = results["config"], results["machine"]
    lines = [
        "# exspec-bench results", "",
        f"Command: `{results['command']}`", "",
        f"Machine: {machine['cpu']} ({machine['cpu_count']} cores, {machine['torch_threads']} torch "
        f"threads), device {machine['device_name']}; Python {machine['python']}, torch "
        f"{machine['torch']}, transformers {machine['transformers']}; {machine['platform']}.", "",
    ]
    if not results["cells"]:   # --tokens-per-step alone
        lines += [f"Pair: {cfg['pair']} (target `{cfg['target']}`, draft `{cfg['draft']}`, EAGLE-3 "
                  f"head `{cfg['eagle3']}`), {cfg['dtype']} on {cfg['device']}; took {cfg['wall_s']} s.",
                  "", *tokens_per_step_section(results.get("tokens_per_step"))]
        return "\n".join(lines) + "\n"
    lines += [
        f"Pair: {cfg['pair']} (target `{cfg['target']}`, draft `{cfg['draft']}`); "
        f"{cfg['num_prompts']} prompts{history(cfg)} from `{cfg['prompts']}`, max_tokens {cfg['max_tokens']}, "
        f"{sampling(cfg)}, k = {cfg['k']}, {cfg['dtype']} on {cfg['device']}; median of {cfg['repeats']} "
        f"runs per cell, {interleaving(cfg)}; took {cfg['wall_s']} s.", "",
        "tokens/s = generated tokens ÷ the seconds of the run's own ticks; × AR = vs autoregressive at the same batch size; "
        "× B=1 = vs the same method at batch size 1; exact / prefix = equivalence with "
        f"{reference_name(cfg)}; accepted len = committed tokens per row-step (bonus "
        "included); realign = share of step time spent forming, splitting or realigning groups; "
        "ideal = analytic ideal from measured forward costs (docs/design.md, \"Definitions\"; eager path, the target alone and the draft model's methods only: – elsewhere).", "",
        table(results["cells"]), "",
        *paths_section(results.get("paths")),
        "## Speculation against autoregressive", "",
    ]
    lines += findings(results["cells"])
    lines += [""] + adaptive_against_fixed(results["cells"])
    lines += [""] + drafts_section(results["cells"])
    lines += tokens_per_step_section(results.get("tokens_per_step"))
    lines += ["", "## Divergences from the reference", ""]
    if "rejection" in (cfg.get("sampling_couplings") or []):
        lines += ["Rejection-sampling cells are left out: they keep the distribution, not the "
                  "sample (their exact share above says how often they still agree).", ""]
    if not divergences:
        lines.append("None: every row of every run equals the reference token for token.")
    else:
        lines.append("Tie: the reference's top-2 gap is below 1e-4 of the logit range (float32) or "
                     "within a few ulps of the dtype at the top logit (bf16 / fp16).")
        lines.append("")
        lines.append("| cell | run | question | position | reference | got | top-2 gap / range "
                     "| top-2 gap (ulps) | tie |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for d in divergences:
            cell = {"method": d["method"], "k": d["k"], "adaptive_k": d["adaptive_k"],
                    "sampling_coupling": d["sampling_coupling"]}
            gap = "–" if d["top2_gap_rel"] is None else f"{d['top2_gap_rel']:.2e}"
            ulps = "–" if d["top2_gap_ulps"] is None else f"{d['top2_gap_ulps']:.1f}"
            lines.append(f"| {label(cell)} B={d['batch_size']} | {d['run']} | {d['question_id']} "
                         f"| {d['position']} | {d['reference_token']} | {d['got_token']} | {gap} "
                         f"| {ulps} | {'yes' if d['float_tie'] else 'no'} |")
    if machine.get("forward_ms"):
        lines += ["", f"## Forward costs behind the ideal (ms, cache of {cfg['ideal_cache_len']} tokens)",
                  "", "| forward | ms |", "|---|---|"]
        lines += [f"| {name} | {ms:.3f} |" for name, ms in machine["forward_ms"].items()]
    return "\n".join(lines) + "\n"


# -- throughput.png ------------------------------------------------------------------------------
def plot(cells: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[dict]] = {}
    for c in sorted(cells, key=lambda c: (order(c), c["batch_size"])):
        series.setdefault(label(c), []).append(c)
    palette = plt.get_cmap("tab10").colors   # cycled: --fixed-k can make more than ten series
    colors = {name: palette[i % len(palette)] for i, name in enumerate(series)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    twin = right.twinx()
    for name, group in series.items():
        xs = [c["batch_size"] for c in group]
        style = dict(color=colors[name], linestyle="--" if group[0]["adaptive_k"] is False else "-")
        left.plot(xs, [c["tokens_per_s"] for c in group], marker="o", label=name, **style)
        measured = [c for c in group if c["acceptance_rate"] is not None]
        if group[0]["method"] in SPEC_METHODS and measured:
            xs = [c["batch_size"] for c in measured]
            right.plot(xs, [c["acceptance_rate"] for c in measured], marker="o", label=name, **style)
            twin.plot(xs, [c["mean_accepted_length"] for c in measured], marker="s", alpha=0.45,
                      **style)
    batch_sizes = sorted({c["batch_size"] for c in cells})
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
        ax.set_xlabel("batch size")
        ax.grid(alpha=0.3)
    left.set_ylabel("tokens/s")
    left.set_title("Throughput vs batch size (dashed: fixed k)")
    left.legend(fontsize=7)
    right.set_ylabel("acceptance rate (circles)")
    right.set_ylim(0, 1.05)
    twin.set_ylabel("mean accepted length (squares, faded)")
    twin.set_ylim(bottom=0)
    right.set_title("Acceptance and mean accepted length")
    if right.get_legend_handles_labels()[0]:
        right.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
