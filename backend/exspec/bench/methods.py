"""The methods the benchmark times: the engine (autoregressive, eqspec, exspec) and two Hugging
Face baselines on the same pair (`hf_generate`: batched, left-padded, greedy, no draft;
`hf_assisted`: assisted generation, batch size 1). Each does its workload in units of work
(`ticks`: an engine tick, one Hugging Face generate call), and `run_interleaved` times several
methods unit by unit, side by side."""
from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field

import torch

from .. import EngineConfig, LLMEngine, SamplingParams
from ..config import FLEX_ATTENTION
from ..kv.blocks import BlockStores
from ..models.loading import DTYPES, _eos_ids, _max_positions
from ..speculative import METHODS as PROPOSERS

# method -> (EngineConfig.method, EngineConfig.proposer): the *_ngram methods propose by prompt
# lookup (ngram.py), the *_suffix ones by suffix decoding (suffix.py), neither loads a draft;
# the *_eagle3 ones draft with an EAGLE-3 head (--eagle3); the *_eagle3_suffix and
# *_draft_model_suffix ones choose per row and step between suffix decoding and the head or the
# draft (hybrid.py). What each loads: `model_of`
ENGINE_METHODS = {"autoregressive": ("autoregressive", "draft_model"),
                  "eqspec": ("eqspec", "draft_model"), "exspec": ("exspec", "draft_model"),
                  "eqspec_eagle3": ("eqspec", "eagle3"), "exspec_eagle3": ("exspec", "eagle3"),
                  "eqspec_ngram": ("eqspec", "ngram"), "exspec_ngram": ("exspec", "ngram"),
                  "eqspec_suffix": ("eqspec", "suffix"), "exspec_suffix": ("exspec", "suffix"),
                  "eqspec_eagle3_suffix": ("eqspec", "eagle3_suffix"),
                  "exspec_eagle3_suffix": ("exspec", "eagle3_suffix"),
                  "eqspec_draft_model_suffix": ("eqspec", "draft_model_suffix"),
                  "exspec_draft_model_suffix": ("exspec", "draft_model_suffix")}
# the speculative ones, in the order the report lists them
SPECULATIVE_METHODS = tuple(m for m in ENGINE_METHODS if m != "autoregressive")
HF_METHODS = ("hf_generate", "hf_assisted")
METHODS = tuple(ENGINE_METHODS) + HF_METHODS
# what a method's model is given by: its flag, and what it names
MODEL_FLAGS = {"draft": ("--draft", "a draft model"), "head": ("--eagle3", "an EAGLE-3 head's folder")}
# the engine's decode paths (--paths), as a cell's label names them: Hugging Face's forward,
# the compiled one, and the compiled one reading EXSPEC's block store in place
# (attention_backend FLEX_ATTENTION: exspec methods only)
PATHS = {"eager": "", "compiled": "compiled", "in_place": "compiled, KV read in place"}


def reads_in_place(method: str) -> bool:
    """Whether `method` can run on the in_place path (its layout is EXSPEC's block store)."""
    return ENGINE_METHODS.get(method, ("",))[0] == "exspec"


def model_of(method: str) -> str | None:
    """What a method loads beside the target, as its proposer declares it (speculative.METHODS):
    "head" (an EAGLE-3 head on the target: --eagle3), "draft" (a draft LLM: --draft) or None
    (autoregressive, hf_generate, the lookup proposers)."""
    if method == "hf_assisted":
        return "draft"
    layout, proposer = ENGINE_METHODS.get(method, ("autoregressive", None))
    if layout == "autoregressive":
        return None
    declared = PROPOSERS.declared(proposer)
    if declared.model is None:
        return None
    return "head" if declared.head else "draft"


def missing_models(methods: list[str], args) -> str | None:
    """One line naming the methods whose model was not given and the flag that gives it (None:
    every one was)."""
    for kind, (flag, what) in MODEL_FLAGS.items():
        lacking = [m for m in methods if model_of(m) == kind]
        if lacking and not getattr(args, flag[2:]):
            return (f"{', '.join(lacking)} {'needs' if len(lacking) == 1 else 'need'} {flag} "
                    f"({what})")
    return None


@dataclass
class Prompt:
    question_id: object
    category: str
    text: str
    ids: list[int] = field(default_factory=list)
    turns: list[str] = field(default_factory=list)   # every user turn (text: the first)


@dataclass(frozen=True)
class CellKey:
    method: str
    batch_size: int
    k: int
    adaptive_k: bool | None   # None: no speculation to adapt
    coupling: str | None = None   # engine cells of a sampled run: gumbel | rejection
    path: str = "eager"           # engine cells: the decode path, one of PATHS

    @property
    def label(self) -> str:
        coupling = "" if self.coupling is None else f", {self.coupling}"
        path = f", {PATHS[self.path]}" if PATHS[self.path] else ""
        if self.adaptive_k is None:
            extra = ", ".join(x for x in (self.coupling, PATHS[self.path]) if x)
            return self.method + (f" ({extra})" if extra else "")
        return f"{self.method} ({'adaptive k' if self.adaptive_k else f'k={self.k}'}{coupling}{path})"


@dataclass
class Run:
    seconds: float
    outputs: list[list[int]]
    stats: dict | None = None   # engine stats difference over the run

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


# -- timing -----------------------------------------------------------------------------------------
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_interleaved(methods: list, prompts: list[Prompt], max_tokens: int, device: str,
                    seed: int = 0) -> list[Run]:
    """Every method's whole workload, one unit of work of each in turn, each unit timed alone; a
    method's seconds are the sum of its units'. This host's speed swings by +-20% within
    seconds, so methods timed one after the other compare different moments (two runs of one
    workload in a row differed by up to 25%); units of tens of milliseconds taken in turn see the
    same moments, and their ratios repeat within 1-2%. Each round of units goes in a new order
    (shuffled, seeded): a unit runs faster right after one that touched the same weights (cells
    of one pair share them), and in a fixed cycle (A B C A B C, rotated or not) the same cell
    always had that neighbour: on the demo pair the cell after its sibling ran 3-6% faster
    whichever of the two it was."""
    for m in methods:
        m.before_run(max_tokens)
    work = [m.ticks(prompts, max_tokens) for m in methods]
    seconds = [0.0] * len(methods)
    results: list = [None] * len(methods)
    live = list(range(len(methods)))
    order = random.Random(seed)
    while live:
        for i in order.sample(live, len(live)):
            start = time.perf_counter()
            try:
                next(work[i])
            except StopIteration as done:
                results[i] = done.value
                live.remove(i)
            sync(device)
            seconds[i] += time.perf_counter() - start
    return [Run(s, outputs, stats) for s, (outputs, stats) in zip(seconds, results)]


class Method:
    """`ticks(prompts, max_tokens)`: a generator doing the workload, yielding between units of
    work and returning (outputs, engine stats or None)."""
    device: str

    def before_run(self, max_tokens: int) -> None:
        """Untimed, before each timed run of the workload."""

    def run(self, prompts: list[Prompt], max_tokens: int) -> Run:
        """The workload alone, timed."""
        return run_interleaved([self], prompts, max_tokens, self.device)[0]


def in_place_kv_tokens(prompts: int, longest_prompt: int, max_tokens: int, k: int) -> int:
    """The KV budget of an engine reading its store in place on a CPU (a store of fixed size):
    room for every prompt at once, at its longest, in both models."""
    return 2 * (prompts + 1) * BlockStores.entries_for(longest_prompt + max_tokens + k + 1)


# -- the methods ---------------------------------------------------------------------------------
class EngineMethod(Method):
    """One LLMEngine (autoregressive, eqspec or exspec) at one batch size, reused across runs.
    Sampled runs give prompt i the seed args.seed + i, so every run asks for the same samples."""

    def __init__(self, key: CellKey, args, num_prompts: int):
        self.key = key
        self.device = args.device
        method, proposer = ENGINE_METHODS[key.method]
        # a fixed k = 0 runs the method's layout without speculation: no draft to load
        loads = model_of(key.method) if key.adaptive_k or key.k > 0 else None
        drafted, head = loads == "draft", loads == "head"
        # read in place: stores of a fixed size (cli.py sizes them for the run's prompts)
        in_place = (dict(attention_backend=FLEX_ATTENTION, max_num_kv_tokens=args.in_place_kv_tokens)
                    if key.path == "in_place" else {})
        self.engine = LLMEngine(EngineConfig(
            target_model=args.target,
            draft_model=args.draft if drafted else args.eagle3 if head else None,
            tokenizer=args.tokenizer, method=method, proposer=proposer,
            num_speculative_tokens=key.k, adaptive_k=bool(key.adaptive_k),
            max_batch_size=key.batch_size, max_num_seqs=max(key.batch_size, num_prompts),
            device=args.device, dtype=args.dtype, torch_threads=args.threads,
            sampling_coupling=key.coupling or "gumbel", enforce_eager=key.path == "eager",
            draft_stop_confidence=args.draft_stop, **in_place),
            pair=self.shared_pair(args, drafted))
        self.warm_up = self.engine.warm_up   # compiled path: graphs and seconds
        self.sampling = dict(temperature=args.temperature, top_p=args.top_p)
        self.seed = args.seed
        # prompts served before each timed run, untimed (--warm-prompts): a server's past
        self.history = [p.ids for p in getattr(args, "history", ())]

    @staticmethod
    def shared_pair(args, drafted: bool):
        """The run's one loaded pair (None: load one), without its draft where none drafts."""
        pair = getattr(args, "model_pair", None)
        if pair is None or drafted:
            return pair
        return dataclasses.replace(pair, draft=None)

    def params(self, count: int, max_tokens: int) -> list[SamplingParams]:
        return [SamplingParams(max_tokens=max_tokens, seed=self.seed + i, **self.sampling)
                for i in range(count)]

    def before_run(self, max_tokens: int) -> None:
        # a run learns only from its own earlier requests (suffix decoding's global tree) and
        # the history (--warm-prompts), not from the same prompts' answers in the run before
        self.engine.proposer.forget()
        if self.history and self.engine.proposer.learns_across_requests:
            self.engine.generate(self.history, self.params(len(self.history), max_tokens))

    def ticks(self, prompts: list[Prompt], max_tokens: int):
        before = self.engine.stats()
        params = self.params(len(prompts), max_tokens)
        outs = yield from self.engine.generate_ticks([p.ids for p in prompts], params)
        failed = [o.error for o in outs if o.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"{self.key.label} at batch {self.key.batch_size}: {failed[0]}")
        return [list(o.token_ids) for o in outs], stats_delta(before, self.engine.stats())


def stats_delta(before: dict, after: dict) -> dict:
    """The counters and phase times one run added, and its steps by (rows, k)."""
    keys = [k for k, v in after.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
            and k not in ("acceptance_rate", "mean_accepted_length", "realign_share",
                          "pool_seqs", "pool_kv_tokens", "pool_kv_tokens_allocated",
                          "pool_kv_tokens_reserved", "queue_len")]
    out = {k: after[k] - (before.get(k) or 0) for k in keys}
    shapes = {(s["rows"], s["k"]): s["steps"] for s in after["steps_by_shape"]}
    for s in before["steps_by_shape"]:
        shapes[s["rows"], s["k"]] -= s["steps"]
    out["steps_by_shape"] = {shape: n for shape, n in shapes.items() if n}
    depths = {d["depth"]: [d["verified"], d["kept"]] for d in after.get("drafts_by_depth", [])}
    for d in before.get("drafts_by_depth", []):
        depths[d["depth"]][0] -= d["verified"]
        depths[d["depth"]][1] -= d["kept"]
    out["drafts_by_depth"] = {d: vk for d, vk in depths.items() if vk[0]}
    return out


def pad_id_of(tokenizer, eos_ids: list[int]) -> int:
    """The id that left-pads a Hugging Face generate batch: the tokenizer's pad, else an EOS."""
    pad = tokenizer.pad_token_id
    return pad if pad is not None else min(eos_ids, default=0)


class HFModels:
    """The pair loaded once with plain transformers: reference, baselines and cost model."""

    def __init__(self, args):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        dtype = DTYPES[args.dtype]
        self.dtype = args.dtype
        self.device = args.device
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        self.target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(args.device).eval()
        self.draft = None
        if args.draft:
            self.draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=dtype).to(args.device).eval()
        self.eos_ids = _eos_ids(self.tokenizer, self.target)
        self.pad_id = pad_id_of(self.tokenizer, self.eos_ids)
        limits = [_max_positions(m) for m in (self.target, self.draft) if m is not None]
        self.max_model_len = min([n for n in limits if n] or [4096])

    def trim(self, new_ids: list[int]) -> list[int]:
        """Generated ids up to and including the first EOS (what the engine returns)."""
        for i, t in enumerate(new_ids):
            if t in self.eos_ids:
                return new_ids[:i + 1]
        return new_ids

    @torch.inference_mode()
    def generate(self, batch: list[list[int]], max_tokens: int, **kwargs) -> list[list[int]]:
        """Greedy generate on a left-padded batch; each row's ids up to its first EOS."""
        width = max(len(ids) for ids in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        out = self.target.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                   max_new_tokens=max_tokens, do_sample=False,
                                   pad_token_id=self.pad_id, **kwargs)
        return [self.trim(row[width:]) for row in out.tolist()]

    @torch.inference_mode()
    def top_two(self, prompt: list[int], prefix: list[int]) -> tuple[float, float, float]:
        """The reference's (top logit, second logit, logit range) at the next token after
        prompt + prefix, in float32, from logits in the target's own dtype."""
        ids = torch.tensor([prompt + prefix], device=self.device)
        logits = self.target(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
        top = logits.topk(2).values
        return float(top[0]), float(top[1]), float(logits.max() - logits.min())


class HFGenerateMethod(Method):
    """Plain batched Hugging Face generate: chunks of batch_size prompts, left-padded."""

    def __init__(self, key: CellKey, hf: HFModels):
        self.key, self.hf, self.device = key, hf, hf.device

    def ticks(self, prompts: list[Prompt], max_tokens: int):
        b = self.key.batch_size
        outputs = []
        for i in range(0, len(prompts), b):
            outputs += self.hf.generate([p.ids for p in prompts[i:i + b]], max_tokens)
            yield
        return outputs, None


class HFAssistedMethod(Method):
    """Hugging Face assisted generation (batch size 1): k drafts per round, either constant
    (adaptive_k off) or HF's own adaptation (heuristic schedule plus the assistant's
    confidence threshold; adaptive_k on)."""

    def __init__(self, key: CellKey, hf: HFModels):
        self.key, self.hf, self.device = key, hf, hf.device

    def _configure(self) -> None:
        cfg = self.hf.draft.generation_config
        cfg.num_assistant_tokens = self.key.k
        if self.key.adaptive_k:
            cfg.num_assistant_tokens_schedule = "heuristic_transient"
            cfg.assistant_confidence_threshold = 0.4
        else:
            cfg.num_assistant_tokens_schedule = "constant"
            cfg.assistant_confidence_threshold = 0.0

    def ticks(self, prompts: list[Prompt], max_tokens: int):
        outputs = []
        for p in prompts:   # configured per prompt: both cells share the one draft model
            self._configure()
            outputs += self.hf.generate([p.ids], max_tokens, assistant_model=self.hf.draft)
            yield
        return outputs, None


def make_method(key: CellKey, args, hf: HFModels, num_prompts: int):
    if key.method in ENGINE_METHODS:
        return EngineMethod(key, args, num_prompts)
    if key.method == "hf_generate":
        return HFGenerateMethod(key, hf)
    return HFAssistedMethod(key, hf)
