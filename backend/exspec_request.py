"""Turn one Triton request's inputs and parameters into what the engine takes (adapter helper).

Plain Python and numpy, no Triton import, so it is tested without a server. Every problem is an
InvalidRequestError whose message names the input or parameter and says what would be accepted;
model.py turns it into exactly one INVALID_ARG response.

Values may arrive typed (sampling_parameters JSON, HTTP generate JSON) or as strings (gRPC
request parameters, clients that stringify everything): "0.1", "false", "[\"\\n\\n\"]" and
"[1, 2]" parse like their JSON counterparts.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import numpy as np

from exspec import InvalidRequestError, SamplingParams
from exspec.sampling.structured_output import StructuredOutput

# Boolean request inputs (all TYPE_BOOL [1], optional), in the vLLM backend's names.
FLAG_INPUTS = ("stream", "exclude_input_in_output", "return_finish_reason",
               "return_num_input_tokens", "return_num_output_tokens", "return_logprobs",
               "return_cumulative_logprob")

_INT, _FLOAT, _BOOL, _STRS, _INTS = "integer", "number", "boolean", "strings", "integers"
_BIAS = "token id -> number"
_STRUCT = "structured outputs object"
SAMPLING_KEYS = {
    "max_tokens": _INT, "temperature": _FLOAT, "top_p": _FLOAT, "top_k": _INT, "seed": _INT,
    "stop": _STRS, "stop_token_ids": _INTS, "ignore_eos": _BOOL,
    "num_speculative_tokens": _INT, "logprobs": _INT,
    "repetition_penalty": _FLOAT, "frequency_penalty": _FLOAT, "presence_penalty": _FLOAT,
    "min_p": _FLOAT, "min_tokens": _INT, "logit_bias": _BIAS, "allowed_token_ids": _INTS,
    "bad_words": _STRS, "n": _INT, "best_of": _INT,
    # vLLM's structured outputs (exspec/sampling/structured_output.py); `guided_decoding` is the older
    # spelling (vllm_backend maps it onto structured_outputs, which wins when both are given),
    # and guided_json / guided_regex / guided_choice / guided_grammar vLLM's OpenAI server's
    "structured_outputs": _STRUCT, "guided_decoding": _STRUCT, "guided_json": _STRUCT,
    "guided_regex": _STRUCT, "guided_choice": _STRUCT, "guided_grammar": _STRUCT,
}
GUIDED_KEYS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# vLLM SamplingParams keys exspec does not implement, at the value that leaves vLLM's output
# unchanged. vLLM backend clients send them at that value, so those are accepted and ignored;
# any other value is refused. None: only absent or empty (null, [], {}, "") is neutral.
NEUTRAL_KEYS = {
    "length_penalty": (_FLOAT, 1.0),
    "use_beam_search": (_BOOL, False), "early_stopping": (_BOOL, False),
    "include_stop_str_in_output": (_BOOL, False), "skip_special_tokens": (_BOOL, True),
    "spaces_between_special_tokens": (_BOOL, True), "detokenize": (_BOOL, True),
    "prompt_logprobs": (None, None), "truncate_prompt_tokens": (None, None),
    "logits_processors": (None, None), "lora_name": (None, None),
}
# A request's own label, not a sampling parameter: the `category` column of the traffic that
# model.json's record_traffic writes (exspec_traffic); accepted, and unused, when it is off.
CATEGORY = "category"
# Request parameters Triton itself or its clients add (the HTTP generate endpoint passes the
# body's "id" on as one); never sampling parameters.
_TRANSPORT_PARAMETERS = {"id", "binary_data_output", "binary_data", "binary_data_size", "priority",
                         "timeout", "headers", "sequence_id", "sequence_start", "sequence_end",
                         "triton_enable_empty_final_response", "classification"}
# Set by the unary front model on the requests it forwards through BLS: BLS hands back only an
# error's message (its code arrives as INTERNAL), so such errors carry their code as a
# "[INVALID_ARG] " prefix that the front model turns back into the code.
ERROR_CODE_TAG_PARAMETER = "exspec_tag_error_codes"
# Word for word the vLLM backend's error, which its clients and CI tests match.
STREAM_WITH_PROMPT_ERROR = ("Error generating stream: When streaming, `exclude_input_in_output` "
                            "= False is not allowed.")
_INT_RE = re.compile(r"^[+-]?\d+$")


@dataclass
class ParsedRequest:
    prompt: str | list[int] | None   # None until `messages` are rendered (render_chat)
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool | None = None   # None: absent
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_logprobs: bool = False
    return_cumulative_logprob: bool = False
    logprobs: int | None = None    # the request's `logprobs` (top N); None: the output is null
    messages: list[dict] | None = None   # a chat, rendered by the model's chat template
    category: str | None = None          # the request's `category` (record_traffic's column)

    @property
    def prepend_prompt(self) -> bool:
        """The prompt goes in front of text_output only when not streaming and not excluded."""
        return not self.stream and not self.exclude_input_in_output


def parse_request(inputs: dict, parameters: str | dict | None,
                  max_request_bytes: int | None = None) -> ParsedRequest:
    """inputs: name -> numpy array (absent inputs missing or None); parameters: request
    parameters as Triton's JSON string or a dict. Over max_request_bytes: refused before
    anything is parsed or tokenized."""
    if max_request_bytes is not None:
        size = request_bytes(inputs, parameters)
        if size > max_request_bytes:
            raise InvalidRequestError(f"request is {size} bytes; the limit is {max_request_bytes} "
                                      "(max_request_bytes in model.json)")
    flags = {name: _flag_input(inputs, name) for name in FLAG_INPUTS}
    messages = _messages(inputs.get("messages"))
    if messages is not None and (inputs.get("text_input") is not None
                                 or inputs.get("input_ids") is not None):
        raise InvalidRequestError("give messages (a chat) or text_input or input_ids, not two")
    prompt = None if messages is not None else _prompt(inputs)
    sampling = _sampling_json(inputs.get("sampling_parameters"))
    given = dict.fromkeys(sampling, "sampling_parameters")
    more = [(key, value, "request parameter") for key, value in _request_parameters(parameters).items()]
    if inputs.get("stop") is not None:
        more.append(("stop", _stop_input(inputs["stop"]), "stop input"))
    for key, value, where in more:
        if key in sampling and not _same_value(key, sampling[key], value):
            raise InvalidRequestError(
                f"sampling parameter {key!r} given twice with different values "
                f"({given[key]}: {sampling[key]!r}, {where}: {value!r})")
        sampling[key], given[key] = value, where
    category = _category(sampling.pop(CATEGORY, None))
    values = {}
    for key, value in sampling.items():
        if value is None:
            continue   # null: absent, as in vLLM
        if key in NEUTRAL_KEYS:
            _check_neutral(key, value)
        else:
            values[key] = coerce(key, value)
    # vLLM's meaning: `logprobs: N` asks for the chosen token's logprob and the top N others;
    # the `logprobs` output is null without it. cumulative_logprob needs the chosen ones only.
    _structured(values)
    logprobs = values.get("logprobs")
    if logprobs is None and flags["return_cumulative_logprob"]:
        values["logprobs"] = 0
    params = SamplingParams(**values)   # validates ranges; raises InvalidRequestError

    stream = bool(flags.pop("stream"))
    exclude = flags.pop("exclude_input_in_output")
    if messages is not None and exclude is None:
        exclude = True   # a chat's answer is the assistant's turn, not the rendered template
    if stream and exclude is False:   # the vLLM backend's condition and words
        raise InvalidRequestError(STREAM_WITH_PROMPT_ERROR)
    return ParsedRequest(prompt=prompt, params=params, stream=stream,
                         exclude_input_in_output=exclude, logprobs=logprobs, messages=messages,
                         category=category,
                         **{name: bool(value) for name, value in flags.items()})


def render_chat(tokenizer, messages: list[dict]) -> str:
    """A chat through the model's own chat template, ready for the assistant's turn (the
    template's text; the engine tokenizes it without adding special tokens again)."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("messages: this model's tokenizer has no chat template; send "
                                  "the prompt as text_input instead")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:   # the template's own checks (roles alternating, ...) raise here
        raise InvalidRequestError(f"messages: the chat template refused them: {exc}") from None


def _category(value) -> str | None:
    """The `category` parameter: a string (a number is taken as its text)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise InvalidRequestError(f"category must be a string (a label for recorded traffic), "
                                  f"got {value!r}")
    return value


def _messages(value) -> list[dict] | None:
    """The `messages` input: one string holding a JSON list of {"role", "content"} objects
    (OpenAI's chat shape, text content only)."""
    if value is None:
        return None
    flat = np.asarray(value, dtype=object).reshape(-1)
    if flat.size != 1:
        raise InvalidRequestError(f"messages must hold exactly one string (a JSON list), got "
                                  f"{flat.size}")
    raw = flat[0].decode("utf-8", errors="replace") if isinstance(flat[0], bytes) else flat[0]
    example = '[{"role": "user", "content": "Hi"}]'
    try:
        messages = json.loads(raw)
    except (TypeError, json.JSONDecodeError):
        raise InvalidRequestError(f"messages must be a JSON list as text, e.g. {example}; got "
                                  f"{str(raw)[:100]!r}") from None
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(f"messages must be a non-empty JSON list, e.g. {example}")
    for i, message in enumerate(messages):
        if (not isinstance(message, dict) or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)):
            raise InvalidRequestError(f"messages[{i}] must be an object with string role and "
                                      f"content, e.g. {example}; got {str(message)[:100]!r}")
    return messages


def _stop_input(value) -> str | list[str]:
    """The `stop` input (STRING [-1]): HTTP generate's top-level `"stop": ["a", "b"]` arrives as
    this tensor, as Triton turns a JSON array only into an input, never into a parameter. One
    element is read like the parameter's string (a stop string, or a JSON list as text)."""
    flat = [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v
            for v in np.asarray(value, dtype=object).reshape(-1)]
    return flat[0] if len(flat) == 1 else flat


def _structured(values: dict) -> None:
    """One `structured_outputs` from its spellings: itself, `guided_decoding` (whose fields may
    also carry the guided_ prefix) or top-level guided_json / guided_regex / ..."""
    guided = values.pop("guided_decoding", None)
    if isinstance(guided, dict):
        guided = {key.removeprefix("guided_"): value for key, value in guided.items()}
    top = {key.removeprefix("guided_"): values.pop(key) for key in GUIDED_KEYS if key in values}
    if top:
        if guided is not None:
            raise InvalidRequestError(f"give guided_decoding or {', '.join(GUIDED_KEYS)}, not both")
        guided = top
    if values.get("structured_outputs") is None and guided is not None:
        values["structured_outputs"] = StructuredOutput.parse(guided, "guided_decoding")


def request_bytes(inputs: dict, parameters: str | dict | None) -> int:
    """Bytes a request carries: its tensors (each string element counted) and parameters."""
    size = len(parameters) if isinstance(parameters, str) else len(json.dumps(parameters or {}))
    for array in inputs.values():
        if array is None:
            continue
        array = np.asarray(array)
        if array.dtype == object:
            size += sum(len(v) if isinstance(v, (bytes, str)) else 8 for v in array.reshape(-1))
        else:
            size += array.nbytes
    return size


def _prompt(inputs: dict) -> str | list[int]:
    text = inputs.get("text_input")
    ids = inputs.get("input_ids")
    if text is not None and ids is not None:
        raise InvalidRequestError("give either text_input or input_ids, not both")
    if ids is not None:
        ids = np.asarray(ids).reshape(-1)
        if ids.size == 0:
            raise InvalidRequestError("input_ids is empty")
        if not np.issubdtype(ids.dtype, np.integer):
            raise InvalidRequestError(f"input_ids must be INT64, got {ids.dtype}")
        return [int(t) for t in ids]
    if text is None:
        raise InvalidRequestError("missing prompt: send text_input (STRING [1]) or input_ids "
                                  "(INT64 [-1])")
    text = np.asarray(text, dtype=object).reshape(-1)
    if text.size != 1:
        raise InvalidRequestError(f"text_input must hold exactly one string, got {text.size}")
    value = text[0]
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequestError(f"text_input is not valid UTF-8: {exc}") from None
    if not isinstance(value, str):
        raise InvalidRequestError(f"text_input must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidRequestError("text_input is empty")
    return value


def _flag_input(inputs: dict, name: str) -> bool | None:
    value = inputs.get(name)
    if value is None:
        return None
    flat = np.asarray(value).reshape(-1)
    if flat.size != 1:
        raise InvalidRequestError(f"{name} must hold exactly one BOOL, got {flat.size} values")
    return parse_bool(name, flat[0].item() if hasattr(flat[0], "item") else flat[0])


def _sampling_json(value) -> dict:
    if value is None:
        return {}
    flat = np.asarray(value, dtype=object).reshape(-1)
    if flat.size != 1:
        raise InvalidRequestError("sampling_parameters must hold exactly one JSON string")
    raw = flat[0]
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", errors="replace")
    if not str(raw).strip():
        return {}
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"sampling_parameters is not valid JSON ({exc.msg} at "
                                  f"position {exc.pos}): {str(raw)[:200]!r}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequestError("sampling_parameters must be a JSON object, got "
                                  f"{type(parsed).__name__}")
    for key in parsed:
        _check_known(key, "sampling_parameters")
    return parsed


def _request_parameters(parameters) -> dict:
    if not parameters:
        return {}
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters)
        except json.JSONDecodeError:
            raise InvalidRequestError("request parameters are not valid JSON") from None
    out = {}
    for key, value in parameters.items():
        if (key in _TRANSPORT_PARAMETERS or key == ERROR_CODE_TAG_PARAMETER
                or key.startswith(("shared_memory", "triton_"))):
            continue
        _check_known(key, "request parameters")
        out[key] = value
    return out


def _same_value(key: str, a, b) -> bool:
    """The same value in two spellings? vLLM clients send the sampling_parameters JSON and the
    same keys as request parameters, where "0" may stand for 0."""
    if a == b:
        return True
    try:
        return key in SAMPLING_KEYS and coerce(key, a) == coerce(key, b)
    except InvalidRequestError:
        return False


def _check_known(key: str, where: str) -> None:
    if key not in SAMPLING_KEYS and key not in NEUTRAL_KEYS and key != CATEGORY:
        raise InvalidRequestError(f"unknown sampling parameter {key!r} in {where}; known: "
                                  f"{', '.join(sorted(SAMPLING_KEYS))} (and vLLM's "
                                  f"{', '.join(sorted(NEUTRAL_KEYS))} at their neutral values; "
                                  f"{CATEGORY}, a label for recorded traffic)")


def _check_neutral(key: str, value) -> None:
    """A vLLM key exspec does not implement: only the value that changes nothing is accepted."""
    kind, neutral = NEUTRAL_KEYS[key]
    if kind is None:
        ok = value in ("", [], {}) or (isinstance(value, str) and value.strip() in ("null", "[]", "{}"))
        wanted = "null or empty"
    else:
        try:
            ok = {_BOOL: parse_bool, _INT: _parse_int, _FLOAT: _parse_float}[kind](key, value) == neutral
        except InvalidRequestError:
            ok = False
        wanted = json.dumps(neutral)
    if not ok:
        raise InvalidRequestError(f"sampling parameter {key}={value!r} is not supported: exspec "
                                  f"accepts {key} only as {wanted} (vLLM's neutral value); it "
                                  f"supports {', '.join(sorted(SAMPLING_KEYS))}")


def coerce(key: str, value):
    """One sampling parameter to its type, accepting the string spellings clients send."""
    kind = SAMPLING_KEYS[key]
    if kind == _BOOL:
        return parse_bool(key, value)
    if kind == _INT:
        return _parse_int(key, value)
    if kind == _FLOAT:
        return _parse_float(key, value)
    if kind == _STRUCT:
        if key == "structured_outputs":
            return StructuredOutput.parse(value, key)
        if key == "guided_decoding" and isinstance(value, str):
            return _json(key, value.strip(), dict)
        if key == "guided_choice" and isinstance(value, str):
            return _json_list(key, value.strip())
        return value   # checked with the other spellings (_structured)
    if kind == _BIAS:
        if isinstance(value, str) and value.strip().startswith("{"):
            value = _json(key, value.strip(), dict)
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{key} must map token ids to numbers, got {value!r}")
        return {_parse_int(key, token): _parse_float(key, bias) for token, bias in value.items()}
    if kind == _STRS:
        if isinstance(value, str):
            if value.lstrip().startswith("["):
                value = _json_list(key, value)
            else:
                return [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise InvalidRequestError(f"{key} must be a string or a list of strings, got {value!r}")
        return value
    # _INTS
    if isinstance(value, str):
        text = value.strip()
        value = _json_list(key, text) if text.startswith("[") else (
            [v for v in text.split(",") if v.strip()] if text else [])
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list):
        raise InvalidRequestError(f"{key} must be a list of integers, got {value!r}")
    return [_parse_int(key, v) for v in value]


def parse_bool(key: str, value) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
    raise InvalidRequestError(f"{key} must be true or false, got {value!r}")


def _parse_int(key: str, value) -> int:
    if isinstance(value, bool):
        raise InvalidRequestError(f"{key} must be an integer, got {value!r}")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str) and _INT_RE.match(value.strip()):
        return int(value.strip())
    raise InvalidRequestError(f"{key} must be an integer, got {value!r}")


def _parse_float(key: str, value) -> float:
    if isinstance(value, bool):
        raise InvalidRequestError(f"{key} must be a number, got {value!r}")
    if isinstance(value, (int, float, np.integer, np.floating)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise InvalidRequestError(f"{key} must be a number, got {value!r}") from None
    else:
        raise InvalidRequestError(f"{key} must be a number, got {value!r}")
    if not math.isfinite(number):
        raise InvalidRequestError(f"{key} must be a finite number, got {value!r}")
    return number


def _json_list(key: str, text: str) -> list:
    return _json(key, text, list)


def _json(key: str, text: str, kind: type):
    """A JSON list or object sent as a string."""
    what = "list" if kind is list else "object"
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise InvalidRequestError(f"{key}: {text[:100]!r} looks like a JSON {what} but does not "
                                  "parse") from None
    if not isinstance(value, kind):
        raise InvalidRequestError(f"{key} must be a {what}, got {text[:100]!r}")
    return value
