"""EngineConfig: every engine knob, validated once. Field names are the model.json keys."""
from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass

from .sampling.sampler import COUPLINGS
from .speculative import DEFAULT_METHOD, SpeculativeConfig
from .speculative import METHODS as SPECULATIVE_METHODS
from .speculative import SPECULATIVE_BOUNDS  # noqa: F401  (its home before speculative.py)
from .utils.faults import Faults
from .vllm_args import translate

log = logging.getLogger("exspec")

METHODS = ("exspec", "eqspec", "autoregressive")
DTYPES = ("float32", "bfloat16", "float16")
FLEX_ATTENTION = "FLEX_ATTENTION"   # vLLM's name for its FlexAttention backend (attention_backend)
DEVICE_MAP_POLICIES = ("auto", "balanced", "balanced_low_0", "sequential")
STREAM_GRANULARITIES = ("token", "step")


PATH_KEYS = ("target_model", "draft_model", "tokenizer")


def resolve_model_paths(values: dict, folder: str | os.PathLike) -> dict:
    """model.json's model paths, resolved against model.json's folder: a value starting with
    "." or "/", or naming something that exists there, is a path; anything else (a hub id) is
    kept as given. vLLM's keys for them (`model`, `speculative_config.model`) resolve alike.
    The Triton model and exspec-openai read model.json through this one rule."""
    out = {key: _resolve_path(value, folder) if key in PATH_KEYS + ("model",) else value
           for key, value in values.items()}
    spec = out.get("speculative_config")
    if isinstance(spec, dict) and "model" in spec:
        out["speculative_config"] = {**spec, "model": _resolve_path(spec["model"], folder)}
    return out


def _resolve_path(value, folder):
    if isinstance(value, str) and (value.startswith((".", os.sep))
                                   or os.path.exists(os.path.join(folder, value))):
        return os.path.normpath(os.path.join(folder, value))
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_bool(value) -> bool:
    return isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_str(value) -> bool:
    return isinstance(value, str)


@dataclass
class EngineConfig:
    target_model: str
    draft_model: str | None = None        # the draft model; with proposer "eagle3", the head's folder
    tokenizer: str | None = None          # default: the target's
    method: str = "exspec"                # exspec | eqspec | autoregressive
    num_speculative_tokens: int = 5       # k; per-request values may lower it
    proposer: str = DEFAULT_METHOD        # where proposals come from (vLLM's speculative_config
                                          # method; spec/registry.py lists them): the draft model,
                                          # "eagle3" (an EAGLE-3 head on the target's hidden
                                          # states, eagle3.py), "ngram" (prompt lookup, ngram.py)
                                          # or "suffix" (suffix decoding, suffix.py): those two
                                          # load no draft model
    prompt_lookup_max: int = 4            # ngram: the longest suffix matched (vLLM's name)
    prompt_lookup_min: int = 2            # ngram: the shortest
    suffix_decoding_max_tree_depth: int = 24          # suffix (vLLM's names and defaults): the
                                          # longest substring indexed, so the longest match
    suffix_decoding_max_cached_requests: int = 10000  # suffix: earlier outputs the global tree
                                          # keeps (oldest evicted; 0: no global tree)
    suffix_decoding_max_cached_tokens: int = 1_000_000  # suffix: their tokens, in all (~200
                                          # bytes each; oldest evicted; not a vLLM key)
    suffix_decoding_max_spec_factor: float = 1.0      # suffix: a match of m tokens proposes at
                                          # most factor x m
    suffix_decoding_min_token_prob: float = 0.1       # suffix: a proposal stops where its path's
                                          # probability falls below this
    adaptive_k: bool = True               # choose k per group from measured acceptance
    draft_stop_confidence: float | str | None = None   # adaptive k: a round of drafts ends at
                                          # a draft token its draft gives less than this; "auto":
                                          # where drafting on does not pay, from measurements
                                          # (draft_stop.py); None or 0: off (docs/engine.md)
    max_batch_size: int = 8               # rows verified in one step
    max_num_seqs: int = 64                # sequences holding KV state in the pool
    max_num_kv_tokens: int | None = None  # KV entries (both models) in the pool; None = no limit on CPU
    gpu_memory_utilization: float | None = None   # vLLM's meaning: the share of the GPU's memory
                                          # this engine may hold (weights, warm-up, KV); sets the
                                          # KV budget on CUDA when max_num_kv_tokens is unset;
                                          # None: 90% of the memory free after loading
    max_num_batched_tokens: int | None = 2048   # tokens one tick feeds the target (prefill chunks +
                                          # the step's verified tokens); None: whole prompts at once
    max_queue_len: int = 256              # waiting requests beyond the pool; more are refused as busy
    max_model_len: int | None = None      # prompt + output; default: the smaller model's limit
    max_prompt_tokens: int | None = None  # default: max_model_len - 1
    max_output_tokens: int = 4096         # largest max_tokens a request may ask for
    max_request_bytes: int = 1 << 20      # the Triton adapter refuses larger requests unparsed
    default_max_tokens: int = 256
    max_skipped_ticks: int | None = None  # fairness bound; default: one round of the pool + 1
    device: str = "cpu"
    device_map: str | dict | None = None  # spread the target over GPUs (Hugging Face device_map)
    dtype: str = "float32"
    trust_remote_code: bool = False
    seed: int = 0                         # seeds the seeds drawn for requests without their own
    sampling_coupling: str = "gumbel"     # gumbel | rejection: how draft and target share randomness
    tick_timeout_s: float | None = None   # the Triton adapter's watchdog: a longer tick is fatal
    torch_threads: int | None = None      # intra/inter-op CPU threads; None: OMP_NUM_THREADS or 1 (threads.py)
    stream_granularity: str = "step"      # the Triton adapter streams one response per engine
                                          # "step" (as vLLM does when it speculates) or per "token"
    enforce_eager: bool = True            # vLLM's meaning: no compiled decode path (compiled.py);
                                          # False compiles the step's forwards before READY
    attention_backend: str | None = None  # vLLM's name: None reads each row's KV blocks gathered
                                          # (SDPA); "FLEX_ATTENTION" reads the block store in
                                          # place in the compiled decode path (kv/in_place.py)
    enable_prefix_caching: bool = True    # vLLM's name: share full KV blocks of common prefixes
                                          # (engine/prefix_caching.py); where the layout can (the block
                                          # store), else off with a line in the load log
    fault_injection: dict | None = None   # tests only: see faults.py; off unless set here

    def __post_init__(self):
        self._check_types()
        if not self.target_model:
            raise ValueError("target_model is required")
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; expected one of {', '.join(METHODS)}")
        declared = SPECULATIVE_METHODS.declared(self.proposer)   # an unknown one: refused
        _ = self.speculative_config   # its keys, bounds and the method's own rule (speculative.py)
        if declared.model is not None and self.speculative and not self.draft_model:
            raise ValueError(self._missing_model(declared))   # k = 0: the layout alone, no drafts
        if self.sampling_coupling not in COUPLINGS:
            raise ValueError(f"unknown sampling_coupling {self.sampling_coupling!r}; expected one of "
                             f"{', '.join(COUPLINGS)} (gumbel: the speculative output equals the "
                             f"target's own seeded output; rejection: equal in distribution only)")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device_map is not None:
            self._check_device_map()
        for name in ("max_batch_size", "max_num_seqs", "max_queue_len", "max_output_tokens",
                     "default_max_tokens", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens is not None:
            step_tokens = self.max_batch_size * (self.num_speculative_tokens + 1)
            if isinstance(self.max_num_batched_tokens, bool) or self.max_num_batched_tokens <= step_tokens:
                raise ValueError(f"max_num_batched_tokens must exceed the tokens of one step "
                                 f"(max_batch_size x (num_speculative_tokens + 1) = {step_tokens}), "
                                 f"so that prefill always progresses; got {self.max_num_batched_tokens!r}")
        if self.max_num_seqs < self.max_batch_size:
            raise ValueError("max_num_seqs must be >= max_batch_size")
        rounds = -(-self.max_num_seqs // self.max_batch_size)   # ticks to step every sequence once
        if self.max_skipped_ticks is None:
            self.max_skipped_ticks = rounds
        if self.method == "exspec" and self.max_skipped_ticks < rounds - 1:
            raise ValueError(f"max_skipped_ticks {self.max_skipped_ticks} cannot be kept: stepping "
                             f"{self.max_num_seqs} sequences {self.max_batch_size} at a time takes "
                             f"{rounds} ticks; raise it to >= {rounds - 1} or lower max_num_seqs")
        Faults(self.fault_injection)   # validates the keys now, at model load
        if self.torch_threads is not None and (isinstance(self.torch_threads, bool) or not
                                               isinstance(self.torch_threads, int) or self.torch_threads < 1):
            raise ValueError(f"torch_threads must be an integer >= 1, got {self.torch_threads!r}")
        if self.stream_granularity not in STREAM_GRANULARITIES:
            raise ValueError(f"stream_granularity must be one of {', '.join(STREAM_GRANULARITIES)}, "
                             f"got {self.stream_granularity!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        self._check_attention_backend()
        if self.draft_stop_confidence not in (None, "auto") and (
                isinstance(self.draft_stop_confidence, bool)
                or not isinstance(self.draft_stop_confidence, (int, float))
                or not 0 <= self.draft_stop_confidence < 1):
            raise ValueError(f"draft_stop_confidence must be \"auto\" or a number in [0, 1), "
                             f"got {self.draft_stop_confidence!r}")
        if self.gpu_memory_utilization is not None and (
                isinstance(self.gpu_memory_utilization, bool)
                or not isinstance(self.gpu_memory_utilization, (int, float))
                or not 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], "
                             f"got {self.gpu_memory_utilization!r}")
        if self.tick_timeout_s is not None and not self.tick_timeout_s > 0:
            raise ValueError(f"tick_timeout_s must be > 0, got {self.tick_timeout_s!r}")

    def _check_attention_backend(self) -> None:
        """FLEX_ATTENTION reads the block store in place inside compiled forwards, from a store
        that never grows (kv/in_place.py): each of those conditions is named when it is not met."""
        if self.attention_backend is None:
            return
        if self.attention_backend != FLEX_ATTENTION:
            raise ValueError(f"attention_backend must be {FLEX_ATTENTION!r} (the block store read in "
                             f"place) or unset (each row's blocks gathered for SDPA), got "
                             f"{self.attention_backend!r}")
        needs = [why for failed, why in (
            (self.method != "exspec", "method exspec (the block store; EQSPEC's layout is realigned, "
                                      "not paged)"),
            (self.enforce_eager, "enforce_eager false (the read in place is compiled)"),
            (self.max_num_kv_tokens is None and self.device == "cpu",
             "max_num_kv_tokens on cpu (a store of fixed size: one that grew would change the "
             "compiled graphs' shapes; on CUDA the budget sets it)"),
            (self.device_map is not None, "no device_map (one device)")) if failed]
        if needs:
            raise ValueError(f"attention_backend {FLEX_ATTENTION!r} needs " + "; ".join(needs))

    def _missing_model(self, declared) -> str:
        """The error of a speculative method without its model: a proposer asked for by name is
        named; the default one (nobody chose it) is offered the methods that need no model."""
        if self.proposer != DEFAULT_METHOD:
            return (f"proposer {self.proposer!r} needs draft_model: {declared.model} "
                    "(vLLM: speculative_config.model)")
        without = [m.name for m in SPECULATIVE_METHODS.declarations() if m.model is None]
        return (f"method {self.method!r} needs a draft_model"
                + (f" (or proposer {' or '.join(map(repr, without))})" if without else ""))

    def _check_types(self) -> None:
        """Each plain field holds its own type (model.json is typed JSON: a 2.0 where an integer
        belongs would load and then fail every request at its first step)."""
        wanted = {"int": (_is_int, "an integer"), "bool": (_is_bool, "true or false"),
                  "float": (_is_number, "a number"), "str": (_is_str, "a string")}
        for f in dataclasses.fields(self):
            kind, _, optional = f.type.partition(" | ")
            value = getattr(self, f.name)
            if kind in wanted and optional in ("", "None") and not (value is None and optional):
                check, what = wanted[kind]
                if not check(value):
                    raise ValueError(f"{f.name} must be {what}, got {value!r}")

    def _check_device_map(self) -> None:
        """A target too big for one GPU: a Hugging Face placement policy, or a map of module
        names to GPUs. The inputs, the draft and the sampling stay on `device`, which must hold
        the target's embeddings (checked at load). Nothing may go to cpu or disk: a layer
        there would make every step wait on host memory."""
        if not self.device.startswith("cuda"):
            raise ValueError(f"device_map spreads the target over GPUs; it needs device "
                             f"'cuda[:N]' (the GPU with the embeddings and the draft), got {self.device!r}")
        if isinstance(self.device_map, str):
            if self.device_map not in DEVICE_MAP_POLICIES:
                raise ValueError(f"device_map must be one of {', '.join(DEVICE_MAP_POLICIES)} or a "
                                 f"map of module names to GPU ids, got {self.device_map!r}")
            return
        if not isinstance(self.device_map, dict) or not self.device_map:
            raise ValueError(f"device_map must be a policy name or a non-empty map of module names "
                             f"to GPU ids, got {self.device_map!r}")
        for module, where in self.device_map.items():
            ok = (isinstance(where, int) and not isinstance(where, bool) and where >= 0) or (
                isinstance(where, str) and re.fullmatch(r"cuda(:\d+)?", where))
            if not ok:
                raise ValueError(f"device_map[{module!r}] must be a GPU id (0, 1, ... or "
                                 f"'cuda:N'), got {where!r}; cpu and disk offload are not supported")

    @classmethod
    def from_dict(cls, values: dict) -> "EngineConfig":
        """Build from model.json-style keys, vLLM's engine arguments included (vllm_args.py);
        unknown keys are an error that names them."""
        values, notes = translate(values)
        for note in notes:
            log.warning("exspec: model.json: %s", note)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown engine config keys: {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        return cls(**values)

    @property
    def draft_stop(self) -> float | str:
        """The draft confidence below which a round of drafts ends: "auto" (draft_stop.py) or a
        number (0: never; fixed k never)."""
        if not self.adaptive_k:
            return 0.0
        if self.draft_stop_confidence == "auto":
            return "auto"
        return float(self.draft_stop_confidence or 0.0)

    @property
    def speculative_config(self) -> SpeculativeConfig:
        """Its speculative keys as vLLM's speculative_config (data only; validated when made)."""
        return SpeculativeConfig(
            method=self.proposer, model=self.draft_model,
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(SpeculativeConfig)
               if f.name not in ("method", "model")})

    @property
    def speculative(self) -> bool:
        return self.method != "autoregressive" and self.num_speculative_tokens > 0
