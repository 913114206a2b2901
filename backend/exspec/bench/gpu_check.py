"""`make gpu-check`: what a GPU lent for a few minutes has to show, in one command (at most 5
minutes) and one warmed process, the report (report.json, report.md) written again after every
phase, so that a run cut off by the time limit still leaves what it measured:

1. gpu_tests: `pytest -m gpu -rs tests` in a subprocess, within a time budget (its log:
   gpu_tests.log beside the report); skipped without CUDA;
2. ready: a calibrated pair of a large shape, built in memory (CUDA: Qwen3-8B's shape in
   bfloat16 from seeded random weights; --smoke: tiny Llamas of exspec.demo.tiny, float32), and
   the time to READY (engine construction with the compiled path's warm-up,
   EngineConfig(enforce_eager=False)) of target-only (autoregressive) and exspec at each batch
   size, on that pair;
3. interleaved: Hugging Face greedy generate, the engine target-only and exspec, one unit of work
   of each in turn (bench.methods.run_interleaved), after one untimed run, several repeats at each
   batch size (1 and 8): tokens/s per cell (median of the repeats), exspec's speed-up over
   target-only, and every cell's greedy outputs against target-only greedy generate at batch size
   1 (bench.equivalence: a divergence passes only at a near tie of the reference's top two
   logits; in float32 that is an exact tie, in bfloat16 a few ulps);
4. step_diagnostics: a few engine steps at the largest batch size under torch.profiler (the top
   kernels by self device time; on a CPU, ops by self CPU time), under sync debug mode "warn"
   (CUDA: the synchronizations per step, where they come from), and the graphs compiled and CUDA
   graphs captured since READY, which must be 0.

The pair: the draft is the target's own first layers (its embeddings, first layers, final norm and
LM head: the same tensors, no copy), and the contributions of the target's later layers to the
residual stream (their o_proj and down_proj weights) are scaled by one factor, found by bisection,
at which the draft's greedy token is the target's at --agreement of the positions of random text.
Random weights make unrelated models agree on nothing; a draft whose acceptance is chosen keeps
tokens as a trained one does, and costs what its layers cost.

    python -m exspec.bench.gpu_check --out bench_out/gpu-check        # CUDA: <= 5 minutes
    python -m exspec.bench.gpu_check --out /tmp/gpu-check --smoke     # CPU, tiny shapes, seconds

Exits 1 when a phase failed (a skipped one does not fail), and prints where the reports are.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch

from .. import SamplingParams
from ..models import compiled
from ..models.loading import DTYPES, ModelPair, _eos_ids, _max_positions
from .equivalence import Reference
from .flags import at_least, int_list, writable
from . import methods
from .methods import (CellKey, EngineMethod, HFGenerateMethod, HFModels, Prompt, pad_id_of,
                      run_interleaved)

REPO = Path(__file__).resolve().parents[3]
# Qwen3-8B's config.json (Qwen/Qwen3-8B) but for max_position_embeddings; its draft: its first
# layers. "tiny": exspec.demo.tiny's Llama, its vocabulary padded past the tokenizer's 320 tokens
# as real checkpoints' are (ids the tokenizer does not know reach the detokenizer).
SHAPES = {
    "8b": {"arch": "qwen3", "draft_layers": 4,
           "config": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                          num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                          max_position_embeddings=4096, tie_word_embeddings=False)},
    "tiny": {"arch": "llama", "draft_layers": 2,
             "config": dict(vocab_size=512, hidden_size=64, num_hidden_layers=6,
                            max_position_embeddings=256)},
}
LOGIT_STD = 4.0   # the random LM head's logits' spread: peaked enough that greedy has a clear top
SYNC_WARNING = "called a synchronizing CUDA operation"   # sync debug mode "warn"'s text
NEW_SHAPE = "after the warm-up"   # compiled.CompiledForward's warning for a shape met after READY
TOP_OPS = 15
PROMPT_LENGTHS = (8, 24)   # the random prompts' token counts, least and most


class Killed(BaseException):
    """SIGTERM or SIGINT (the Makefile's `timeout`, Ctrl-C): the phase running records it and the
    report is written before the process ends. A BaseException, so that no `except Exception`
    on the way (the engine isolates failures that way) holds it up."""


# -- the pair ----------------------------------------------------------------------------------------
def random_target(shape: dict, vocab_real: int, eos: int, device: str, dtype: str, seed: int):
    """The target of `shape` from seeded random weights, built on `device`. Linear weights
    N(0, 1/fan_in), so every projection keeps unit-size activations; embeddings N(0, 1); the LM
    head's logits spread LOGIT_STD; norms 1. "llama": exspec.demo.tiny.llama (its own init)."""
    cfg = dict(shape["config"], bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    if shape["arch"] == "llama":
        from ..demo.tiny import llama
        return llama(max(cfg["vocab_size"], vocab_real), seed, layers=cfg["num_hidden_layers"],
                     hidden=cfg["hidden_size"], max_positions=cfg["max_position_embeddings"],
                     eos_token_id=eos).to(device=device, dtype=DTYPES[dtype])
    from transformers import AutoModelForCausalLM, Qwen3Config
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**cfg), dtype=DTYPES[dtype])
    gen = torch.Generator(device).manual_seed(seed)
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        for p in model.parameters():
            if p is head:
                p.normal_(0.0, LOGIT_STD / math.sqrt(p.shape[1]), generator=gen)
            elif p is model.get_input_embeddings().weight:
                p.normal_(0.0, 1.0, generator=gen)
            elif p.dim() >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=gen)
            else:
                p.fill_(1.0)
    return model.eval().requires_grad_(False)


def first_layers(target, layers: int):
    """A model of the target's class made of its embeddings, first `layers` decoder layers,
    final norm and LM head: the target's own tensors, nothing copied (the layers are modules of
    their own: the compiled path wraps each layer's forward per model)."""
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    with torch.device("meta"):
        draft = type(target)(cfg)
    state = target.state_dict()
    draft.load_state_dict({name: state[name] for name in draft.state_dict()}, assign=True, strict=True)
    for name, buffer in list(draft.named_buffers()):   # non-persistent (rotary frequencies)
        if buffer.is_meta:
            owner, _, leaf = name.rpartition(".")
            draft.get_submodule(owner)._buffers[leaf] = target.get_buffer(name)
    return draft.eval().requires_grad_(False)


def later_outputs(target, layers: int) -> list[torch.Tensor]:
    """The weights through which each decoder layer past the first `layers` writes to the
    residual stream (attention's o_proj, the MLP's down_proj)."""
    found = [module.weight for layer in target.model.layers[layers:]
             for name, module in layer.named_modules() if name.endswith(("o_proj", "down_proj"))]
    if len(found) != 2 * (len(target.model.layers) - layers):
        raise ValueError(f"{type(target).__name__}: expected an o_proj and a down_proj per layer")
    return found


@torch.inference_mode()
def calibrate(target, draft, layers: int, goal: float, ids: torch.Tensor, steps: int = 14) -> dict:
    """Scale the target's later layers' outputs by the largest factor in [1e-4, 1] (bisection on
    its logarithm) at which the draft's greedy token equals the target's at `goal` of the
    positions of `ids` (rows of random text, teacher-forced). At scale 0 the target would be the
    draft; agreement falls as the later layers' share grows."""
    want = draft(input_ids=ids).logits.argmax(-1)
    weights, current = later_outputs(target, layers), [1.0]

    def agreement(scale: float) -> float:
        for w in weights:
            w.mul_(scale / current[0])
        current[0] = scale
        return (target(input_ids=ids).logits.argmax(-1) == want).float().mean().item()

    found = agreement(1.0)
    if found < goal:
        low, high = math.log(1e-4), 0.0
        for _ in range(steps):
            mid = (low + high) / 2
            low, high = (mid, high) if agreement(math.exp(mid)) >= goal else (low, mid)
        found = agreement(math.exp(low))
    return {"scale": current[0], "agreement": round(found, 4), "goal": goal,
            "positions": ids.numel()}


def build_pair(shape_name: str, device: str, dtype: str, seed: int, goal: float) -> tuple[ModelPair, dict]:
    """The calibrated pair in memory, as the engine takes it (ModelPair), and what it is."""
    from ..demo.tiny import build_tokenizer
    shape = SHAPES[shape_name]
    tokenizer = build_tokenizer()
    target = random_target(shape, len(tokenizer), tokenizer.eos_token_id, device, dtype, seed)
    draft = first_layers(target, shape["draft_layers"])
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(1, len(tokenizer), (8, 32), generator=gen).to(device)
    calibration = calibrate(target, draft, shape["draft_layers"], goal, ids)
    limits = [n for n in (_max_positions(target), _max_positions(draft)) if n]
    pair = ModelPair(tokenizer, target, draft, _eos_ids(tokenizer, target), min(limits or [4096]))
    params = lambda m: sum(p.numel() for p in m.parameters())   # noqa: E731
    info = {"shape": shape_name, "arch": type(target).__name__, "dtype": dtype,
            "target_layers": len(target.model.layers), "draft_layers": shape["draft_layers"],
            "hidden_size": target.config.hidden_size, "vocab_size": target.config.vocab_size,
            "target_params": params(target), "draft_params": params(draft),
            "calibration": calibration}
    return pair, info


class PairModels(HFModels):
    """HFModels (the Hugging Face baseline and the reference) on a pair already in memory."""

    def __init__(self, pair: ModelPair, dtype: str, device: str):
        self.dtype, self.device = dtype, device
        self.tokenizer, self.target, self.draft = pair.tokenizer, pair.target, pair.draft
        self.eos_ids = pair.eos_ids
        self.pad_id = pad_id_of(self.tokenizer, self.eos_ids)
        self.max_model_len = pair.max_model_len


def random_prompts(count: int, vocab: int, seed: int, lengths: tuple[int, int] = PROMPT_LENGTHS) -> list[Prompt]:
    """Seeded random token ids of varied lengths (ragged rows), within the tokenizer's tokens."""
    rng = random.Random(seed)
    return [Prompt(i, "random", "", ids=[rng.randrange(1, vocab) for _ in range(rng.randint(*lengths))])
            for i in range(count)]


# -- the report --------------------------------------------------------------------------------------
class Report:
    """report.json and report.md in `out`, written again whenever a phase starts or ends."""

    def __init__(self, out: Path, header: dict, phases):
        self.out, self.began = out, time.perf_counter()
        self.data = {"schema": 1, "status": "running", **header, "wall_s": 0.0,
                     "phases": {name: {"status": "pending"} for name in phases}}

    def write(self) -> None:
        self.data["wall_s"] = round(time.perf_counter() - self.began, 1)
        for name, text in (("report.json", json.dumps(self.data, indent=2, default=str)),
                           ("report.md", markdown(self.data))):
            part = self.out / f".{name}.part"   # whole or not at all, even if killed mid-write
            part.write_text(text)
            os.replace(part, self.out / name)

    @contextmanager
    def phase(self, name: str):
        """The phase's entry, to fill in; "passed" unless it says otherwise or raises. An
        exception fails the phase and the run goes on; Killed is recorded, then ends the run."""
        entry = self.data["phases"][name] = {"status": "running"}
        self.write()
        start = time.perf_counter()
        try:
            yield entry
            if entry["status"] == "running":
                entry["status"] = "passed"
        except Exception as exc:
            entry.update(status="failed", error=f"{type(exc).__name__}: {exc}",
                         traceback=traceback.format_exc(limit=-6))
        except Killed as exc:
            entry.update(status="failed", error=f"killed ({exc}) after "
                         f"{time.perf_counter() - start:.1f} s of this phase")
            raise
        finally:
            entry["seconds"] = round(time.perf_counter() - start, 2)
            self.write()

    def finish(self, killed: bool = False) -> int:
        statuses = [p["status"] for p in self.data["phases"].values()]
        failed = killed or "failed" in statuses
        self.data["status"] = "killed" if killed else "failed" if failed else "passed"
        self.write()
        return 1 if failed else 0


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value).replace("|", "\\|")


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(_cell(v) for v in row) + " |" for row in rows), ""]


def markdown(data: dict) -> str:
    """report.md: the verdict, the machine, each phase's line, then what each measured."""
    machine = data.get("machine", {})
    lines = [f"# gpu-check: {data['status']}", "",
             f"{machine.get('device_name')} ({machine.get('device')}), torch {machine.get('torch')}"
             f" (CUDA {machine.get('cuda')}), transformers {machine.get('transformers')}, "
             f"python {machine.get('python')}; {data['wall_s']} s in all.", "",
             f"`{data.get('command', '')}`", ""]
    phases = data["phases"]
    lines += _table(["phase", "status", "seconds", "summary"],
                    [[name, p["status"], p.get("seconds"), p.get("summary") or p.get("error")]
                     for name, p in phases.items()])
    tests = phases.get("gpu_tests", {})
    if tests.get("counts"):
        counts = ", ".join(f"{n} {kind}" for kind, n in tests["counts"].items())
        lines += ["## GPU tests", "", f"`{tests.get('command')}` (budget {tests.get('budget_s')} s, "
                  f"log {tests.get('log')}): {counts}", ""]
        lines += [f"- {line}" for line in tests.get("failures", []) + tests.get("skip_reasons", [])] + [""]
    ready = phases.get("ready", {})
    if ready.get("pair"):
        pair = ready["pair"]
        cal = pair["calibration"]
        lines += ["## Pair and READY", "",
                  f"{pair['arch']} {pair['shape']}, {pair['dtype']}: target {pair['target_layers']} layers "
                  f"({pair['target_params'] / 1e6:,.1f} M parameters), draft its first "
                  f"{pair['draft_layers']} ({pair['draft_params'] / 1e6:,.1f} M, the target's own); "
                  f"later layers' outputs scaled by {cal['scale']:.3g}: "
                  f"draft agrees with target at {cal['agreement']:.0%} of {cal['positions']} positions "
                  f"(goal {cal['goal']:.0%}); built in {ready.get('pair_build_s')} s.", ""]
        lines += _table(["engine", "batch", "READY s", "graphs compiled", "CUDA graphs", "warm-up"],
                        [[e["method"], e["batch_size"], e["ready_s"], e["graphs"],
                          (e["cuda_graphs"] or {}).get("recorded"), e["warm_up"]]
                         for e in ready.get("engines", [])])
    timed = phases.get("interleaved", {})
    if timed.get("cells"):
        lines += ["## Interleaved (tokens/s, median of repeats)", "",
                  f"{timed['repeats_done']} repeats of {timed['num_prompts']} prompts x "
                  f"{timed['max_tokens']} tokens; reference: {timed['reference']}.", ""]
        lines += _table(["batch", "cell", "tokens/s", "runs", "exact share", "mismatches (not near ties)",
                         "acceptance"],
                        [[c["batch_size"], c["method"], c["tokens_per_s"], len(c["tokens_per_s_runs"]),
                          c["exact_match_share"], f"{c['mismatches']} ({c['not_near_tie']})",
                          c.get("acceptance_rate")] for c in timed["cells"]])
        lines += [f"- batch {b}: exspec {s['exspec_vs_autoregressive']:.2f}x target-only, target-only "
                  f"{s['autoregressive_vs_hf_generate']:.2f}x HF generate; outputs "
                  f"{'equal across the three' if s['equal_across_methods'] else 'differ across methods'}"
                  for b, s in timed.get("per_batch", {}).items()] + [""]
        lines += [f"- mismatch: {m}" for m in timed.get("mismatch_examples", [])] + [""]
    diag = phases.get("step_diagnostics", {})
    for name, d in diag.get("engines", {}).items():
        lines += [f"## Steps: {name} (batch {d['batch_size']})", "",
                  f"{d['profiled_steps']} steps profiled; syncs per step: "
                  f"{_cell(d.get('syncs_per_step'))} ({d.get('sync_note', '')})", ""]
        lines += [f"- sync at {site}: {n}" for site, n in d.get("sync_sites", {}).items()] + [""]
        lines += _table(["op / kernel", "self ms", "calls"],
                        [[op["name"], op["self_ms"], op["calls"]] for op in d.get("top_ops", [])])
    after = diag.get("after_ready")
    if after:
        lines += ["## Since READY (must be 0)", "",
                  f"- graphs compiled: {after['graphs']}, graph breaks: {after['graph_breaks']}, "
                  f"CUDA graphs captured: {_cell(after['cuda_graphs'])}",
                  f"- forwards run eagerly, a shape the warm-up did not build (only a proposer's "
                  f"catch-up wider than k + 1 may): {_cell(after.get('eager_forwards'))}",
                  *(f"- {shape}" for shape in after["new_shapes"]), ""]
    return "\n".join(lines) + "\n"


# -- the phases --------------------------------------------------------------------------------------
class Check:
    """The run's state, shared by its phases."""

    def __init__(self, args):
        self.args = args
        self.cuda = args.device.startswith("cuda")
        self.began = time.perf_counter()
        self.pair = self.hf = None
        self.engines: dict[tuple[str, int], EngineMethod] = {}
        self.prompts: list[Prompt] = []
        self.at_ready: dict | None = None
        self.new_shapes: list[str] = []
        self.write = lambda: None   # the report's, once there is one: a phase saves what it has

    def left(self) -> float:
        return self.args.budget - (time.perf_counter() - self.began)

    def counts(self) -> dict:
        out = dict(compiled.dynamo_counts())
        out["cuda_graphs"] = compiled.cuda_graph_counts()["recorded"] if self.cuda else None
        # forwards of a shape the static-shape warm-up did not build, run eagerly (CUDA graphs)
        forwards = {id(f): f for m in self.engines.values() for f in m.engine.runner.decode_forwards.values()}
        out["eager_forwards"] = sum(f.eager_forwards for f in forwards.values())
        return out


def pytest_counts(text: str) -> dict[str, int]:
    """pytest's closing line ("3 passed, 2 skipped in 12.3s") as {"passed": 3, "skipped": 2}."""
    lines = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    found = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)",
                       lines[-1] if lines else "")
    return {kind: int(n) for n, kind in found}


def gpu_tests(check: Check, entry: dict) -> None:
    args = check.args
    if not check.cuda or args.smoke or args.skip_tests:
        why = "no CUDA" if not check.cuda else "--smoke" if args.smoke else "--skip-tests"
        entry.update(status="skipped", summary=f"skipped: {why}")
        return
    if not (REPO / "tests").is_dir():
        entry.update(status="skipped", summary=f"skipped: no tests/ in {REPO} (an installed copy)")
        return
    budget = round(min(args.test_budget, check.left() - args.reserve), 1)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs", "tests"]
    log = args.out / "gpu_tests.log"
    entry.update(command=shlex.join(command[1:]), budget_s=budget, log=str(log))
    if budget < 10:
        raise RuntimeError(f"no time left for the GPU tests ({budget} s)")
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            stop(proc)
    text = log.read_text(errors="replace")
    entry.update(returncode=rc, counts=pytest_counts(text),
                 failures=[ln for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR"))][:20],
                 skip_reasons=[ln for ln in text.splitlines() if ln.startswith("SKIPPED")][:20])
    ran = ", ".join(f"{n} {kind}" for kind, n in entry["counts"].items()) or "nothing counted"
    if rc is None:
        entry.update(status="failed", summary=f"timed out after {budget} s ({ran})")
    elif rc != 0 or not entry["counts"].get("passed"):
        entry.update(status="failed", summary=f"pytest exit {rc} ({ran})")
    else:
        entry["summary"] = ran


def stop(proc: subprocess.Popen) -> None:
    """The subprocess's whole group, terminated (then killed) if it still runs."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


@contextmanager
def kv_room(check: Check):
    """On CUDA, an engine sizes its KV pool at 90% of the memory free to it: several engines in
    one process would each take most of what the last one left. A per-process cap (which
    llm_engine._free_memory honours) while one is built gives each --kv-room-gib."""
    if not check.cuda:
        yield
        return
    device = torch.device(check.args.device)
    total = torch.cuda.get_device_properties(device).total_memory
    before = torch.cuda.get_per_process_memory_fraction(device)
    room = check.args.kv_room_gib * 2**30
    cap = min(1.0, (torch.cuda.memory_reserved(device) + room) / total)
    torch.cuda.set_per_process_memory_fraction(cap, device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(before, device)


def ready(check: Check, entry: dict) -> None:
    args = check.args
    start = time.perf_counter()
    check.pair, entry["pair"] = build_pair(args.shape, args.device, args.dtype, args.seed, args.agreement)
    entry["pair_build_s"] = round(time.perf_counter() - start, 2)
    check.hf = PairModels(check.pair, args.dtype, args.device)
    check.prompts = random_prompts(args.num_prompts, len(check.pair.tokenizer), args.seed)
    engine_args = SimpleNamespace(
        target=f"in memory: {args.shape} target", draft=f"in memory: {args.shape} draft", eagle3=None,
        tokenizer=None, device=args.device, dtype=args.dtype, threads=args.threads, draft_stop=None,
        temperature=0.0, top_p=1.0, seed=args.seed, model_pair=check.pair, history=(),
        in_place_kv_tokens=in_place_kv_tokens(args))
    entry["engines"] = []
    for batch in args.batch_sizes:
        for method in ("exspec", "autoregressive"):   # exspec first: its READY is a server's
            speculative = method == "exspec"
            key = CellKey(method, batch, args.k if speculative else 0, False if speculative else None,
                          None, args.path if speculative else "compiled")
            start = time.perf_counter()
            with kv_room(check):
                check.engines[method, batch] = built = EngineMethod(key, engine_args, len(check.prompts))
            warm = built.warm_up
            entry["engines"].append({
                "method": method, "batch_size": batch, "k": key.k,
                "ready_s": round(time.perf_counter() - start, 2), "graphs": warm.graphs,
                "graph_breaks": warm.graph_breaks, "cuda_graphs": warm.cuda_graphs,
                "inductor": warm.inductor, "warm_up": warm.describe(),
                "kv_tokens": built.engine.config.max_num_kv_tokens})
            check.write()
    check.at_ready = check.counts()
    entry["counts_at_ready"] = check.at_ready
    first = {e["method"]: e["ready_s"] for e in reversed(entry["engines"])}
    entry["summary"] = (f"READY exspec {first['exspec']} s, target-only {first['autoregressive']} s "
                        f"(batch {args.batch_sizes[0]}); draft agrees at "
                        f"{entry['pair']['calibration']['agreement']:.0%}")


def in_place_kv_tokens(args) -> int | None:
    """The KV budget of an engine reading its store in place (--path in_place): on CUDA None
    (the engine sizes its stores from the memory kv_room leaves it); on a CPU, where a fixed
    store needs a number, room for every prompt at once in both models."""
    if args.device.startswith("cuda"):
        return None
    return methods.in_place_kv_tokens(args.num_prompts, PROMPT_LENGTHS[1], args.max_tokens, args.k)


def interleaved(check: Check, entry: dict) -> None:
    args = check.args
    if not check.engines:
        raise RuntimeError("no engines: phase ready did not build them")
    start = time.perf_counter()
    reference = Reference(check.hf, check.prompts, args.max_tokens, progress=False)
    entry.update(reference="target-only greedy Hugging Face generate at batch size 1",
                 reference_s=round(time.perf_counter() - start, 2), num_prompts=len(check.prompts),
                 max_tokens=args.max_tokens, repeats_asked=args.repeats)
    runs: dict[CellKey, list] = {}
    done = []
    for i, batch in enumerate(args.batch_sizes):
        hf_key = CellKey("hf_generate", batch, 0, None)
        cells = {hf_key: HFGenerateMethod(hf_key, check.hf)}
        cells.update({check.engines[m, batch].key: check.engines[m, batch]
                      for m in ("autoregressive", "exspec")})
        began = time.perf_counter()   # one untimed run first (bench: warmed_up_method)
        run_interleaved(list(cells.values()), check.prompts, args.max_tokens, args.device, seed=-1)
        spent = time.perf_counter() - began   # a repeat's time, about
        for r in range(args.repeats):
            # each later batch size needs its untimed run and one repeat, about this one's
            keep = args.reserve_diagnostics + 2 * spent * (len(args.batch_sizes) - 1 - i)
            if r and check.left() - keep < spent:
                entry["cut_short"] = f"batch {batch}: {r} of {args.repeats} repeats (the budget)"
                break
            began = time.perf_counter()
            timed = run_interleaved(list(cells.values()), check.prompts, args.max_tokens, args.device, seed=r)
            spent = time.perf_counter() - began
            for key, run in zip(cells, timed):
                runs.setdefault(key, []).append(run)
        done.append(len(runs[hf_key]))
        check.write()
    entry["repeats_done"] = min(done)
    entry.update(compare(reference, runs, args.batch_sizes))
    entry["counts_since_ready"] = diff(check.counts(), check.at_ready)
    bad = [c for c in entry["cells"] if c["not_near_tie"]]
    summary = "; ".join(f"B={b}: exspec {s['exspec_vs_autoregressive']:.2f}x target-only"
                        for b, s in entry["per_batch"].items())
    if bad:
        entry.update(status="failed", summary=f"{summary}; outputs differ beyond near ties in "
                     + ", ".join(f"{c['method']} B={c['batch_size']}" for c in bad))
    else:
        equal = all(s["equal_across_methods"] for s in entry["per_batch"].values())
        entry["summary"] = f"{summary}; outputs {'equal' if equal else 'equal but for near ties'}"


def compare(reference: Reference, runs: dict, batch_sizes: list[int]) -> dict:
    """Each cell's speed and its outputs against the reference (every divergence, and whether
    the reference's top-2 logits are a near tie there), and per batch size the speed-ups and
    whether the three methods' outputs are equal to each other."""
    cells, examples = [], []
    for key, key_runs in runs.items():
        exact, _, divergences = reference.compare(key, key_runs)
        tps = [run.tokens / run.seconds for run in key_runs]
        cell = {"method": key.method, "batch_size": key.batch_size, "k": key.k,
                "tokens_per_s": statistics.median(tps), "tokens_per_s_runs": tps,
                "exact_match_share": exact, "mismatches": len(divergences),
                "not_near_tie": sum(not d["float_tie"] for d in divergences)}
        if key_runs[0].stats is not None and sum(r.stats.get("draft_tokens", 0) for r in key_runs):
            cell["acceptance_rate"] = (sum(r.stats["accepted_tokens"] for r in key_runs)
                                       / sum(r.stats["draft_tokens"] for r in key_runs))
        cells.append(cell)
        examples += [{k: d[k] for k in ("method", "batch_size", "run", "question_id", "position",
                                        "reference_token", "got_token", "top2_gap", "float_tie")}
                     for d in divergences[:3]]
    per_batch = {}
    for batch in batch_sizes:
        by = {key.method: key_runs for key, key_runs in runs.items() if key.batch_size == batch}
        if not by:
            continue
        speed = {m: next(c["tokens_per_s"] for c in cells if c["method"] == m and c["batch_size"] == batch)
                 for m in by}
        first = by["hf_generate"]
        per_batch[batch] = {
            "exspec_vs_autoregressive": speed["exspec"] / speed["autoregressive"],
            "autoregressive_vs_hf_generate": speed["autoregressive"] / speed["hf_generate"],
            "equal_across_methods": all(run.outputs == first[i].outputs
                                        for key_runs in by.values() for i, run in enumerate(key_runs))}
    return {"cells": cells, "per_batch": per_batch, "mismatch_examples": examples[:10]}


def diff(now: dict, then: dict) -> dict:
    return {k: None if now[k] is None else now[k] - then[k] for k in now}


def step_diagnostics(check: Check, entry: dict) -> None:
    args = check.args
    if not check.engines:
        raise RuntimeError("no engines: phase ready did not build them")
    batch = max(args.batch_sizes)
    entry["engines"] = {}
    for method in ("autoregressive", "exspec"):
        entry["engines"][method] = engine_steps(check, check.engines[method, batch].engine, method, batch)
        check.write()
    after = diff(check.counts(), check.at_ready)
    after["new_shapes"] = check.new_shapes[:20]
    entry["after_ready"] = after
    # a proposer's catch-up wider than k + 1 runs eagerly by design: reported, not a failure
    late = {k: n for k, n in after.items() if k not in ("new_shapes", "eager_forwards") and n}
    syncs = ("; ".join(f"{m} {_cell(d['syncs_per_step'])} syncs/step" for m, d in entry["engines"].items())
             if check.cuda else "syncs per step: CUDA only")
    if late:
        entry.update(status="failed", summary=f"after READY: {late} (must be 0); {syncs}")
    else:
        entry["summary"] = f"nothing compiled or captured after READY; {syncs}"


def engine_steps(check: Check, engine, method: str, batch: int) -> dict:
    """A few of the engine's decode steps (its prompts admitted and prefilled first), under the
    profiler, then (CUDA) under sync debug mode "warn"; the requests aborted after."""
    args = check.args
    ids = [f"diagnostics-{method}-{i}" for i in range(len(check.prompts))]
    # long enough for every step here (at most k + 1 tokens each): no row leaves mid-way (fewer
    # rows would be another shape than the timed runs' full batch)
    needed = (args.k + 1) * (2 * args.profile_steps + 2)
    params = SamplingParams(max_tokens=max(args.max_tokens, needed), ignore_eos=True)
    for rid, prompt in zip(ids, check.prompts):
        engine.add_request(rid, prompt.ids, params)
    steps = lambda: engine.stats()["steps"]   # noqa: E731
    first = steps()
    for _ in range(50):   # admission and prefill, then one step
        engine.step()
        if steps() > first:
            break
    else:
        raise RuntimeError(f"{method}: no step in 50 ticks after admitting {len(ids)} requests")
    out = {"batch_size": batch}
    cuda = check.cuda
    kinds = torch.profiler.ProfilerActivity
    activities = [kinds.CPU, kinds.CUDA] if cuda else [kinds.CPU]
    before = steps()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    out["profiled_steps"] = steps() - before
    field = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, field), reverse=True)
    out["top_ops_by"] = "self device time" if cuda else "self CPU time"
    out["top_ops"] = [{"name": e.key[:120], "self_ms": round(getattr(e, field) / 1000, 3), "calls": e.count}
                      for e in events[:TOP_OPS]]
    if cuda:
        before = steps()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(args.profile_steps):
                    engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if SYNC_WARNING in str(w.message)]
        done = steps() - before
        sites: dict[str, int] = {}
        for w in syncs:
            site = f"{Path(w.filename).name}:{w.lineno}"
            sites[site] = sites.get(site, 0) + 1
        out.update(sync_steps=done, syncs=len(syncs), syncs_per_step=len(syncs) / done if done else None,
                   sync_sites=dict(sorted(sites.items(), key=lambda kv: -kv[1])[:10]),
                   sync_note="sync debug mode \"warn\"; the step's own device-to-host copy is one")
    else:
        out.update(syncs_per_step=None, sync_note="CUDA only")
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return out


PHASES = {"gpu_tests": gpu_tests, "ready": ready, "interleaved": interleaved,
          "step_diagnostics": step_diagnostics}


# -- the command -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m exspec.bench.gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the reports' folder (made if absent)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda where there is one; "
                    "--smoke: cpu)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes (exspec.demo.tiny's Llama, float32), a few tokens, Dynamo's "
                         "eager backend, one torch thread: the same script in seconds (make test)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: 8b (--smoke: tiny)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="default: bfloat16 on CUDA, float32 on a CPU")
    ap.add_argument("--agreement", type=float, default=0.75,
                    help="the share of positions where the draft's greedy token is the target's")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=None, help="default: 32 (--smoke: 8)")
    ap.add_argument("-k", type=int, default=4, help="exspec's fixed k")
    ap.add_argument("--path", choices=("compiled", "in_place"), default="compiled",
                    help="exspec's decode path: compiled (each row's KV blocks gathered), or "
                         "in_place (attention_backend FLEX_ATTENTION: the block store read in "
                         "place, a graph per verification width); target-only stays compiled")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3; --smoke: 2)")
    ap.add_argument("--profile-steps", type=int, default=3, help="engine steps profiled (and sync-counted)")
    ap.add_argument("--budget", type=float, default=285,
                    help="seconds the phases plan within (the Makefile's `timeout 300` is the hard stop)")
    ap.add_argument("--test-budget", type=float, default=120, help="seconds for the GPU tests at most")
    ap.add_argument("--reserve", type=float, default=120,
                    help="seconds the GPU tests leave to the phases after them")
    ap.add_argument("--reserve-diagnostics", type=float, default=20,
                    help="seconds the interleaved repeats leave to the step diagnostics")
    ap.add_argument("--skip-tests", action="store_true", help="leave out the GPU tests (phase 1)")
    ap.add_argument("--kv-room-gib", type=float, default=6.0,
                    help="CUDA: GPU memory each engine's KV pool and warm-up may take")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend (default: inductor; --smoke: eager)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (--smoke: 1)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cuda_here = torch.cuda.is_available()
    args.device = args.device or ("cpu" if args.smoke or not cuda_here else "cuda")
    if args.device.startswith("cuda") and not cuda_here:
        ap.error(f"--device {args.device}: this machine has no CUDA GPU")
    args.shape = args.shape or ("tiny" if args.smoke else "8b")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.max_tokens = args.max_tokens or (8 if args.smoke else 32)
    args.repeats = args.repeats or (2 if args.smoke else 3)
    args.compile_backend = args.compile_backend or ("eager" if args.smoke else "inductor")
    args.threads = args.threads or (1 if args.smoke else None)
    at_least(ap, {"--num-prompts": args.num_prompts, "--max-tokens": args.max_tokens, "-k": args.k,
                  "--repeats": args.repeats, "--profile-steps": args.profile_steps,
                  "--threads": args.threads}, 1)
    if not 0 < args.agreement < 1:
        ap.error(f"--agreement must be in (0, 1), got {args.agreement}")
    args.batch_sizes = int_list(ap, "--batch-sizes", args.batch_sizes, "batch sizes", 1)
    writable(ap, "--out", args.out, folder=True)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from ..utils.threads import apply_threads, choose_threads
    apply_threads(choose_threads(args.threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers
    transformers.logging.set_verbosity_error()
    compiled.COMPILE_BACKEND = args.compile_backend
    from .cli import machine_info
    machine = dict(machine_info(args, None), cuda=torch.version.cuda)
    command = "python -m exspec.bench.gpu_check " + shlex.join(sys.argv[1:] if argv is None else argv)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    check = Check(args)
    report = Report(args.out, {"command": command, "machine": machine, "config": config}, PHASES)
    check.write = report.write
    shapes = _ShapeLog(check)
    previous = {sig: signal.signal(sig, _killed) for sig in (signal.SIGTERM, signal.SIGINT)}
    killed = False
    try:
        for name in PHASES:
            with report.phase(name) as entry:
                PHASES[name](check, entry)
            if name == "ready" and check.at_ready is not None:
                logging.getLogger("exspec").addHandler(shapes)   # shapes met after READY
    except Killed:
        killed = True
    finally:
        logging.getLogger("exspec").removeHandler(shapes)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    rc = report.finish(killed)
    print(f"gpu-check: {report.data['status']}; reports: {args.out / 'report.md'}, "
          f"{args.out / 'report.json'}")
    return rc


def _killed(signum, frame):
    raise Killed(signal.Signals(signum).name)


class _ShapeLog(logging.Handler):
    """compiled.CompiledForward's warnings of a shape met after READY, kept for the report."""

    def __init__(self, check: Check):
        super().__init__(logging.WARNING)
        self.check = check

    def emit(self, record):
        message = record.getMessage()
        if NEW_SHAPE in message:
            self.check.new_shapes.append(message)


if __name__ == "__main__":
    sys.exit(main())
