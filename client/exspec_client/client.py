"""Client: the synchronous entry point.

    client = Client("127.0.0.1:8001")                       # gRPC (default)
    with client.stream("def fib(n):", max_tokens=64) as gen:
        for delta in gen:
            print(delta.text, end="", flush=True)
    print(gen.result.summary())

    Client("http://127.0.0.1:8000", protocol="http").generate("def fib(n):")   # SSE, collected
    client.infer("def fib(n):")          # unary inference on the BLS front model exspec_unary
"""
from __future__ import annotations

import time

from . import wire
from .streams import Generation, GrpcGeneration, HttpGeneration
from .types import DEFAULT_MODEL, ExspecError, Result, sampling_json

DEFAULT_URLS = {"grpc": "127.0.0.1:8001", "http": "http://127.0.0.1:8000"}
PROTOCOLS = ("grpc", "http")


def split_url(url: str | None, protocol: str | None) -> tuple[str, str]:
    """(protocol, address): grpc://host:port and http://host:port name their protocol; a bare
    host:port takes `protocol` (gRPC by default); dns:///name:port and ipv4:a:p,b:p are gRPC
    targets balanced round robin over every server they name."""
    if url and url.startswith(wire.BALANCED_TARGETS):
        if protocol not in (None, "grpc"):
            raise ValueError(f"{url!r} is a gRPC target; use --protocol grpc")
        return "grpc", url
    if url and url.startswith("grpc://"):
        protocol, url = protocol or "grpc", url[len("grpc://"):]
    elif url and url.startswith(("http://", "https://")):
        protocol = protocol or "http"
    protocol = protocol or "grpc"
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    url = url or DEFAULT_URLS[protocol]
    if protocol == "grpc" and "://" in url:
        raise ValueError(f"{url!r} is an HTTP URL; gRPC takes host:port (Triton's gRPC port)")
    if protocol == "http" and "://" not in url:
        url = f"http://{url}"
    return protocol, url


class Client:
    def __init__(self, url: str | None = None, protocol: str | None = None,
                 model: str = DEFAULT_MODEL, unary_model: str | None = None,
                 timeout_s: float | None = None, headers: dict | None = None):
        self.protocol, self.url = split_url(url, protocol)
        self.model = model
        self.unary_model = unary_model or f"{model}_unary"
        self.timeout_s = timeout_s
        self.headers = headers

    def stream(self, prompt: str | list[int] | list[dict], *, max_tokens: int | None = None,
               temperature: float | None = None, timeout_s: float | None = None,
               stream: bool = True, **sampling) -> Generation:
        """Start one generation; iterate it for Deltas as they arrive. `sampling` takes the
        other sampling parameters (top_p, top_k, seed, stop, num_speculative_tokens, ...).
        stream=False asks for one response (still iterable, it yields one Delta)."""
        cls = GrpcGeneration if self.protocol == "grpc" else HttpGeneration
        return cls(self.url, self.model, prompt,
                   sampling_json(max_tokens, temperature, **sampling), stream=stream,
                   timeout_s=self.timeout_s if timeout_s is None else timeout_s,
                   headers=self.headers)

    def generate(self, prompt: str | list[int] | list[dict], **kwargs) -> Result:
        """stream() run to the end: the whole Result."""
        with self.stream(prompt, **kwargs) as generation:
            return generation.collect()

    def infer(self, prompt: str | list[int] | list[dict], *, max_tokens: int | None = None,
              temperature: float | None = None, timeout_s: float | None = None,
              **sampling) -> Result:
        """Unary inference (tritonclient infer()) on the non-decoupled front model."""
        if self.protocol == "grpc":
            import tritonclient.grpc as module
            client = wire.grpc_client(module, self.url)
            timeout = {"client_timeout": timeout_s or self.timeout_s}
        else:
            import tritonclient.http as module
            client = module.InferenceServerClient(
                self.url.split("://", 1)[1], network_timeout=timeout_s or self.timeout_s or 60.0)
            timeout = {}
        inputs = wire.infer_inputs(prompt, sampling_json(max_tokens, temperature, **sampling),
                                   stream=False, module=module)
        start = time.perf_counter()
        try:
            answer = client.infer(self.unary_model, inputs, headers=self.headers, **timeout)
        except module.InferenceServerException as exc:
            raise ExspecError(exc.message(), exc.status()) from None
        finally:
            client.close()
        elapsed = time.perf_counter() - start
        result = Result(latency_s=elapsed)
        result.add(wire.delta_from_arrays(answer.as_numpy, elapsed))
        return result
