"""What the exspec model sends: its output tensors (the I/O contract's outputs), one response
built from an engine output, and the one place an exception becomes a Triton error."""
from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from exspec import EngineBusyError, InvalidRequestError, RequestOutput, TokenLogprob

OUTPUTS = [
    {"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "output_ids", "data_type": "TYPE_INT64", "dims": [-1]},
    {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": [-1]},
    {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "cumulative_logprob", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "acceptance_rate", "data_type": "TYPE_FP32", "dims": [1]},
    {"name": "total_accepted_draft_tokens", "data_type": "TYPE_INT32", "dims": [1]},
    {"name": "total_draft_tokens", "data_type": "TYPE_INT32", "dims": [1]},
]
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def speculation_tensors(out: RequestOutput) -> list:
    """The request's speculation counters so far. One list serves every per-token response of
    a step (the counters are the step's): a Tensor keeps its shared memory once sent, and
    building one costs about 25 us of the send thread, held under the GIL the engine needs."""
    return [
        pb_utils.Tensor("acceptance_rate", np.array(
            [out.num_accepted_draft_tokens / out.num_draft_tokens if out.num_draft_tokens else 0.0],
            dtype=np.float32)),
        pb_utils.Tensor("total_accepted_draft_tokens",
                        np.array([out.num_accepted_draft_tokens], dtype=np.int32)),
        pb_utils.Tensor("total_draft_tokens", np.array([out.num_draft_tokens], dtype=np.int32)),
    ]


def response(stream, out: RequestOutput, final: bool, prompt_text, token_text, speculation=None):
    """One response for `stream` (the adapter's per-request state) from an engine output:
    this output's delta when streaming, else the whole text so far. `prompt_text()` gives the
    prompt for prepend_prompt (decoded only when asked); `token_text(id)` one token's text;
    `speculation`: speculation_tensors(out), if already built for this step.

    Per sample tensors (text_output, finish_reason, num_output_tokens, logprobs,
    cumulative_logprob) hold one element per sample, by index, as Triton's vLLM backend returns
    n > 1; streaming, only this output's sample has a delta, the others "" (and 0 tokens).
    output_ids holds the samples' ids one after another (num_output_tokens splits them)."""
    req = stream.req
    samples = stream.samples
    if req.stream:
        deltas = [(out.text_delta, out.new_token_ids, out.new_logprobs or [], out.finish_reason)
                  if i == out.index else ("", [], [], None) for i in range(len(samples))]
        counts = [len(ids) for _, ids, _, _ in deltas]
    else:
        prompt = prompt_text() if req.prepend_prompt else ""
        deltas = [(prompt + "".join(s.texts), s.ids, s.logprobs, s.finish_reason) for s in samples]
        counts = [s.num_output_tokens for s in samples]
        out = stream.totals(out)
    texts, ids, logprobs, reasons = zip(*deltas)
    tensors = [
        pb_utils.Tensor("text_output", np.array([t.encode("utf-8") for t in texts], dtype=np.object_)),
        pb_utils.Tensor("output_ids", np.array([t for sample in ids for t in sample], dtype=np.int64)),
        *(speculation or speculation_tensors(out)),
    ]
    if req.return_finish_reason:
        tensors.append(pb_utils.Tensor("finish_reason", np.array(
            [str(reason).encode() for reason in reasons], dtype=np.object_)))
    if req.return_num_input_tokens:
        tensors.append(pb_utils.Tensor("num_input_tokens",
                                       np.array([out.num_prompt_tokens], dtype=np.uint32)))
    if req.return_num_output_tokens:
        tensors.append(pb_utils.Tensor("num_output_tokens", np.array(counts, dtype=np.uint32)))
    if req.return_logprobs:
        values = ["null" if req.logprobs is None else logprobs_json(i, lp, token_text)
                  for i, lp in zip(ids, logprobs)]
        tensors.append(pb_utils.Tensor("logprobs", np.array([v.encode() for v in values],
                                                            dtype=np.object_)))
    if req.return_cumulative_logprob:
        tensors.append(pb_utils.Tensor("cumulative_logprob", np.array(
            [s.cumulative_logprob for s in samples], dtype=np.float32)))
    return pb_utils.InferenceResponse(output_tensors=tensors)


def logprobs_json(ids: list[int], logprobs: list[TokenLogprob], token_text) -> str:
    """The vLLM backend's format: per token {token_id: {logprob, rank, decoded_token}}, the
    chosen token first, then the most likely ones (ranks 1..N) not already there."""
    tokens = []
    for token_id, lp in zip(ids, logprobs):
        entries = {token_id: {"logprob": lp.logprob, "rank": lp.rank,
                              "decoded_token": token_text(token_id)}}
        for rank, (other, value) in enumerate(lp.top, start=1):
            entries.setdefault(other, {"logprob": value, "rank": rank,
                                       "decoded_token": token_text(other)})
        tokens.append(entries)
    return json.dumps(tokens)


def new_error(message: str, code: str):
    return pb_utils.TritonError(message, getattr(pb_utils.TritonError, code))


def code_name(error) -> str:
    for name in ("INVALID_ARG", "UNAVAILABLE", "CANCELLED", "INTERNAL"):
        if error.code() == getattr(pb_utils.TritonError, name):
            return name
    return "INTERNAL"


def triton_error(exc: Exception, tag: bool):
    """The one place an exception becomes a Triton error: bad input is INVALID_ARG, a full
    queue UNAVAILABLE, anything else INTERNAL."""
    if isinstance(exc, InvalidRequestError):
        code = "INVALID_ARG"
    elif isinstance(exc, EngineBusyError):
        code = "UNAVAILABLE"
    else:
        code = "INTERNAL"
    return new_error(f"[{code}] {exc}" if tag else str(exc), code)


def send_error(sender, err, log):
    """On the send thread only (exspec_log)."""
    try:
        sender.send(pb_utils.InferenceResponse(output_tensors=[], error=err), flags=FINAL)
    except Exception as send_exc:
        log.warn(f"exspec: could not send an error response: {send_exc}")
