"""What the exspec model reads at load: the engine arguments from model.json (and the one
model.json key the adapter itself takes, `record_traffic`), and the config.pbtxt parameters the
adapter takes. A problem is an error that fails the load."""
from __future__ import annotations

import json
import os

from exspec import EngineConfig
from exspec.config import resolve_model_paths
from exspec_traffic import DEFAULT_MAX_BYTES, TrafficSettings

MODEL_JSON = "model.json"
RECORD_TRAFFIC = "record_traffic"   # the adapter's own model.json key: not an engine argument
DEFAULT_DRAIN_TIMEOUT_S = 20.0   # config.pbtxt parameter drain_timeout_s; below the default exit timeout (30 s)


def engine_config(args) -> EngineConfig:
    """model.json beside the version folder, paths resolved, device from the instance kind."""
    folder = os.path.join(args["model_repository"], args["model_version"])
    path = os.path.join(folder, MODEL_JSON)
    values = resolve_model_paths(_read_model_json(path), folder)
    values.pop(RECORD_TRAFFIC, None)
    kind = args.get("model_instance_kind", "CPU")
    if kind in ("GPU", "CPU"):
        values["device"] = _device(path, kind, values.get("device"), args)
    return EngineConfig.from_dict(values)   # unknown keys: ValueError naming them


def vllm_stats_disabled(args) -> bool:
    """model.json's `disable_log_stats: true` (vLLM's key): as in Triton's vLLM backend, no vllm:
    metric families then, whatever REPORT_CUSTOM_METRICS says."""
    path = os.path.join(args["model_repository"], args["model_version"], MODEL_JSON)
    return _read_model_json(path).get("disable_log_stats") is True


def traffic_recording(args) -> TrafficSettings | None:
    """model.json's `record_traffic: {"path": ..., "max_bytes": N}` (default: off): write each
    finished request as the offline replay reads it (exspec_traffic). A relative path is taken
    from the version folder (model.json's); max_bytes (default 256 MiB) is where the file
    rotates."""
    folder = os.path.join(args["model_repository"], args["model_version"])
    path = os.path.join(folder, MODEL_JSON)
    value = _read_model_json(path).get(RECORD_TRAFFIC)
    if value is None:
        return None
    example = '{"path": "/var/log/exspec/served.jsonl", "max_bytes": 268435456}'
    if not isinstance(value, dict):
        raise ValueError(f"{path}: {RECORD_TRAFFIC} must be an object, e.g. {example}; got {value!r}")
    unknown = sorted(set(value) - {"path", "max_bytes"})
    if unknown:
        raise ValueError(f"{path}: {RECORD_TRAFFIC} takes path and max_bytes, not "
                         f"{', '.join(unknown)}")
    where = value.get("path")
    if not isinstance(where, str) or not where.strip():
        raise ValueError(f"{path}: {RECORD_TRAFFIC}.path must name the JSONL file to write, e.g. "
                         f"{example}; got {where!r}")
    max_bytes = value.get("max_bytes", DEFAULT_MAX_BYTES)
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
        raise ValueError(f"{path}: {RECORD_TRAFFIC}.max_bytes must be a whole number of bytes "
                         f">= 1 (the size at which the file rotates), got {max_bytes!r}")
    return TrafficSettings(os.path.normpath(os.path.join(folder, where)), max_bytes)


def _read_model_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: the exspec backend reads its engine "
                                "arguments (EngineConfig fields) from it")
    with open(path) as f:
        try:
            values = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a JSON object of EngineConfig fields")
    return values


def _device(path: str, kind: str, wanted, args) -> str:
    """The instance kind decides the device; model.json's 'device', if any, must agree."""
    if kind == "GPU":
        device = f"cuda:{int(args.get('model_instance_device_id', 0))}"
        if wanted and not str(wanted).startswith("cuda"):
            raise ValueError(f"{path} asks for device {wanted!r} but the instance is KIND_GPU; "
                             "use KIND_CPU in config.pbtxt or drop 'device'")
        return device
    if wanted and wanted != "cpu":
        raise ValueError(f"{path} asks for device {wanted!r} but the instance is KIND_CPU; "
                         "use KIND_GPU in config.pbtxt or drop 'device'")
    return "cpu"


def parameter(model_config: dict, name: str) -> str:
    """A config.pbtxt parameter's string_value, stripped; "" when absent."""
    return model_config.get("parameters", {}).get(name, {}).get("string_value", "").strip()


def _switch(model_config: dict, name: str) -> bool | None:
    """A "true" / "false" config.pbtxt parameter; None when absent."""
    raw = parameter(model_config, name).lower()
    if raw not in ("", "true", "false"):
        raise ValueError(f"config.pbtxt parameter {name} must be \"true\" or \"false\", got {raw!r}")
    return None if raw == "" else raw == "true"


def vllm_health_check(model_config: dict) -> bool:
    """config.pbtxt parameter ENABLE_VLLM_HEALTH_CHECK (the vLLM backend's, default "false"):
    a dead engine answers in the vLLM backend's words, and unloads."""
    return bool(_switch(model_config, "ENABLE_VLLM_HEALTH_CHECK"))


def unload_when_dead(model_config: dict) -> bool:
    """config.pbtxt parameter unload_when_dead (default "true"; ENABLE_VLLM_HEALTH_CHECK
    "true" turns it on too): unload the model once its engine is dead, so that its ready
    endpoint fails on any Triton version (Triton before 26.03 never asks the model's is_ready)."""
    own = _switch(model_config, "unload_when_dead")
    return vllm_health_check(model_config) or own is None or own


def drain_settings(model_config: dict) -> tuple[str | None, float]:
    """config.pbtxt parameters drain_file (default: none) and drain_timeout_s (seconds >= 0)."""
    raw = parameter(model_config, "drain_timeout_s")
    try:
        timeout = float(raw) if raw else DEFAULT_DRAIN_TIMEOUT_S
    except ValueError:
        raise ValueError(f"config.pbtxt parameter drain_timeout_s must be a number of seconds, "
                         f"got {raw!r}") from None
    if timeout < 0:
        raise ValueError(f"config.pbtxt parameter drain_timeout_s must be >= 0, got {timeout:g}")
    return parameter(model_config, "drain_file") or None, timeout
