"""exspec_client: talk to the exspec Triton backend over gRPC streams, HTTP generate_stream
(server-sent events) and unary infer, without torch. See Client and AsyncClient."""
from .client import Client, split_url
from .streams import Generation
from .types import Delta, ExspecError, ExspecTimeout, Result

__all__ = ["Client", "AsyncClient", "Delta", "ExspecError", "ExspecTimeout", "Generation",
           "Result", "split_url"]


def __getattr__(name):
    if name == "AsyncClient":   # asyncio and aiohttp only when asked for
        from .aio import AsyncClient
        return AsyncClient
    raise AttributeError(name)
