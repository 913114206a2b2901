"""vLLM's engine arguments in model.json, translated to exspec's (design: "Names other parts rely on").

Triton's vLLM backend hands model.json whole to vLLM's `AsyncEngineArgs`, so its users keep keys
that exspec spells otherwise or has no use for. Each vLLM key gets one of four fates:
- the same name and meaning in EngineConfig: kept (`NATIVE`);
- another spelling of an exspec setting: renamed (`model` -> `target_model`, `speculative_config`);
- no effect on any output here: accepted and reported as ignored (`IGNORED`);
- a value exspec cannot honour (tensor parallelism, quantization, LoRA): refused by name, unless
  it is the neutral value (`NEUTRAL_ONLY`).
Keys that are neither exspec's nor vLLM's stay an error (EngineConfig.from_dict).
"""
from __future__ import annotations

from .speculative import DEFAULT_METHOD, METHODS, SpeculativeConfig

# vLLM keys that change nothing exspec computes: logging, download and loading options, vLLM's
# own memory and scheduling tuning. Accepted, and named in the load log as ignored.
IGNORED = frozenset({
    "disable_log_stats", "disable_log_requests", "enable_log_requests", "served_model_name",
    "download_dir", "load_format", "revision", "code_revision", "tokenizer_revision",
    "max_seq_len_to_capture", "disable_custom_all_reduce", "swap_space", "block_size",
    "max_logprobs", "distributed_executor_backend", "worker_use_ray",
    "max_parallel_loading_workers", "num_gpu_blocks_override", "preemption_mode",
    "scheduler_delay_factor", "compilation_config", "async_scheduling", "enable_chunked_prefill",
    "guided_decoding_backend", "structured_outputs_config", "use_v2_block_manager",
    "disable_async_output_proc", "max_num_partial_prefills", "long_prefill_token_threshold",
})

# vLLM keys exspec accepts only at their neutral value (vLLM's default); any other value would
# change the model served or how it runs, and exspec cannot do that.
NEUTRAL_ONLY = {
    "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1,
    "quantization": None, "enable_lora": False, "max_loras": None, "max_lora_rank": None,
    "cpu_offload_gb": 0, "kv_cache_dtype": "auto", "tokenizer_mode": "auto",
    "skip_tokenizer_init": False, "disable_sliding_window": False, "enable_expert_parallel": False,
}

# vLLM's dtype spellings; "auto" keeps exspec's default for the device (float32 on CPU).
DTYPE_SPELLINGS = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}

VLLM_DEFAULT_MAX_TOKENS = 16   # vLLM's SamplingParams.max_tokens default

# speculative_config's keys besides each method's own (SpeculativeMethod.keys); the
# draft's tensor parallelism only at its neutral value
COMMON_SPECULATIVE_KEYS = ("model", "method", "num_speculative_tokens", "draft_tensor_parallel_size")


def speculative_keys() -> tuple[str, ...]:
    """Every speculative_config key exspec takes: the common ones, then each method's own."""
    return tuple(dict.fromkeys(COMMON_SPECULATIVE_KEYS + tuple(
        key for method in METHODS.declarations() for key in method.keys)))


def translate(values: dict) -> tuple[dict, list[str]]:
    """model.json keys -> (EngineConfig keys, one note per vLLM key ignored or mapped).
    Raises ValueError naming the key for a value exspec cannot honour."""
    out = dict(values)
    notes = []
    if "model" in out:
        if "target_model" in out:
            raise ValueError("model.json sets both 'model' (vLLM's name) and 'target_model'; keep one")
        out["target_model"] = out.pop("model")
        notes.append("model: served as target_model")
        if "default_max_tokens" not in out:   # vLLM's SamplingParams default, as its backend serves
            out["default_max_tokens"] = VLLM_DEFAULT_MAX_TOKENS
            notes.append(f"a request without max_tokens gets vLLM's default, {VLLM_DEFAULT_MAX_TOKENS}")
        if "method" not in out and "speculative_config" not in out:
            out["method"] = "autoregressive"   # vLLM without speculative_config: no speculation
            notes.append("no speculative_config: method autoregressive (the target alone)")
    if "speculative_config" in out:
        out.update(_speculative(out.pop("speculative_config"), out))
        notes.append("speculative_config: the proposer and num_speculative_tokens set from it")
    for key, neutral in NEUTRAL_ONLY.items():
        if key in out:
            value = out.pop(key)
            if value != neutral:
                raise ValueError(f"{key} = {value!r} is not supported by exspec (only {neutral!r}): "
                                 f"it serves one unquantized model per GPU, without LoRA")
    if "disable_log_stats" in out:   # read again by the adapter (exspec_config.vllm_stats_disabled)
        value = out.pop("disable_log_stats")
        notes.append(f"disable_log_stats = {value!r}: the vllm: metric families "
                     f"{'off' if value is True else 'published where REPORT_CUSTOM_METRICS asks'}"
                     " (as in Triton's vLLM backend)")
    for key in sorted(IGNORED & set(out)):
        notes.append(f"{key} = {out.pop(key)!r}: ignored (it changes no output here)")
    if out.get("dtype") == "auto":
        out.pop("dtype")
        notes.append("dtype auto: exspec's default, float32")
    elif out.get("dtype") in DTYPE_SPELLINGS:
        out["dtype"] = DTYPE_SPELLINGS[out["dtype"]]
    if out.get("device") == "auto":
        out.pop("device")
        notes.append("device auto: exspec's default, cpu")
    if "gpu_memory_utilization" in out and not str(out.get("device", "cpu")).startswith("cuda"):
        notes.append("gpu_memory_utilization: no effect on cpu (it sets the KV budget on a GPU)")
    return out, notes


def _speculative(spec, values: dict) -> dict:
    """vLLM's speculative_config -> exspec keys, for any registered method (speculative.py): one
    with a model (a draft model, an EAGLE-3 head) or without (n-gram prompt lookup, suffix
    decoding); the other methods (EAGLE-1/2, Medusa, MTP) are refused by name."""
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be an object, got {spec!r}")
    known = speculative_keys()
    unknown = sorted(set(spec) - set(known))
    if unknown:
        raise ValueError(f"speculative_config keys not supported by exspec: {', '.join(unknown)} "
                         f"(supported: {', '.join(known)})")
    name = spec.get("method", DEFAULT_METHOD)
    if name not in METHODS:
        usages = [m.usage for m in METHODS.declarations()]
        raise ValueError(f"speculative_config method {name!r} is not supported by exspec; "
                         f"it speculates {', '.join(usages[:-1])} or {usages[-1]}")
    method = METHODS.declared(name)
    for other in METHODS.declarations():   # another method's keys (some share theirs)
        theirs = sorted(key for key in other.keys if key in spec and key not in method.keys)
        if theirs and other.name != name:
            owners = [m.name for m in METHODS.declarations() if set(theirs) <= set(m.keys)]
            raise ValueError(f"speculative_config {', '.join(theirs)}: only for method "
                             f"{' or '.join(map(repr, owners))}")
    out = {key: spec[key] for key in method.keys if key in spec}
    if name != DEFAULT_METHOD:   # the default leaves EngineConfig's proposer as it is
        out["proposer"] = name
    if method.model is None:
        if "model" in spec or "draft_model" in values:
            raise ValueError(f"speculative_config method {name!r} proposes without a draft model; "
                             "drop 'model'")
    else:
        if spec.get("draft_tensor_parallel_size", 1) != 1:
            raise ValueError("speculative_config draft_tensor_parallel_size must be 1 in exspec")
        if not spec.get("model"):
            raise ValueError(f"speculative_config needs 'model': {method.model}")
        if "draft_model" in values:
            raise ValueError("model.json sets both speculative_config.model and draft_model; keep one")
        out["draft_model"] = spec["model"]
    if "num_speculative_tokens" in spec:
        out["num_speculative_tokens"] = spec["num_speculative_tokens"]
    elif method.k_from is not None:   # vLLM: k from that key (suffix decoding: the tree's depth)
        default = SpeculativeConfig.default(method.k_from)
        value = spec.get(method.k_from, default)
        out["num_speculative_tokens"] = (value if isinstance(value, int) and not isinstance(value, bool)
                                         else default)   # (checked at load)
    return out
