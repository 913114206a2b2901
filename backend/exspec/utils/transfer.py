"""Host <-> device copies of the hot path, in one place and counted (design: "The fast decode path").

On a GPU every host round trip in a step stalls the device. A step needs only two: its new
inputs go up once (`Upload`: every host int the step needs, in sections, sent as one tensor
through `Transfers.to_device`, staged in pinned memory and copied without blocking) and its
accepted counts and tokens come down once (`to_host`). Everything else is computed on the device
from those. `TransferAudit` counts what actually crossed, helper or not, so a test can hold a
step to its budget on a machine without a GPU.
"""
from __future__ import annotations

import math
import struct
import sys
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode


class Transfers:
    """The engine's counted copies between host and its device."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.h2d = 0
        self.d2h = 0

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """One host-to-device copy of a freshly built CPU tensor; on CUDA from pinned memory,
        non-blocking (the host tensor is not reused, so nothing can overwrite it in flight). On
        a CPU engine a real copy too: the device tensor is never the host buffer, as on a GPU."""
        self.h2d += 1
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=self.device.type == "cuda", copy=True)

    def ints_to_device(self, values: list[int]) -> torch.Tensor:
        """A flat int64 tensor of host ints on the device (one copy)."""
        return self.to_device(torch.tensor(values, dtype=torch.long))

    def to_host(self, tensor: torch.Tensor) -> list:
        """The step's device-to-host copy (it also waits for the step's device work)."""
        self.d2h += 1
        return tensor.tolist()


class Upload:
    """Host ints gathered for one host-to-device copy: each `add` is a section of a given shape;
    `send` copies every section up at once and returns them on the device, in their shapes
    (views of the one copy). Floats travel as their float32 bits (`float_bits`)."""

    def __init__(self):
        self._values: list[int] = []
        self._shapes: list[tuple[int, ...]] = []
        self._blocks: list[torch.Tensor] = []   # sections given as host tensors, after the ints

    def add(self, values: list[int] | torch.Tensor, *shape: int) -> int:
        """Stage `values` (row-major, `shape`); returns the section's index into `send`'s list.
        A host integer tensor (a grammar's bitmasks) is staged as it is, not as a list."""
        size = values.numel() if isinstance(values, torch.Tensor) else len(values)
        assert size == math.prod(shape), (size, shape)
        if isinstance(values, torch.Tensor):
            self._blocks.append(values.reshape(-1))
            self._shapes.append(("block", *shape))
        else:
            self._values += values
            self._shapes.append(shape)
        return len(self._shapes) - 1

    def send(self, transfers: Transfers) -> list[torch.Tensor]:
        if not self._blocks:
            return self._sections(transfers.ints_to_device(self._values))
        host = torch.cat([torch.tensor(self._values, dtype=torch.long)]
                         + [b.to(torch.long) for b in self._blocks])
        return self._sections(transfers.to_device(host))

    def _sections(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of the sent tensor: the int sections in order, then the blocks in order."""
        at, block_at = 0, len(self._values)
        sections = []
        for shape in self._shapes:
            if shape[0] == "block":
                shape = shape[1:]
                size = math.prod(shape)
                sections.append(flat[block_at:block_at + size].view(shape))
                block_at += size
            else:
                size = math.prod(shape)
                sections.append(flat[at:at + size].view(shape))
                at += size
        return sections


def float_bits(values: list[float]) -> list[int]:
    """float32 values as their int32 bit patterns, for an int64 upload (`floats_from_bits`
    reads them back on the device: exact, no rounding beyond float32's own)."""
    return list(struct.unpack(f"<{len(values)}i", struct.pack(f"<{len(values)}f", *values)))


def floats_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """The float32 values of `float_bits`' ints, on the tensor's device (a bit cast, no copy up)."""
    return bits.to(torch.int32).view(torch.float32)


# Ops that read device values on the host. Which one a read dispatches as depends on the mode
# (`.item()` is `item` under inference_mode and `_local_scalar_dense` outside it; `bool()` is
# `is_nonzero`); `nonzero` and `equal` wait for the device to learn a shape or an answer.
HOST_READS = {torch.ops.aten._local_scalar_dense, torch.ops.aten.item, torch.ops.aten.is_nonzero,
              torch.ops.aten.equal, torch.ops.aten.nonzero}
# `.to(device)`, `.cuda()`: `to` under inference_mode, `_to_copy` outside it.
MOVES = {torch.ops.aten.to, torch.ops.aten._to_copy}
# Factories whose tensor holds host data (Python lists, numpy arrays) wherever it is made.
HOST_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
READS_WITHOUT_DISPATCH = {torch.Tensor.tolist, torch.Tensor.numpy}


class TransferAudit(TorchDispatchMode):
    """Counts every host <-> device crossing inside `counting()`: host data moved to the device
    however it goes (`Transfers`, `.to(device)`, `.cuda()`, `copy_` into a device tensor,
    `torch.tensor(data, device=...)`, host data fed straight to a device op), scalars read back
    (`.item()`, `bool()`, `int()`), `.tolist()`.

    It works on a CPU-only machine, where host and device are one: the audit treats the engine's
    device as a separate, virtual one. A tensor is *host* when the block made it from host data
    (`torch.tensor`, a list index), with a factory given no device (`torch.zeros(3)`), or by ops
    on host tensors alone; every other tensor is on the device (weights, caches, factories given
    the engine's device, anything computed from a device tensor). Host data crosses once, when it
    first meets the device: a copy given a device (`.to(device, copy=True)`, what `.cuda()`
    dispatches, and what `Transfers` does), a `copy_` from it into a device tensor, or any op that
    mixes it with device tensors, which is where a `.to(device)` that the CPU makes a no-op shows.
    Reads count only on device tensors. On a GPU the same rules see the real devices;
    `torch.cuda.set_sync_debug_mode` covers the GPU itself."""

    def __init__(self):
        super().__init__()
        self.h2d = 0
        self.d2h = 0
        self.where: list[str] = []
        # the storages of the block's host tensors, by address (held, so no address is reused)
        self._host: dict[int, torch.UntypedStorage] = {}

    # -- which side a tensor is on ----------------------------------------------------------
    def is_host(self, tensor: torch.Tensor) -> bool:
        return (tensor.device.type == "cpu" and tensor.numel() > 0
                and tensor.untyped_storage().data_ptr() in self._host)

    def mark(self, tensors, host: bool) -> None:
        """Record the tensors' storages as host ones, or as on the device from now on."""
        for tensor in tensors:
            if tensor.device.type == "cpu" and tensor.numel() > 0:
                storage = tensor.untyped_storage()
                if host:
                    self._host[storage.data_ptr()] = storage
                else:
                    self._host.pop(storage.data_ptr(), None)

    def count_crossing(self, direction: str, what: str, times: int = 1) -> None:
        """`times` crossings ("h2d" or "d2h"), noted with the op and the line that made them."""
        setattr(self, direction, getattr(self, direction) + times)
        self.where.append(f"{direction} {what} at {_caller()}")

    # -- the dispatch rules (class doc) ------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors(args) + _tensors(kwargs.values())
        host = {t.untyped_storage().data_ptr(): t for t in inputs if self.is_host(t)}
        out = func(*args, **kwargs)
        outputs = _tensors((out,))
        name = func.__name__
        if func.overloadpacket in HOST_READS:
            if not host:
                self.count_crossing("d2h", name)
        elif func is torch.ops.aten.lift_fresh.default:
            self.mark(outputs, host=True)
        elif host and len(host) < len({t.untyped_storage().data_ptr() for t in inputs}):
            if func.overloadpacket is torch.ops.aten.copy_ and self.is_host(args[0]):
                self.count_crossing("d2h", name)   # device values copied into a host tensor
            else:   # host data meets the device: it is there from now on
                self.count_crossing("h2d", f"{name} (host data into a device op)", len(host))
                self.mark(host.values(), host=False)
        elif host:
            if func.overloadpacket in MOVES and _device_given(args, kwargs):
                self.count_crossing("h2d", f"{name} (to a device)")
                self.mark(outputs, host=False)   # `.to` without a copy returns its input
            else:
                self.mark(outputs, host=True)
        elif any(t.device.type != "cpu" for t in inputs) and any(t.device.type == "cpu" for t in outputs):
            self.count_crossing("d2h", name)   # a GPU tensor copied to the host (`.cpu()`)
            self.mark(outputs, host=True)
        return out

    @contextmanager
    def counting(self):
        """Count inside the block: the dispatch mode and its Python-level watch (`_Calls`)."""
        with _Calls(self), self:
            yield self


class _Calls(TorchFunctionMode):
    """What only the Python call shows: factories (at dispatch every factory has a device; one
    given none makes a host tensor, and host data given a device, `torch.tensor(data,
    device=...)`, is a copy up) and `.tolist()` / `.numpy()`, which read without dispatching."""

    CONSTRUCTORS = _device_constructors()

    def __init__(self, audit: "TransferAudit"):
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS_WITHOUT_DISPATCH and not self.audit.is_host(args[0]):
            self.audit.count_crossing("d2h", func.__name__)
        out = func(*args, **kwargs)
        if func in self.CONSTRUCTORS and isinstance(out, torch.Tensor):
            if kwargs.get("device") is None:
                self.audit.mark([out], host=True)
            elif (func in HOST_DATA and out.numel() > 0   # no data, nothing to copy
                  and not (args and isinstance(args[0], torch.Tensor))):
                self.audit.count_crossing("h2d", f"{func.__name__}(data, device=...)")
                self.audit.mark([out], host=False)
        return out


def _tensors(values) -> list[torch.Tensor]:
    """The tensors among an op's arguments or results (in lists and tuples too: `cat`'s), with
    less per-op cost than a general tree walk, which the audit pays on every op."""
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out += [v for v in value if isinstance(v, torch.Tensor)]
    return out


def _device_given(args, kwargs) -> bool:
    return kwargs.get("device") is not None or any(isinstance(a, torch.device) for a in args)


def _caller() -> str:
    """The innermost frame outside torch and this module: where a crossing happened."""
    frame = sys._getframe(2)
    while frame is not None and ("/torch/" in frame.f_code.co_filename
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno}"
