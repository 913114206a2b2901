"""The engine's error types. Each becomes one kind of Triton error in the adapter."""


class InvalidRequestError(ValueError):
    """The request itself is wrong (a person can fix it); Triton: INVALID_ARG."""


class EngineBusyError(RuntimeError):
    """The wait queue is full; the client should retry later; Triton: UNAVAILABLE."""


class ModelLoadError(RuntimeError):
    """The model pair cannot be loaded or cannot work together."""
