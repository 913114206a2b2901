"""exspec_unary: unary inference on the decoupled exspec model, through BLS.

Forwards the request's inputs and parameters to the decoupled model with stream=false, which
answers with exactly one response (DESIGN §4), and returns that response's outputs or its error.
Nothing is parsed here: the decoupled model validates everything and its INVALID_ARG message
comes back unchanged.
"""
import json
import re

import numpy as np
import triton_python_backend_utils as pb_utils


TAG_PARAMETER = "exspec_tag_error_codes"
_TAG = re.compile(r"^\[(INVALID_ARG|UNAVAILABLE|CANCELLED|INTERNAL)\] ")


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = config.get("parameters", {})
        self.target = params.get("decoupled_model", {}).get("string_value", "exspec")
        self.inputs = [i["name"] for i in config["input"]]
        self.outputs = [o["name"] for o in config["output"]]

    def execute(self, requests):
        return [self._forward(request) for request in requests]

    def _forward(self, request):
        stream = pb_utils.get_input_tensor_by_name(request, "stream")
        if stream is not None and bool(np.asarray(stream.as_numpy()).reshape(-1)[0]):
            return _error("stream=true needs a streaming call: use the decoupled model "
                          f"{self.target!r} (gRPC stream or HTTP generate_stream)",
                          pb_utils.TritonError.INVALID_ARG)
        tensors = [t for t in (pb_utils.get_input_tensor_by_name(request, name)
                               for name in self.inputs if name not in ("stream", "max_tokens"))
                   if t is not None]
        parameters = _bls_parameters(request.parameters())
        # LiteLLM's unary path (TensorRT-LLM's schema) sends max_tokens as an INT32 input
        max_tokens = pb_utils.get_input_tensor_by_name(request, "max_tokens")
        if max_tokens is not None:
            values = np.asarray(max_tokens.as_numpy()).reshape(-1)
            if values.size != 1:
                return _error(f"max_tokens must hold exactly one INT32, got {values.size} values",
                              pb_utils.TritonError.INVALID_ARG)
            if str(parameters.get("max_tokens", values[0])) != str(values[0]):
                return _error(f"max_tokens given twice with different values (input: {values[0]}, "
                              f"parameter: {parameters['max_tokens']})", pb_utils.TritonError.INVALID_ARG)
            parameters["max_tokens"] = int(values[0])
        forwarded = pb_utils.InferenceRequest(
            model_name=self.target, inputs=tensors,
            requested_output_names=list(request.requested_output_names() or self.outputs),
            parameters=parameters)
        result = None
        for response in forwarded.exec(decoupled=True):
            if response.has_error():
                return _untagged(response.error().message())
            if response.output_tensors():
                result = response
        if result is None:
            return _error(f"{self.target!r} sent no response", pb_utils.TritonError.INTERNAL)
        return pb_utils.InferenceResponse(output_tensors=result.output_tensors())


def _bls_parameters(raw):
    """BLS takes bool/int/str parameter values; numbers the client sent as JSON floats go on
    as their decimal string, which the exspec model parses back exactly."""
    params = json.loads(raw or "{}")
    params = {k: v if isinstance(v, (bool, int, str)) else json.dumps(v) for k, v in params.items()}
    params[TAG_PARAMETER] = True
    return params


def _untagged(message):
    """BLS returns an error's message with the code INTERNAL; the exspec model, asked through
    TAG_PARAMETER, put the real code in front of the message: restore it."""
    match = _TAG.match(message)
    if not match:
        return _error(message, pb_utils.TritonError.INTERNAL)
    return _error(message[match.end():], getattr(pb_utils.TritonError, match.group(1)))


def _error(message, code):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))
