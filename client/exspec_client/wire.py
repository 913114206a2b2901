"""The exspec tensor schema (Triton's vLLM-backend names plus input_ids / output_ids and the
speculation statistics) in both directions, for gRPC tensors and HTTP generate JSON."""
from __future__ import annotations

import json

import numpy as np

from .types import Delta

FLAGS = {"return_finish_reason": True, "return_num_input_tokens": True}


# gRPC targets that name several servers: a Kubernetes headless Service (dns:///name:port)
# or a static list (ipv4:host:port,host:port). Their generations are spread round robin.
BALANCED_TARGETS = ("dns:", "ipv4:", "ipv6:")
_MAX_MESSAGE = 2**31 - 1


def grpc_client(module, url: str):
    """A tritonclient (sync or aio) gRPC client for `url`; a multi-server target gets a
    round-robin channel (tritonclient's own channel options replaced, so restate its limits)."""
    if url.startswith(BALANCED_TARGETS):
        return module.InferenceServerClient(url, channel_args=[
            ("grpc.lb_policy_name", "round_robin"),
            ("grpc.max_send_message_length", _MAX_MESSAGE),
            ("grpc.max_receive_message_length", _MAX_MESSAGE)])
    return module.InferenceServerClient(url)


def infer_inputs(prompt, sampling: str, stream: bool, module=None):
    """InferInputs for one request (`module`: tritonclient.grpc, the default, or
    tritonclient.http). Not streaming, the prompt is excluded so text_output is only the
    generated text, as when streaming."""
    if module is None:
        import tritonclient.grpc as module

    def tensor(name, array, dtype):
        t = module.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    name, value = prompt_input(prompt)
    if name == "input_ids":
        inputs = [tensor(name, np.asarray(value, dtype=np.int64), "INT64")]
    else:
        inputs = [tensor(name, np.array([value.encode("utf-8")], dtype=np.object_), "BYTES")]
    inputs.append(tensor("sampling_parameters", np.array([sampling.encode()], dtype=np.object_),
                         "BYTES"))
    flags = {"stream": stream, **FLAGS, **({} if stream else {"exclude_input_in_output": True})}
    inputs += [tensor(name, np.array([value], dtype=bool), "BOOL") for name, value in flags.items()]
    return inputs


def prompt_input(prompt) -> tuple[str, str | list[int]]:
    """The input a prompt travels in: text_input (a string), input_ids (token ids) or messages
    (a chat: [{"role": ..., "content": ...}], as JSON text; the server applies the model's chat
    template)."""
    if isinstance(prompt, str):
        return "text_input", prompt
    prompt = list(prompt)
    if prompt and all(isinstance(m, dict) for m in prompt):
        return "messages", json.dumps(prompt)
    return "input_ids", [int(t) for t in prompt]


def http_body(prompt, sampling: str, stream: bool) -> dict:
    name, value = prompt_input(prompt)
    body = {name: value}
    body.update(sampling_parameters=sampling, stream=stream, **FLAGS)
    if not stream:
        body["exclude_input_in_output"] = True
    return body


def delta_from_arrays(get, time_s: float) -> Delta:
    """`get(name)` returns an output's numpy array or None (absent)."""
    text = get("text_output")
    ids = get("output_ids")
    reason = get("finish_reason")
    reason = None if reason is None else _str(reason.reshape(-1)[0])
    return Delta(
        text="" if text is None else "".join(_str(t) for t in text.reshape(-1)),
        token_ids=[] if ids is None else [int(t) for t in ids.reshape(-1)],
        time_s=time_s,
        finish_reason=None if reason in (None, "None", "") else reason,
        num_input_tokens=_scalar(get("num_input_tokens")),
        draft_tokens=_scalar(get("total_draft_tokens")),
        accepted_draft_tokens=_scalar(get("total_accepted_draft_tokens")))


def delta_from_json(event: dict, time_s: float) -> Delta:
    """A generate / generate_stream JSON body; Triton writes a one-element tensor as a scalar."""
    def get(name):
        if name not in event:
            return None
        value = event[name]
        return np.array(value if isinstance(value, list) else [value], dtype=object)
    return delta_from_arrays(get, time_s)


def _str(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _scalar(array):
    return None if array is None or array.size == 0 else int(array.reshape(-1)[0])
