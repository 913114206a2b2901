"""The compiled decode path (design: "The fast decode path"): the step's forwards through
torch.compile, warmed up before the engine is ready.

What is compiled: every forward of a step (the draft's first forward of 1-2 tokens per row, its
later one-token forwards, its catch-up forward, and the verification of k + 1 tokens); a
prefill stays eager (its widths are the prompts').

Regional compilation: what is compiled is the model's repeated decoder layer, not the whole
model. One compiled function runs every layer: parameters are graph inputs, and each layer gets
a view of its own cache layer (kv.LayerCache) instead of the whole cache indexed by its
`layer_idx`, so all layers of a model, however many, share one graph (the draft, of other
shapes, gets its own). The layers' tensors go in as one flat tuple per region, run through one
template layer (a copy with meta tensors) by `torch.func.functional_call`, not as the layer
modules themselves: Dynamo guards every attribute of every module it is handed (~2,900 guards a
graph on the deep-narrow pair) and reads each parameter through its module before each call,
which cost ~0.6 ms a region call there, a fifth of a compiled forward. Embedding, mask building, final norm and lm_head
stay eager: cheap ops, once per forward. This cuts the warm-up by the layer count (a whole-model
compile traces and generates code for every layer), the point of the 60 s budget. A model
without one ModuleList of identical decoder layers falls back to compiling the whole model
(`CompiledForward.regional` says which; the engine logs it).

Regions of several layers: each compiled call costs ~0.15 ms on a CPU before it computes
anything (Dynamo's entry and guards, the wrappers), which in a 36-layer model is most of what
compiling saves. So a deep model's region runs several consecutive layers (at most MAX_REGIONS
calls a forward; compile time grows with the layers a region traces, so a model of up to
SHALLOW layers keeps one per region). That is sound only where the model's loop feeds each layer the
previous one's output and the same other arguments; the first forward (eager) checks it and
every later one asserts it (`_Region`), so models whose layer types get masks of their own keep
one layer per region.

Shapes are symbolic (`dynamic=True`, without duck shaping): batch, query width and cache width
are symbols, so a step with more rows, another k or longer rows reuses the same graph. Torch
still specialises a size of 1 (one row, one query token), so the warm-up runs each model at 1
and 2 rows through a fixed schedule of steps that meets every forward kind once: 4 graphs per
model with EQSPEC; 1 with EXSPEC, whose one-token forwards are fed as two (a pad first: a pad
costs its block store nothing) and whose first compile keeps even one row symbolic
(`_rows_symbolic_from_one`), and afterwards nothing recompiles (tests/engine/test_compiled.py
counts it with Dynamo's own counters; test_compiled_inductor.py with inductor); a forward that
compiles after the warm-up anyway logs a warning naming its shape.

Nothing that varies per step reaches the graph as a Python int: the KV layouts hand the model
device tensors (EXSPEC's block tables, slots and masks, kv/blocks.py; EQSPEC's 2D mask, or its
4D masks by layer type for sliding-window models, built outside the graph: a window never
reaches it).

CUDA graphs (CUDA and EXSPEC's static block store only; unverified until `make gpu-check` has
run on a GPU): the same compile with mode "reduce-overhead", i.e. inductor's cudagraph trees,
chosen over hand-made torch.cuda.CUDAGraph capture because they already copy inputs into static
buffers, key graphs by shape and check input addresses; a hand-made capture would duplicate that
and still need a graph per (rows, query width, cache bucket). The store's buffers are marked as
static addresses (kv.blocks._buffer) so their in-place writes do not make it skip a graph. Each
forward starts a new replay generation; what outlives it is cloned (the whole-model fallback's
logits; regionally the lm_head is eager and its logits are new tensors anyway). The warm-up
runs its schedule twice (a cudagraph tree captures a graph at its second call) and the engine
refuses to load if any graph was skipped or none captured (`cuda_graph_counts`).

Static shapes, so that nothing is captured after READY: a CUDA graph is per concrete (rows,
tokens, KV columns), so after its schedule the warm-up runs every shape a decode forward on the
block store can take that it has not met (`static_shapes`: rows in buckets, 1, 2, 4, then
multiples of 8, a forward of other rows padded with pad rows by the runner, since each capture
costs a forward in the warm-up; widths 2 .. k + 1; every table bucket up to
max_model_len), each as one forward of new rows in a block of their own whose table is padded
with the scratch block to the bucket; the engine refuses to load if one is missing. After READY
a forward of any other shape runs eagerly, logged once per shape. A proposer's catch-up forward
(a draft's, an EAGLE head's) after more than k plain steps is wider than k + 1: the runner
feeds it in pieces of at most k + 1 columns through the built graphs (`widest`). The shapes'
count grows with max_batch_size / 8 x log2(max_model_len), hence max_model_len is worth
setting to what a deployment needs. On a CPU
`STATIC_SHAPES` turns the same rule on (tests/engine/test_compiled_session.py checks that a random
session meets no shape the warm-up did not build).
"""
from __future__ import annotations

import copy
import os
import threading
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch._dynamo.utils
from tqdm.auto import tqdm
from transformers.cache_utils import Cache

from ..config import FLEX_ATTENTION, log
from ..errors import ModelLoadError
from ..kv.blocks import BLOCK_SIZE, row_buckets, table_bucket, table_buckets
from ..kv.padded import LayerCache
from ..params import SamplingParams
from ..utils.text_locale import utf8_text
from .packed_head import pack_head
from .packed_linears import PackedLinears, pack_template

# "inductor" generates C++ (CPU) or Triton (GPU) kernels. Dynamo's guards, hence recompiles and
# graph breaks, mostly do not depend on the backend, so most tests use "eager" (no C++); inductor's
# lowering may add shape guards of its own, which tests/engine/test_compiled_inductor.py checks.
COMPILE_BACKEND = "inductor"

# Static shapes (a graph per concrete shape, every one built in the warm-up) are what CUDA graphs
# need; on a CPU, where inductor's symbolic graphs cover every shape, the tests turn them on to
# check that the warm-up builds every shape a serving session meets.
STATIC_SHAPES = False


def static_shapes_on(device) -> bool:
    """Whether compiled forwards on EXSPEC's block store get a graph per concrete shape, each
    built in the warm-up: CUDA graphs' rule, on a CPU only where STATIC_SHAPES asks."""
    return torch.device(device).type == "cuda" or STATIC_SHAPES


class CompiledForward:
    """A model's decode forward through torch.compile: its decoder layers regionally (one
    compiled function for all of them) when it has them, else the whole model."""

    # Graphs per model: {1, more} rows x {1, more} query tokens (EXSPEC: one, its one-token
    # forwards fed as two and one row symbolic). Compiled code is cached per code object and torch caps that
    # cache at 8 entries by default (past that it silently runs eager); the cap is raised to
    # room for a few.
    RECOMPILE_LIMIT = 64

    def __init__(self, model, cuda_graphs: bool = False, in_place: bool = False):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   self.RECOMPILE_LIMIT)
        # No duck shaping: equal sizes at the first compile (two query tokens and two KV heads,
        # say) would share one symbol, and the graph would hold only while they stay equal
        torch.fx.experimental._config.use_duck_shape = False
        compile_cache_dir()
        utf8_text()   # inductor reads UTF-8 templates; Triton's stub leaves the C locale (ASCII)
        self.model = model
        self.cuda_graphs = cuda_graphs
        self.active = False   # True while this object runs a forward: the layers dispatch on it
        # set by warm_up: from then on a forward that compiles, or with CUDA graphs captures a
        # shape the warm-up did not meet, says so in the log (once per shape)
        self.warm = False
        self.shapes: set[tuple[int, int, int]] = set()   # (rows, tokens, KV columns) met
        # a graph per concrete shape (CUDA graphs): after READY only the shapes the warm-up
        # built run through it, any other runs eagerly (`eager_shapes`), so nothing is
        # captured after READY (warm_up builds every shape a step can take, `static_shapes`)
        self.static_shapes = cuda_graphs
        # EXSPEC's block store (set by the engine): one graph for every row count, one row
        # included (`_rows_symbolic_from_one`); its query widths are never 1 (a one-token forward
        # is fed as two), which HF's attention needs known where it tests `width > 1`
        self.rows_symbolic_from_one = False
        # the block store read in place (kv/in_place.py): a graph per query width, each dynamic
        # in its rows from IN_PLACE_ROWS on, every one built in the warm-up (`shapes_to_build`)
        self.in_place = in_place
        self.eager_shapes: set[tuple[int, int, int]] = set()
        self.eager_forwards = 0
        # set by warm_up where a graph is built per width (static shapes, read in place): the
        # widest query built (k + 1); the runner feeds a wider forward in pieces through them
        self.widest: int | None = None
        self.features: tuple[int, torch.dtype] | None = None   # an EAGLE head's feature input
        self.cpp_wrapper = False   # inductor's C++ wrappers (regions of several layers on a CPU)
        self.packed_linears: PackedLinears | None = None   # a CPU: the layers' linears (packed_linears.py)
        # CUDA graphs: inductor's cudagraph trees (mode "reduce-overhead"), see cuda_graph_counts
        options = {"mode": "reduce-overhead"} if cuda_graphs else {}
        if cuda_graphs:   # a graph per shape is the design (static_shapes), not a warning's matter
            torch._inductor.config.triton.cudagraph_dynamic_shape_warn_limit = None
        layers = decoder_layers(model)
        # a layer whose forward another hook wraps (accelerate's, under device_map) would lose
        # it in the region, which calls the class's forward
        hooked = layers is not None and any(_hooked(layer) for layer in layers)
        self.regional = layers is not None and not hooked
        self.why_whole = ("its layers' forwards are wrapped by a hook" if hooked
                          else "no repeated decoder layers found")
        if in_place and not self.regional:
            raise ModelLoadError(f"attention_backend {FLEX_ATTENTION}: {type(model).__name__} would compile "
                                 f"whole ({self.why_whole}), and reading its KV in place needs a "
                                 f"graph per query width of its decoder layers; unset attention_backend")
        # the lm_head runs eagerly between the regions: on a CPU it gets weights packed for
        # small batches, so a k + 1 verification's head costs about one token's (packed_head.py)
        self.packed_head = self.regional and not cuda_graphs and pack_head(model, lambda: self.active)
        if self.regional:
            self.layers = list(layers)
            self.layer_class = type(layers[0]).__name__
            self.layers_per_region: int | None = None   # set by the first forward (_probe)
            self.why_one_per_region = ""
            self._options = options
            self.compiled = None   # made once the probe has set layers_per_region
            self._probed: list | None = None   # the probe forward's (args, kwargs, output) per layer
            self._chunk_out = None              # the current region's output, for its other layers
            self._chunk_inputs: tuple = ()      # and its other layers' inputs
            for index, layer in enumerate(layers):
                region = vars(layer).get("forward")
                if isinstance(region, _Region):   # another engine's compiled forward of this model
                    region.owners.append(self)
                else:
                    layer.forward = _Region(self, layer, index)
        else:
            self.compiled = torch.compile(model, dynamic=True, backend=COMPILE_BACKEND, **options)

    def describe(self) -> str:
        name = type(self.model).__name__
        graphs = ", CUDA graphs" if self.cuda_graphs else ""
        if not self.regional:
            return f"{name}: whole model ({self.why_whole}){graphs}"
        per = self.layers_per_region or 1
        grouping = (f"{per} layers per region" if per > 1 else
                    "one layer per region" + (f" ({self.why_one_per_region})" if self.why_one_per_region else ""))
        wrappers = ", C++ wrappers" if self.cpp_wrapper else ""
        head = ", lm_head packed for small batches (oneDNN)" if self.packed_head else ""
        head += f", {self.packed_linears.describe()}" if self.packed_linears and self.packed_linears.count else ""
        in_place = ", KV read in place (FlexAttention, a graph per query width)" if self.in_place else ""
        return (f"{name}: regional, one graph for its {self.layer_class} layers, {grouping}"
                f"{wrappers}{head}{in_place}{graphs}")

    def __call__(self, **inputs):
        if not self.warm:
            if not self._probing():   # the probe runs eagerly: it builds nothing
                self.shapes.add(self.key(_shape(inputs)))
            features = inputs.get("features")
            if features is not None:   # its size and dtype, for the warm-up's other shapes
                self.features = (features.shape[-1], features.dtype)
            # before READY, where it compiles: the model's floats (a norm's epsilon, attention's
            # scale) become the graphs' constants; left symbolic (dynamic=True's default),
            # inductor failed to turn one into a tensor and Dynamo traced and compiled the frame
            # again (13 s of the deep-narrow pair's 95 s warm-up; 3 restarts of a whole model)
            with torch._dynamo.config.patch(specialize_float=True):
                return self._forward(inputs)
        graphs, shape = dynamo_counts()["graphs"], _shape(inputs)
        if (self.static_shapes or self.in_place) and self.key(shape) not in self.shapes:
            if shape not in self.eager_shapes:
                log.info("exspec: compiled decode path: %s ran a shape the warm-up did not build "
                         "eagerly (%d rows, %d tokens, %d KV columns): nothing is captured after "
                         "READY", type(self.model).__name__, *shape)
            self.eager_shapes.add(shape)
            self.eager_forwards += 1
            return self.model(**inputs)
        out = self._forward(inputs)
        compiled = dynamo_counts()["graphs"] - graphs
        captured = self.cuda_graphs and self.key(shape) not in self.shapes
        if compiled or captured:
            what = ", ".join(([f"compiled {compiled} new graph(s)"] if compiled else [])
                             + (["captured its CUDA graphs"] if captured else []))
            log.warning("exspec: compiled decode path: %s met a shape after the warm-up (%d rows, "
                        "%d tokens, %d KV columns) and %s; the requests of this step waited for it",
                        type(self.model).__name__, *shape, what)
        self.shapes.add(self.key(shape))
        return out

    def key(self, shape: tuple[int, int, int]) -> tuple[int, ...]:
        """The graph a forward of `shape` runs: one per shape with static shapes; reading in
        place, whatever its KV columns (the whole store's), one per row count and query width,
        and on a CPU the rows from IN_PLACE_ROWS on share a dynamic one."""
        rows, tokens, columns = shape
        if not self.in_place:
            return shape
        return (rows, tokens) if self.static_shapes else (min(rows, IN_PLACE_ROWS), tokens)

    def reads_in_place(self, rows: int, tokens: int) -> bool:
        """Whether a forward of `rows` x `tokens` runs a compiled graph that reads the store
        in place (its mask is then a BlockMask); the probe and, after the warm-up, a shape
        it did not build run eagerly and read gathered blocks instead."""
        return (self.in_place and not self._probing()
                and (not self.warm or self.key((rows, tokens, 0)) in self.shapes))

    def _probing(self) -> bool:
        return self.regional and self.layers_per_region is None

    def run_region(self, first: int, caches, args, kwargs):
        """Runs the region of layer `first` through its compiled function: one for every
        region; reading in place, one per query width (a code object each, so that automatic
        dynamic shapes make only their rows symbolic)."""
        width = (args[0] if args else kwargs["hidden_states"]).shape[1] if self.in_place else None
        if width not in self.compiled:
            name = f"_run_layers_{width}_wide" if self.in_place else None
            self.compiled[width] = torch.compile(_own_code(_run_layers, name),
                                                 dynamic=None if self.in_place else True,
                                                 backend=COMPILE_BACKEND, options=self._compile_options)
        call = (self.compiled[width], self.template, self.tensor_names, self.region_tensors[first],
                caches, args, kwargs)
        if self.warm or not self.rows_symbolic_from_one or self.in_place or self.static_shapes:
            return call[0](*call[1:])
        return _rows_symbolic_from_one(call, args, kwargs)

    def _forward(self, inputs):
        if self.cuda_graphs:
            # a new replay generation: the previous forward's graph outputs may be overwritten,
            # which is why nothing of theirs outlives a forward (the logits are cloned)
            torch.compiler.cudagraph_mark_step_begin()
        if not self.regional:
            out = self.compiled(**inputs)
            if self.cuda_graphs:
                out.logits = out.logits.clone()
            return out
        if self.layers_per_region is None:
            return self._probe(inputs)
        self.active = True
        try:   # the layers replay graphs; the lm_head after them is eager, its logits are new
            return self.model(**inputs)
        finally:
            self.active, self._chunk_out, self._chunk_inputs = False, None, ()

    def _probe(self, inputs):
        """The first forward, eager: it records what the model hands each layer, and sets how
        many consecutive layers one compiled region runs. Several only when each layer's input
        is the previous layer's output and every other argument is the very object the previous
        layer got (not so where layer types get their own masks, say), and the model has more
        than SHALLOW layers; then the number is the smallest divisor of the layer count that
        keeps a forward to MAX_REGIONS compiled calls."""
        self._probed = []
        try:
            out = self.model(**inputs)
            chained = all(_same_call(self._probed[i], self._probed[i + 1])
                          for i in range(len(self._probed) - 1))
        finally:
            probed, self._probed = self._probed, None
        count = len(self.layers)
        if len(probed) != count:
            chained, self.why_one_per_region = False, f"the model ran {len(probed)} of {count} layers"
        elif not chained:
            self.why_one_per_region = "its layers get different arguments"
        self.layers_per_region = (1 if not chained or count <= SHALLOW else
                                  min(d for d in range(1, count + 1) if count % d == 0 and count // d <= MAX_REGIONS))
        self._compile_regions()
        return out

    def _compile_regions(self) -> None:
        # C++ instead of Python wrappers for regions of several layers on a CPU: there the
        # Python that calls each kernel costs more than the kernels (deep-narrow, B = 1: 2.1-2.5x
        # eager per forward instead of 1.9-2.3x), for ~20% more compile time. CUDA graphs
        # (options set) replay without any wrapper.
        self.cpp_wrapper = (not self._options and COMPILE_BACKEND == "inductor" and self.layers_per_region > 1
                            and next(self.model.parameters()).device.type == "cpu")
        # no guards on the template's attributes: it is this model's own copy, which nothing
        # changes, and its regions have a code object of their own (no other model's template
        # can reach their graphs); what is guarded is the tensors and the arguments
        options = {"guard_filter_fn": _not_on_modules}
        if self.cpp_wrapper:
            options["cpp_wrapper"] = True
            # the wrapper (glue, ~100 KB of C++ for 9 layers) at -O1 apart from its -O3
            # kernels, not all of it at -O3: a shorter build, forwards as fast
            options["cpp_wrapper_build_separate"] = True
        if "mode" in self._options:   # a mode's inductor options, as torch takes one or the other
            from torch._inductor import list_mode_options
            options.update(list_mode_options(self._options["mode"]))
        self._compile_options = options
        # reading in place, inductor's CPU FlexAttention template builds only with the query
        # width static (kv/in_place.py): a function per width, made at its first forward
        self.compiled = {}   # what run_region made: query width (None: any) -> function
        self.template, self.tensor_names = _template_of(self.layers[0])
        # a CPU: the layers' linears through their oneDNN-packed copies where that is faster
        # (timed in the warm-up)
        if not self._options and next(self.model.parameters()).device.type == "cpu":
            names = pack_template(self.template, self.layers[0])
            self.packed_linears = PackedLinears(self.layers, names) if names else None
        per = self.layers_per_region
        # each region's tensors, collected once (the engine never moves a loaded model): read
        # through the modules at every call, they cost more than a small region computes
        self.region_tensors = {
            first: tuple(t for layer in self.layers[first:first + per]
                         for t in _layer_tensors(layer, self.tensor_names))
            for first in range(0, len(self.layers), per)}
        if self.cuda_graphs:   # weights: static inputs for cudagraph trees (no copy per replay),
            for tensors in self.region_tensors.values():   # guarded by shape, not identity
                for tensor in tensors:
                    torch._dynamo.mark_static_address(tensor, guard=False)


def _own_code(fn, name: str | None = None):
    """`fn` with a code object of its own: Dynamo keeps compiled code, and its guards, per code
    object. `name`: its own name too, where it must not share what Dynamo remembers by (file,
    line, name): which sizes automatic dynamic shapes made symbolic."""
    code = fn.__code__.replace(co_name=name) if name else fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _not_on_modules(guards) -> list[bool]:
    """Keep a guard unless it checks an nn.Module's attributes (the template's, in a region)."""
    return [not guard.orig_guard.source.is_unspecialized_nn_module() for guard in guards]


def _layer_tensors(layer, names: tuple[str, ...]) -> list[torch.Tensor]:
    """A layer's parameters and buffers in `names`' order."""
    own = dict(layer.named_parameters())
    own.update(layer.named_buffers())
    return [own[name] for name in names]


def _template_of(layer) -> tuple[torch.nn.Module, tuple[str, ...]]:
    """A copy of `layer` that the regions run every layer's tensors through: its own tensors on
    the meta device (no memory), without the hooks and the `_Region` forward put on the layer
    (the copy calls its class's forward); and the names of the tensors it takes."""
    names = tuple(n for n, _ in layer.named_parameters()) + tuple(n for n, _ in layer.named_buffers())
    memo = {id(vars(layer).get("forward")): None}
    for module in layer.modules():
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if tensor is not None:
                memo[id(tensor)] = type(tensor)(torch.empty_like(tensor, device="meta")) \
                    if isinstance(tensor, torch.nn.Parameter) else torch.empty_like(tensor, device="meta")
        for name, hooks in vars(module).items():
            if name.endswith("hooks") and isinstance(hooks, dict):
                memo[id(hooks)] = type(hooks)()
    template = copy.deepcopy(layer, memo)
    vars(template).pop("forward", None)
    return template, names


def _shape(inputs) -> tuple[int, int, int]:
    """A forward's (rows, tokens, KV columns): what a compiled graph or a CUDA graph is for."""
    rows, tokens = inputs["input_ids"].shape
    mask = inputs.get("attention_mask")
    if isinstance(mask, dict):
        mask = next(iter(mask.values()))
    return rows, tokens, 0 if mask is None else mask.shape[-1]


def decoder_layers(model) -> torch.nn.ModuleList | None:
    """The model's repeated decoder layers: the ModuleList of its base model that holds
    num_hidden_layers modules of one class (`model.model.layers`, GPT-2's `transformer.h`, ...),
    or None."""
    count = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
    for child in model.base_model.children():
        if (isinstance(child, torch.nn.ModuleList) and len(child) == count
                and len({type(layer) for layer in child}) == 1):
            return child
    return None


def _hooked(layer) -> bool:
    forward = vars(layer).get("forward")
    return forward is not None and not isinstance(forward, _Region)


# A model of at most SHALLOW layers keeps one layer per region (compile time grows with the
# layers a region traces, and the demo pair's is what the 60 s warm-up budget covers); a deeper
# one makes at most MAX_REGIONS compiled calls a forward (each costs ~0.15-0.25 ms of Dynamo's
# entry, guards and wrappers on a CPU, whatever it computes).
SHALLOW = 8
MAX_REGIONS = 4


def _hidden(output):
    """A layer's output as the next layer's input: the hidden states (first of a tuple)."""
    return output[0] if isinstance(output, tuple) else output


def _run_layers(template, names, tensors, caches, args, kwargs):
    """The compiled region: consecutive decoder layers' forwards, each the template layer's
    (its class's) with that layer's tensors (`tensors`: the region's, `names`' order, layer after
    layer), all given the region's first layer's arguments, except that each gets its own cache
    layer (caches[j] where the whole cache was) and each later one is fed the previous one's
    output. Returns the last output and each later layer's input (layer_inputs.py reads them;
    they exist anyway, as the residual stream)."""
    out, inputs, count = None, [], len(names)
    for j, cache in enumerate(caches):
        layer_args = [cache if isinstance(a, Cache) else a for a in args]
        if out is not None:
            layer_args[0] = _hidden(out)
            inputs.append(layer_args[0])
        layer_kwargs = {name: cache if isinstance(v, Cache) else v for name, v in kwargs.items()}
        own = dict(zip(names, tensors[j * count:(j + 1) * count]))
        out = torch.func.functional_call(template, own, tuple(layer_args), layer_kwargs)
    return out, tuple(inputs)


def _rows_symbolic_from_one(call, args, kwargs):
    """A region's call before READY (where it compiles) with its row count symbolic even at one
    row: torch would give one row a graph of its own (it specialises sizes 0 and 1), so a model
    compiled two, each a C++ build on a CPU; torch's size-oblivious shapes (a dynamic-shapes mode
    of vLLM's) make one graph for every row count (the warm-up 18-32% shorter on a 2-core CPU).
    Only the rows: any other size of 1 (a mask's head dimension, which broadcasts) stays
    static, as torch would have made it."""
    for t in (*args, *kwargs.values()):
        if isinstance(t, torch.Tensor):
            for dim in range(1, t.dim()):
                if t.shape[dim] == 1:
                    torch._dynamo.mark_static(t, dim)
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        return call[0](*call[1:])


def layer_input(layer, given):
    """A decoder layer's input during a forward: `given` (what the model handed it), except in a
    compiled region of several layers, where a later layer is handed the region's output and its
    own input is what the region recorded."""
    region = vars(layer).get("forward")
    owner = region.running() if isinstance(region, _Region) else None
    if owner is None or not owner.active:
        return given
    per = owner.layers_per_region
    offset = region.index % per
    return given if offset == 0 else owner._chunk_inputs[offset - 1]


def _same_call(first, then) -> bool:
    """The probe's test of two consecutive layers' calls: the second is fed the first's output,
    and every other argument is the same object."""
    (args, kwargs, out), (next_args, next_kwargs, _) = first, then
    return (len(args) == len(next_args) and len(args) > 0 and next_args[0] is _hidden(out)
            and all(a is b for a, b in zip(args[1:], next_args[1:]))
            and kwargs.keys() == next_kwargs.keys()
            and all(kwargs[name] is next_kwargs[name] for name in kwargs))


class _Region:
    """A decoder layer's forward: eager unless its model runs a compiled decode forward; then
    the first layer of each region runs the region's layers through the shared compiled function
    (each with the cache argument replaced by its own cache layer), and the region's other layers
    hand on that output, after checking they were given what the first layer was. Engines
    that share a model (another configuration of its compiled path, a benchmark's cells) each
    own a CompiledForward of it: the one running a forward is the one it serves."""

    def __init__(self, owner: CompiledForward, layer, index: int):
        self.owners = [owner]
        self.eager = layer.forward
        self.layer = layer
        self.index = index

    def running(self) -> CompiledForward | None:
        """The owner whose forward (or probe) is running, if any."""
        return next((o for o in self.owners if o.active or o._probed is not None), None)

    def __call__(self, *args, **kwargs):
        owner = self.running()
        if owner is None:
            return self.eager(*args, **kwargs)
        if owner._probed is not None:
            out = self.eager(*args, **kwargs)
            owner._probed.append((args, kwargs, out))
            return out
        if not owner.active:
            return self.eager(*args, **kwargs)
        per = owner.layers_per_region
        first = self.index - self.index % per
        if self.index != first:
            start_args, start_kwargs, out = owner._chunk_out
            if not _same_call((start_args, start_kwargs, out), (args, kwargs, None)):
                raise RuntimeError(f"compiled regions: layer {self.index} was given other arguments "
                                   f"than layer {first} of its region")
            return out
        cache = next((v for v in (*args, *kwargs.values()) if isinstance(v, Cache)), None)
        caches = tuple(self._own(cache, first + j) for j in range(per))
        out, inputs = owner.run_region(first, caches, args, kwargs)
        if per > 1:
            owner._chunk_out = (args, kwargs, out)
            owner._chunk_inputs = inputs
        return out

    @staticmethod
    def _own(cache, index: int):
        """Layer `index`'s cache layer, where its forward would take the whole cache."""
        return LayerCache(cache, index) if isinstance(cache, Cache) else cache


def cuda_graph_counts() -> dict[str, int]:
    """CUDA graphs recorded by cudagraph trees on the current device, and the compiled graphs
    it skipped (it silently runs those without a graph, e.g. when an input is mutated)."""
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    from torch._inductor import cudagraph_trees
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    nodes, recorded = [] if manager is None else [n for roots in manager.roots.values() for n in roots], 0
    while nodes:   # each node of the trees is one recorded graph
        node = nodes.pop()
        recorded += 1
        nodes.extend(child for children in node.children.values() for child in children)
    return {"recorded": recorded, "skips": skips}


def dynamo_counts() -> dict[str, int]:
    """Graphs Dynamo compiled (a recompile adds one) and graph breaks, process-wide."""
    counters = torch._dynamo.utils.counters
    return {"graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}


def compile_cache_dir() -> str:
    """Where inductor keeps what it built (FX graphs, kernels, AOT autograd's graphs), so that a
    restart reuses them: $TORCHINDUCTOR_CACHE_DIR when set, else exspec's own cache folder
    ($XDG_CACHE_HOME or ~/.cache, then exspec/torch_compile) instead of torch's default under
    /tmp, which a container or a reboot loses. Set before the first compile of the process
    (CompiledForward). Torch writes its default into the variable the first time it looks the
    folder up (some imports do), so that value counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given is None or os.path.abspath(given) == os.path.abspath(default_cache_dir()):
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "exspec" / "torch_compile")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def inductor_cache_counts() -> dict[str, int]:
    """Graphs inductor looked up in its FX graph cache, process-wide: found (reused from an
    earlier start) or missed (built now)."""
    counters = torch._dynamo.utils.counters["inductor"]
    return {"reused": counters["fxgraph_cache_hit"], "built": counters["fxgraph_cache_miss"]}


@dataclass
class WarmUp:
    graphs: int
    graph_breaks: int
    seconds: float
    compiled: list[str] = field(default_factory=list)   # per model, what was compiled (describe)
    cuda_graphs: dict[str, int] | None = None            # cuda_graph_counts() after, if used
    inductor: dict[str, int] | None = None               # inductor_cache_counts() moved by it
    cache_dir: str | None = None                         # compile_cache_dir(), inductor only

    def describe(self) -> str:
        captured = ("" if self.cuda_graphs is None else
                    f", {self.cuda_graphs['recorded']} CUDA graphs captured "
                    f"({self.cuda_graphs['skips']} skipped)")
        return (f"{self.graphs} graphs, {self.graph_breaks} graph breaks{captured}, warm-up "
                f"{self.seconds:.1f} s; " + "; ".join(self.compiled))

    def summary(self) -> str:
        """The closing line of a warm-up: what it compiled, in how long, and what the compile
        cache saved."""
        cache = ""
        if self.inductor is not None:
            cache = (f"; inductor: {self.inductor['built']} graph(s) built, "
                     f"{self.inductor['reused']} reused from the compile cache {self.cache_dir}")
        captured = ("" if self.cuda_graphs is None else
                    f", captured {self.cuda_graphs['recorded']} CUDA graphs")
        return (f"exspec: compiled decode path ready: compiled {self.graphs} graphs{captured} in "
                f"{self.seconds:.1f} s{cache}")


# The row counts the warm-up steps: torch specialises 1 (except in EXSPEC's regions, which keep
# it symbolic) and keeps any other count symbolic, so these two are every graph a batch size
# can need (CUDA graphs: see CompiledForward.__call__).
WARM_UP_ROWS = (1, 2)
# reading in place, a width's graph is compiled for 1 row (torch specialises a size of 1), then
# for 2 with its rows symbolic (automatic dynamic shapes: the rows changed), which every larger
# batch reuses
IN_PLACE_ROWS = 2


def warm_up_schedule(k: int) -> list[int]:
    """The k of each warm-up step: a full step (draft 1-token forwards, k + 1 verification), a
    plain one (one-token verification), a speculative one after it (the draft's 2-token first
    forward) and one after three plain steps (the draft's catch-up forward). At k = 0, two plain
    steps: a model's first forward is the region probe, which runs eagerly and compiles nothing."""
    return [k, 0, k, 0, 0, 0, k] if k > 0 else [0, 0]


def static_shapes(max_rows: int, k: int, max_model_len: int,
                  store_slots: int | None = None) -> list[tuple[int, int, int]]:
    """Every (rows, tokens, KV columns) a decode forward on the block store can take, in the
    order the warm-up builds them: the row buckets up to max_rows' (`row_bucket`: a forward of
    other rows runs padded to its bucket), widths 2 .. k + 1 (a one-token forward is fed as
    two; a proposer's catch-up after more plain steps than that is wider, and is fed in pieces
    of these), and every block-table bucket up to
    max_model_len (verification never reaches past it). Read in place (`store_slots`: the
    store's size), every forward's KV columns are the whole store's."""
    widths = range(2, max(2, k + 1) + 1)
    columns = ([blocks * BLOCK_SIZE for blocks in table_buckets(max_model_len)]
               if store_slots is None else [store_slots])
    return [(rows, width, column) for rows in row_buckets(max_rows)
            for column in columns for width in widths]


def shapes_to_build(forward: CompiledForward, store, max_rows: int, k: int,
                    max_model_len: int) -> list[tuple[int, int, int]]:
    """The shapes the warm-up builds for `forward` after its schedule: with static shapes
    every one (`static_shapes`); reading in place on a CPU each width at 1 .. IN_PLACE_ROWS
    rows (`CompiledForward.key`); else none (symbolic graphs cover every shape)."""
    slots = store.num_blocks * BLOCK_SIZE if forward.in_place else None
    if forward.static_shapes:
        return static_shapes(max_rows, k, max_model_len, slots)
    if forward.in_place:
        return static_shapes(min(max_rows, IN_PLACE_ROWS), k, max_model_len, slots)
    return []


@torch.inference_mode()   # as the runner's steps
def _shape_forward(runner, model, forward: CompiledForward, shape: tuple[int, int, int]) -> None:
    """One decode forward of `shape` on the block store, for the warm-up: `rows` new rows of
    `width` pad tokens, each in a block of its own, their table padded with the scratch block to
    the shape's KV columns (the mask hides those); the blocks go back to the store after. Read
    in place, the columns are the whole store's whatever the table, so the table stays its
    narrowest bucket (a GPU store's width would be ~1e5 host ints a row, per shape)."""
    rows, width, columns = shape
    kv = runner.kv_layout.empty(model, rows, runner.device)
    for table in kv.tables:
        table.reserve(kv.store, width)
    blocks = table_bucket(kv.store.units_for(width)) if forward.in_place else columns // BLOCK_SIZE
    kv.use_table(kv.store.transfers.to_device(torch.tensor(kv.padded_table(blocks))))
    device = runner.device
    ids = torch.full((rows, width), runner.pad_id, device=device)
    pos = torch.arange(width, device=device).repeat(rows, 1)
    valid = torch.ones((rows, width), dtype=torch.bool, device=device)
    features = None
    if forward.features is not None:
        size, dtype = forward.features
        features = torch.zeros((rows, width, size), dtype=dtype, device=device)
    try:
        runner.forward_output(model, kv, ids, pos, valid, [width] * rows, keep=1, features=features)
    finally:
        kv.select([])


def _build_static_shapes(runner, forwards: dict, shapes: dict, rounds: int, bar,
                         rows: int | None = None) -> None:
    """Run each forward at every shape of `shapes[model]` it has not met (`rounds` times: a
    cudagraph tree captures at a shape's second call), those of `rows` rows only where given;
    without `rows` every one must then be built, or the engine does not load."""
    for model, forward in forwards.items():
        for shape in shapes[model]:
            if rows is not None and shape[0] != rows:
                continue
            if forward.key(shape) not in forward.shapes:
                for _ in range(rounds):
                    _shape_forward(runner, model, forward, shape)
            if rows is not None or shape[0] not in WARM_UP_ROWS:   # each shape counted once
                bar.update()
        if rows is not None:
            continue
        missing = [s for s in shapes[model] if forward.key(s) not in forward.shapes]
        if missing:
            raise ModelLoadError(
                f"compiled decode path: the warm-up did not build {type(model).__name__}'s graph for "
                f"{len(missing)} shape(s), first (rows, tokens, KV columns) = {missing[0]}; set "
                f"enforce_eager to serve eagerly")


def warm_up(runner, make_sequence, k: int, vocab_size: int, progress: bool | None = None,
            max_rows: int = 2, max_model_len: int = 0) -> WarmUp:
    """Run every decode forward kind at 1 and 2 rows so that all compiling happens now.
    `make_sequence(request_id, prompt_ids, params)` builds an engine Sequence. With CUDA graphs
    the schedule runs twice: cudagraph trees run a graph's first call without capturing it.
    Forwards with static shapes then run each shape of `static_shapes(max_rows, k,
    max_model_len)` they have not met, so that nothing is captured after READY.
    `progress`: a progress bar of the warm-up's steps on stderr (None: where stderr is a
    terminal); each row count's steps also end with a log line, for server logs."""
    models = [m for m in (runner.target, *runner.proposer.models) if m in runner.decode_forwards]
    forwards = [runner.decode_forwards[m] for m in models]
    cuda_graphs = any(f.cuda_graphs for f in forwards)
    rounds = 2 if cuda_graphs else 1
    k = k if runner.proposer.proposes else 0
    shapes = {m: shapes_to_build(f, runner.kv_layout.store(m) if f.in_place else None,
                                 max_rows, k, max_model_len) for m, f in zip(models, forwards)}
    static = {m: f for m, f in zip(models, forwards) if shapes[m]}
    for model, forward in static.items():
        rows, widths, columns = (sorted({s[i] for s in shapes[model]}) for i in range(3))
        log.info("exspec: warm-up: %s: %d decode shapes to build (rows %d..%d x widths %d..%d x "
                 "%s)", type(model).__name__, len(shapes[model]), rows[0], rows[-1], widths[0],
                 widths[-1], f"{len(columns)} KV buckets up to {max_model_len} tokens"
                 if not forward.in_place else f"the whole store's {columns[0]} KV slots, read in place")
    for forward in forwards:   # compiling now is the point (a pair's forwards serve each engine built on it)
        forward.warm = False
    inductor = COMPILE_BACKEND == "inductor"
    cache_dir = compile_cache_dir() if inductor else None
    if inductor and runner.device.type == "cpu":
        _probe_vector_isas()
    before, start, cache_before = dynamo_counts(), time.perf_counter(), inductor_cache_counts()
    skips_before = cuda_graph_counts()["skips"] if cuda_graphs else 0
    params = SamplingParams(max_tokens=8 * (k + 1) * rounds, ignore_eos=True)   # never finishes here
    schedule = warm_up_schedule(k) * rounds
    bar = tqdm(total=len(WARM_UP_ROWS) * len(schedule) + sum(map(len, shapes.values())), unit="step",
               disable=_no_bar(progress), desc="exspec: compiling the decode path (warm-up)")
    with bar:
        for batch in WARM_UP_ROWS:   # whole rounds (no draft stop): the k + 1 verification too
            # periodic prompts, so that an n-gram proposer proposes in its first step
            prompts = [[(7 * i + 3 * (j % 2) + 1) % vocab_size for j in range(5 + 3 * i)]
                       for i in range(batch)]
            group = runner.new_group([make_sequence(f"warm-up-{batch}-{i}", p, params)
                                      for i, p in enumerate(prompts)])
            runner.prefill(group, [len(p) for p in prompts])
            for step_k in schedule:
                runner.step(group, step_k)
                group.realign()
                bar.update()
            # this row count's shapes before the next one's schedule: reading in place,
            # automatic dynamic shapes make a width's rows symbolic only when they change from
            # its first graph's, so a width first met at 2 rows (a catch-up the 1-row schedule
            # did not make) kept a 2-row graph and compiled again at 3 rows after READY
            _build_static_shapes(runner, static, shapes, rounds, bar, rows=batch)
            log.info("exspec: warm-up: %d row(s) done (%d steps), %d graphs compiled so far, %.1f s",
                     batch, len(schedule), dynamo_counts()["graphs"] - before["graphs"],
                     time.perf_counter() - start)
        _build_static_shapes(runner, static, shapes, rounds, bar)
    for model, forward in zip(models, forwards):
        forward.warm = True
        if forward.packed_linears:   # the products timed in the schedule: each shape's faster from now on
            forward.packed_linears.settle(type(model).__name__)
        if shapes[model]:   # every width up to k + 1 built: a wider forward goes in pieces
            forward.widest = max(width for _, width, _ in shapes[model])
    after, cache_after = dynamo_counts(), inductor_cache_counts()
    captured = None
    if cuda_graphs:
        captured = cuda_graph_counts()
        captured["skips"] -= skips_before
    return WarmUp(after["graphs"] - before["graphs"], after["graph_breaks"] - before["graph_breaks"],
                  time.perf_counter() - start, [f.describe() for f in forwards], captured,
                  {key: cache_after[key] - cache_before[key] for key in cache_after} if inductor else None,
                  cache_dir)


def _probe_vector_isas() -> None:
    """Starts, beside the warm-up, inductor's probe of the vector instruction sets g++ builds
    and the CPU loads: a g++ build and a loader subprocess per set, ~9 s on a 2-core CPU once per
    compile cache folder (quicker on a restart), which inductor would otherwise run when it
    generates its first kernel, after the tracing that needs none of it. Its answer is cached
    (functools.cache); a kernel that asks before it is done probes beside it, the cache's file
    locks keep that sound."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list
    threading.Thread(target=valid_vec_isa_list, name="exspec-isa-probe", daemon=True).start()


def _no_bar(progress: bool | None) -> bool | None:
    """tqdm's `disable`: None lets it decide (off where stderr is no terminal)."""
    return None if progress is None else not progress
