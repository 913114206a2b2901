"""Host <-> device copies of the hot path, in one place and counted (design: "The fast decode path").

On a GPU every host round trip in a step stalls the device. A step needs only two: its new
inputs go up once (`to_device`, staged in pinned memory and copied without blocking) and its
accepted counts and tokens come down once (`to_host`). Everything else is computed on the device
from those. `TransferAudit` counts what actually crossed, helper or not (`.item()`, `bool()`,
`.tolist()`, tensors built from host data), so a test can hold a step to its budget.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Transfers:
    """The engine's counted copies between host and its device."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.h2d = 0
        self.d2h = 0

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """One host-to-device copy of a freshly built CPU tensor; on CUDA from pinned memory,
        non-blocking (the host tensor is not reused, so nothing can overwrite it in flight)."""
        self.h2d += 1
        if self.device.type == "cpu":
            return host
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def ints_to_device(self, values: list[int]) -> torch.Tensor:
        """A flat int64 tensor of host ints on the device (one copy)."""
        return self.to_device(torch.tensor(values, dtype=torch.long))

    def to_host(self, tensor: torch.Tensor) -> list:
        """The step's device-to-host copy (it also waits for the step's device work)."""
        self.d2h += 1
        return tensor.tolist()


# Ops that read device values on the host. Which one a read dispatches as depends on the mode
# (`.item()` is `item` under inference_mode and `_local_scalar_dense` outside it; `bool()` is
# `is_nonzero`); `nonzero` and `equal` wait for the device to learn a shape or an answer.
HOST_READS = {torch.ops.aten._local_scalar_dense, torch.ops.aten.item, torch.ops.aten.is_nonzero,
              torch.ops.aten.equal, torch.ops.aten.nonzero}


class TransferAudit(TorchDispatchMode):
    """Counts every host <-> device crossing inside its block: host data turned into a tensor
    (`torch.tensor`, a host-to-device copy on a GPU engine), scalars read back (`.item()`,
    `bool()`, `int()`), `.tolist()` and explicit cross-device copies. Works on CPU, so the budget
    is tested without a GPU; `torch.cuda.set_sync_debug_mode` covers the GPU itself."""

    def __init__(self):
        super().__init__()
        self.h2d = 0
        self.d2h = 0
        self.where: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if func is torch.ops.aten.lift_fresh.default:
            self.h2d += 1
            self.where.append(name)
        elif func.overloadpacket in HOST_READS:
            self.d2h += 1
            self.where.append(name)
        return func(*args, **(kwargs or {}))

    @contextmanager
    def counting(self):
        """Enter the dispatch mode and also catch `.tolist()` (which does not dispatch)."""
        original = torch.Tensor.tolist
        audit = self

        def tolist(tensor):
            audit.d2h += 1
            audit.where.append("tolist")
            return original(tensor)

        torch.Tensor.tolist = tolist
        try:
            with self:
                yield self
        finally:
            torch.Tensor.tolist = original
