"""The inputs of chosen decoder layers of a model, as its last forward computed them (what an
EAGLE-3 head reads of the target; design: "Proposers").

Read by forward pre-hooks on those layers: no second forward, no copy. Where a compiled region
runs several layers in one call (compiled.py), the model hands a later layer of the region the
region's output, not that layer's input; `compiled.layer_input` gives the true one, which the
region then returns beside its output.
"""
from __future__ import annotations

import weakref

import torch

from .compiled import decoder_layers, layer_input

_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class LayerInputs:
    @classmethod
    def of(cls, model, ids: tuple[int, ...]) -> "LayerInputs":
        """The one reader of these layers of `model` (engines sharing a pair share it, and the
        model's hooks stay one set)."""
        readers = _SHARED.setdefault(model, {})
        if tuple(ids) not in readers:
            readers[tuple(ids)] = cls(model, ids)
        return readers[tuple(ids)]

    def __init__(self, model, ids: tuple[int, ...]):
        layers = decoder_layers(model)
        if layers is None:
            raise ValueError(f"{type(model).__name__}: no repeated decoder layers to read inputs of")
        self.ids = tuple(ids)
        self.last: dict[int, torch.Tensor] = {}
        for index in sorted(set(self.ids)):
            layers[index].register_forward_pre_hook(self._recorder(index), with_kwargs=True)

    def _recorder(self, index: int):
        def record(layer, args, kwargs):
            given = args[0] if args else kwargs["hidden_states"]
            self.last[index] = layer_input(layer, given)
        return record

    def take(self) -> list[torch.Tensor]:
        """The chosen layers' inputs [B, T, hidden] of the model's last forward (each once)."""
        out = [self.last[i] for i in self.ids]
        self.last = {}
        return out
