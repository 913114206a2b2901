"""LLMEngine: the online API (add_request / abort / step) and the offline `generate`.

step() is the tick: the pool admits and schedules (which group, which k), the runner drafts,
verifies and accepts, the pool commits, emits and retires. Intake and abort may be called from
any thread; step() from one.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import random
import threading
import traceback
from collections import deque

import torch

from ..config import EngineConfig
from ..errors import EngineBusyError, InvalidRequestError, ModelLoadError
from ..kv.blocks import BlockStores
from ..models import compiled
from ..models.architecture import check_servable, kv_layout
from ..models.loading import ModelPair, load_pair, model_devices
from ..outputs import CompletionOutput, RequestOutput
from ..params import SamplingParams
from ..sampling.logits_processing import bad_words_token_ids
from ..sampling.structured_output import Grammars
from ..spec.registry import proposer_for
from ..spec.vocab import check_vocabularies, logit_rows
from ..utils.faults import Faults
from ..utils.stats import Stats
from ..utils.threads import apply_threads, choose_threads
from .detokenizer import Detokenizer
from .parallel_sampling import ParallelSampling, child_id, child_params
from .pool import SequencePool, Touched
from .prefix_caching import PrefixCaching
from .runner import ModelRunner
from .sequence import Sequence


def _load_libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None   # glibc only
    except OSError:
        return None


_LIBC = _load_libc()


def _free_memory(device: torch.device, utilization: float | None = None) -> int:
    """Bytes on a GPU this engine may still take: the device's free memory, or less where a
    per-process cap (torch.cuda.set_per_process_memory_fraction) leaves less; with vLLM's
    `utilization`, that share of the device's memory less what this process holds already."""
    free, total = torch.cuda.mem_get_info(device)
    cap = torch.cuda.get_per_process_memory_fraction(device) * total
    if utilization is not None:
        cap = min(cap, utilization * total)
    return int(min(free, cap - torch.cuda.memory_reserved(device)))


def kv_token_budget(*models, utilization: float | None = None) -> int:
    """KV entries (both models counted, as the pool counts them) that the models' GPUs hold
    once they are loaded: 90% of the free memory (the rest for activations and the
    allocator), or what vLLM's gpu_memory_utilization leaves. A target spread over GPUs keeps
    each layer's cache on its layer's GPU: their free memory adds up."""
    share = 0.9 if utilization is None else 1.0
    free = sum(max(0, _free_memory(d, utilization)) for d in model_devices(*models))
    return kv_entries_in(int(free * share), models)


def kv_entries_in(free_bytes: int, models) -> int:
    """KV entries (every model's counted) that fit in `free_bytes`: a row holds one entry per
    token in each model's store, so each store gets free / (the models' bytes per entry, summed)
    entries, whatever its own entry costs (a one-layer EAGLE head's store takes its own few
    bytes, not a share sized as the target's)."""
    present = [m for m in models if m is not None]
    return free_bytes // sum(kv_bytes_per_entry(m) for m in present) * len(present)


def kv_bytes_per_entry(model) -> int:
    """Bytes one token's KV entry takes in a model's cache: keys and values of every layer."""
    cfg = model.config.get_text_config(decoder=True)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * heads * head_dim * model.dtype.itemsize


def _error(seq: Sequence) -> str | None:
    """A row's error, with the grammar engine's own reason where it gave up on the row (a limit
    it hit leaves no token allowed: the runner's error alone would blame the constraints)."""
    reason = seq.grammar.error if seq.error and seq.grammar is not None else ""
    return f"{seq.error}; the grammar engine stopped: {reason}" if reason else seq.error


class LLMEngine:
    RELEASE_EVERY_TICKS = 1000
    def __init__(self, config: EngineConfig, pair: ModelPair | None = None):
        """`pair`: models already loaded (e.g. by another engine) to share instead of loading."""
        self.config = config
        self.threads = apply_threads(choose_threads(config.torch_threads))   # before any kernel
        pair = pair or load_pair(config)
        check_servable(pair.target, "target", config.method, pair.max_model_len)
        if pair.draft is not None:
            check_servable(pair.draft, "draft", config.method)
            check_vocabularies(pair.target, pair.draft, pair.tokenizer)
        self.pair = pair
        self.tokenizer = pair.tokenizer
        self.target, self.draft = pair.target, pair.draft
        pad_id = self.tokenizer.pad_token_id
        pad_id = pad_id if pad_id is not None else min(pair.eos_ids, default=0)
        self.proposer = proposer_for(config, pair, pad_id)   # its method's (spec/registry.py)
        models = (self.target, *self.proposer.models)
        self.eos_ids = pair.eos_ids
        self.grammars = Grammars(self.tokenizer, self.eos_ids, logit_rows(self.target))
        self.max_model_len = pair.max_model_len
        self.max_prompt_tokens = min(config.max_prompt_tokens or self.max_model_len - 1,
                                     self.max_model_len - 1)
        if config.max_num_kv_tokens is None and config.device.startswith("cuda"):
            config.max_num_kv_tokens = kv_token_budget(*models,
                                                       utilization=config.gpu_memory_utilization)
            if config.max_num_kv_tokens <= 0:
                raise ModelLoadError(f"no GPU memory is left for the KV cache once the models are "
                                     f"loaded (gpu_memory_utilization "
                                     f"{config.gpu_memory_utilization}); raise it or set "
                                     f"max_num_kv_tokens")
        self.stats_ = Stats(model_devices(*models) | {torch.device(config.device)})
        layout = kv_layout(config, (self.target, *self.proposer.kv_models))
        self.faults = Faults(config.fault_injection)
        self.runner = ModelRunner(self.target, self.proposer, pad_id, config.device, self.stats_,
                                  layout, self.faults, config.sampling_coupling)
        prefix = (PrefixCaching([layout.store(m) for m in (self.target, *self.proposer.kv_models)])
                  if isinstance(layout, BlockStores) and layout.prefix_caching else None)
        self.pool = SequencePool(config, self.runner, self.stats_, prefix)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._incoming: deque[Sequence] = deque()   # added since the last tick
        self._aborts: set[str] = set()
        self._live_ids: set[str] = set()             # every request not yet finished
        self.parallel = ParallelSampling()           # requests with n > 1: their children
        self._auto_ids = itertools.count()
        self._seeds = random.Random(config.seed)     # for requests that bring no seed
        self._ticks = 0
        self.warm_up: compiled.WarmUp | None = None
        if not config.enforce_eager:
            self._compile_decode_path()

    def _compile_decode_path(self) -> None:
        """Compile the step's forwards and run each kind once, so that READY means warm."""
        # CUDA graphs need static storage: EXSPEC's block store (EQSPEC's realigned caches
        # change width every step, which would capture a graph per step)
        cuda_graphs = (torch.device(self.config.device).type == "cuda"
                       and isinstance(self.runner.kv_layout, BlockStores))
        # a graph per concrete shape, each built in the warm-up (CUDA graphs; on a CPU only
        # where compiled.STATIC_SHAPES asks, which the tests do to check the warm-up's coverage)
        static = (isinstance(self.runner.kv_layout, BlockStores)
                  and compiled.static_shapes_on(self.config.device))
        in_place = isinstance(self.runner.kv_layout, BlockStores) and self.runner.kv_layout.in_place
        forwards = {}
        models = (self.target, *self.proposer.models)
        for model in models:
            key = (model, cuda_graphs, in_place)
            if key not in self.pair.decode_forwards:
                self.pair.decode_forwards[key] = compiled.CompiledForward(model, cuda_graphs, in_place)
            forwards[model] = self.pair.decode_forwards[key]
            forwards[model].static_shapes = static
            forwards[model].rows_symbolic_from_one = isinstance(self.runner.kv_layout, BlockStores)
        self.runner.decode_forwards = forwards
        stats, self.runner.stats = self.runner.stats, Stats(model_devices(*models))
        try:
            self.warm_up = compiled.warm_up(
                self.runner, self._sequence, self.config.num_speculative_tokens,
                self.target.get_output_embeddings().weight.shape[0],
                max_rows=self.config.max_batch_size, max_model_len=self.max_model_len)
        finally:
            self.runner.stats = stats
        compiled.log.info(self.warm_up.summary())
        captured = self.warm_up.cuda_graphs
        if captured is not None and (captured["skips"] or not captured["recorded"]):
            raise ModelLoadError(f"CUDA graph capture did not happen on the compiled path "
                                 f"({self.warm_up.describe()}); set enforce_eager to serve eagerly")

    # -- intake (thread-safe) ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None) -> None:
        """Queue a request; raises InvalidRequestError or EngineBusyError at once."""
        params = params or SamplingParams()
        params.validate()
        params.check_token_ids(self.target.get_output_embeddings().weight.shape[0])
        prompt_ids = self._prompt_ids(prompt)
        self.faults.before_admission(prompt_ids)
        max_tokens = params.max_tokens or self.config.default_max_tokens
        if max_tokens > self.config.max_output_tokens:
            raise InvalidRequestError(f"max_tokens {max_tokens} exceeds the server limit of "
                                      f"{self.config.max_output_tokens}")
        if params.min_tokens > max_tokens:   # max_tokens absent: the engine's default applies
            raise InvalidRequestError(f"min_tokens must be less than or equal to max_tokens="
                                      f"{max_tokens}, got {params.min_tokens}.")
        budget = self.config.max_num_kv_tokens
        if budget is not None:
            scheduler = self.pool.scheduler   # alone in the pool, the layout's own blocks included
            need = scheduler.allocation_for([scheduler.kv_peak(len(prompt_ids), max_tokens, self.max_model_len)],
                                            scheduler.models)
            if need > budget:
                raise InvalidRequestError(
                    f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) can grow to "
                    f"{need} KV cache entries, more than the whole pool holds "
                    f"(max_num_kv_tokens = {budget}); shorten the prompt or lower max_tokens")
        if params.n > self.config.max_queue_len:
            raise InvalidRequestError(f"n = {params.n} samples can never fit the queue of "
                                      f"max_queue_len = {self.config.max_queue_len}")
        seqs = self._samples(request_id, prompt_ids, params, max_tokens)
        with self._lock:
            # a request's id and its samples' ids (i_<id>) are each taken by one sequence
            for taken in dict.fromkeys([request_id] + [s.request_id for s in seqs]):
                if taken in self._live_ids or self.parallel.owns(taken):
                    raise InvalidRequestError(
                        f"request id {request_id!r} is already in flight" if taken == request_id
                        else f"request id {request_id!r}: its sample id {taken!r} is a request "
                             "already in flight")
            waiting = len(self._incoming) + self.pool.num_waiting + len(self.parallel.held())
            if waiting + len(seqs) > self.config.max_queue_len:
                raise EngineBusyError(f"server busy: {self.config.max_queue_len} requests are "
                                      "already waiting; retry later")
            self._live_ids.add(request_id)
            if len(seqs) > 1:   # with prefix caching, siblings wait for child 0's prefill
                seqs = self.parallel.add(request_id, seqs, hold=self.pool.prefix is not None)
            self._incoming.extend(seqs)
            self._work.notify_all()

    def _samples(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 max_tokens: int) -> list[Sequence]:
        """The request's sequence, or its n children (parallel_sampling.py)."""
        with self._lock:   # a fresh seed per unseeded sample: each is its own exact sample
            seeds = [params.seed + i if params.seed is not None else self._seeds.randrange(2**63)
                     for i in range(params.n)]
        if params.n == 1:
            return [self._sequence(request_id, prompt_ids, params, max_tokens, seeds[0])]
        return [self._sequence(child_id(request_id, i), prompt_ids, child_params(params, i),
                               max_tokens, seed) for i, seed in enumerate(seeds)]

    def abort(self, request_id: str) -> None:
        """Idempotent and thread-safe; the request ends with finish_reason 'abort'."""
        with self._lock:
            if request_id in self.parallel:
                self._aborts.update(self.parallel.child_ids(request_id))
                self._work.notify_all()
            elif request_id in self._live_ids:
                self._aborts.add(request_id)
                self._work.notify_all()

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live_ids)

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until a request is in flight (or the timeout passes), without spinning."""
        with self._work:
            return self._work.wait_for(lambda: bool(self._live_ids), timeout)

    def _sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  max_tokens: int | None = None, seed: int = 0) -> Sequence:
        return Sequence(request_id, prompt_ids, params, max_tokens or params.max_tokens,
                        self.max_model_len, self.eos_ids,
                        Detokenizer(self.tokenizer, params.stop, start=len(prompt_ids)),
                        seed, self.config.sampling_coupling,
                        bad_words_token_ids(self.tokenizer, params.bad_words or []),
                        None if params.structured_outputs is None
                        else self.grammars.compile(params.structured_outputs))

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            ids = list(prompt)
            vocab = self.target.get_output_embeddings().weight.shape[0]
            if any(t < 0 or t >= vocab for t in ids):
                raise InvalidRequestError(f"prompt token ids must lie in [0, {vocab})")
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids")
        if not ids:
            raise InvalidRequestError("prompt is empty")
        if len(ids) > self.max_prompt_tokens:
            raise InvalidRequestError(f"prompt has {len(ids)} tokens; the limit is "
                                      f"{self.max_prompt_tokens}")
        return ids

    # -- the tick -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One tick, or the part of it that produced outputs: the tick's parts are the step's
        plan with short prompts' prefill, the step, and long prompts' chunks (SequencePool);
        when a part produces outputs and another part is still to run, they are returned at
        once (a first token is not held behind the step, nor a step's tokens behind a chunk)
        and the next call runs the rest."""
        # intake and aborts in either half: after abort(id) returns, no step emits tokens for
        # id (a planned step loses the aborted rows before it runs); new requests only wait
        with self._lock:
            incoming, self._incoming = list(self._incoming), deque()
            aborts, self._aborts = self._aborts, set()
            held_aborted = self.parallel.drop_held(aborts)
            incoming += self.parallel.release()
        self.pool.enqueue(incoming)
        touched: list[Touched] = self.pool.abort(aborts)
        for seq in held_aborted:
            seq.finish("abort")
            touched.append((seq, [], None))
        pool = self.pool
        if pool.planned is None and pool.chunks_due is None:   # a new tick: the plan, prefill
            self.faults.before_tick()
            touched += self._guarded(pool.begin_tick)
            if touched and (pool.planned is not None or pool.chunks_due is not None):
                return self._emit(touched)   # first tokens out before the step
        if pool.planned is not None:
            touched += self._guarded(pool.finish_tick)
            if touched and pool.chunks_due is not None:
                return self._emit(touched)   # the step's tokens out before the chunks
        touched += self._guarded(pool.feed_chunks)
        self._ticks += 1
        if self._ticks % self.RELEASE_EVERY_TICKS == 0 or (touched and not self.pool.num_running
                                                           and not self.pool.num_waiting):
            self.release_memory()   # every so often, and whenever the pool has just emptied
        return self._emit(touched)

    def _guarded(self, half) -> list[Touched]:
        try:
            return half()
        except Exception:  # the pool isolates group failures; this is a last resort
            error = traceback.format_exc(limit=3)
            with self._lock:
                held = self.parallel.drop_held()
            for seq in held:
                seq.finish("error", error)
            return self.pool.fail_all(error) + [(s, [], None) for s in held]

    def _emit(self, touched: list[Touched]):
        """One output per sequence per call, however many times the call touched it."""
        merged: dict[str, Touched] = {}
        for seq, new_ids, new_lp in touched:
            if seq.request_id in merged:
                _, ids, lp = merged[seq.request_id]
                merged[seq.request_id] = (seq, ids + new_ids,
                                          None if new_lp is None else (lp or []) + new_lp)
            else:
                merged[seq.request_id] = (seq, list(new_ids), new_lp)
        outputs = []
        for seq, _, _ in merged.values():
            if seq.finished:   # its one final output: the proposer hears of it once
                self.proposer.request_done(seq, seq.finish_reason)
        for seq, new_ids, new_lp in merged.values():
            texts = seq.take_token_texts() if seq.params.text_per_token else None
            rest = seq.detokenizer.take_delta(final=seq.finished)
            if texts and rest:
                texts[-1] += rest
            outputs.append(RequestOutput(
                request_id=seq.request_id, new_token_ids=new_ids,
                text_delta="".join(texts) if texts else rest, token_texts=texts,
                finished=seq.finished, finish_reason=seq.finish_reason, error=_error(seq),
                num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
                num_draft_tokens=seq.num_draft_tokens,
                num_accepted_draft_tokens=seq.num_accepted_draft_tokens,
                new_logprobs=new_lp,
                prompt_token_ids=seq.tokens[:seq.num_prompt_tokens] if seq.finished else None))
        with self._lock:   # abort() reads the children from other threads
            # an abort that came while its request finished ends with it: it must not reach a
            # later request that reuses the id
            self._aborts.difference_update(s.request_id for s, _, _ in merged.values() if s.finished)
            outputs, failed_siblings = self.parallel.relabel(outputs)
            self._live_ids.difference_update(out.request_id for out in outputs if out.finished)
            self._aborts |= failed_siblings
        return outputs

    # -- offline ----------------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[CompletionOutput]:
        """All prompts through the online loop; outputs in input order, a request with n > 1
        giving its n samples one after another (index 0 first)."""
        ticks = self.generate_ticks(prompts, params)
        while True:
            try:
                next(ticks)
            except StopIteration as done:
                return done.value

    def generate_ticks(self, prompts: list[str | list[int]],
                       params: SamplingParams | list[SamplingParams] | None = None):
        """`generate`, one tick per `next()`: yields after each tick and returns the outputs
        (StopIteration.value), so a caller can interleave ticks of several engines (the
        benchmark times them side by side)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):   # vLLM's rule, instead of waiting forever
            raise ValueError(f"The lengths of prompts ({len(prompts)}) and params "
                             f"({len(params_list)}) must be the same.")
        ids = [f"generate-{next(self._auto_ids)}" for _ in prompts]
        pending = deque(zip(ids, prompts, params_list))
        results, finished = {}, set()
        while len(finished) < len(ids):
            while pending:   # feed the queue as it drains: generate never hits "busy"
                rid, prompt, p = pending[0]
                try:
                    self.add_request(rid, prompt, p)
                except EngineBusyError:
                    break
                pending.popleft()
            for out in self.step():
                res = results.setdefault((out.request_id, out.index),
                                         CompletionOutput(out.request_id, index=out.index))
                res.token_ids += out.new_token_ids
                res.text += out.text_delta
                if out.new_logprobs is not None:
                    res.logprobs = (res.logprobs or []) + out.new_logprobs
                res.num_draft_tokens = out.num_draft_tokens
                res.num_accepted_draft_tokens = out.num_accepted_draft_tokens
                if out.finish_reason is not None:   # this sample's last output
                    res.finish_reason, res.error = out.finish_reason, out.error
                if out.finished:
                    finished.add(out.request_id)
            yield
        return [results[rid, i] for rid, p in zip(ids, params_list)
                for i in range(p.n if p is not None else 1)]

    def release_memory(self) -> None:
        """Hand freed host memory back to the system. Caches of every size come and go, and
        the C allocator keeps what it freed (a soak showed the serving process growing with no
        Python-level leak: malloc_trim brings it back). The CUDA cache is left alone: the KV
        budget already holds the GPU's memory for this process, and emptying it whenever the
        pool went idle made the next requests pay for cudaMalloc again (only a step that ran
        out of memory empties it: pool.py). No gc.collect(): caches hold no reference cycles,
        so they are freed the moment a group lets go of them, and a full collection would stall
        the tick for ~0.2 s."""
        if _LIBC is not None:
            _LIBC.malloc_trim(0)

    def stats(self) -> dict:
        with self._lock:
            queued = len(self._incoming)
        out = self.stats_.snapshot(pool_seqs=self.pool.num_running,
                                   pool_kv_tokens=self.pool.kv_tokens(),
                                   queue_len=self.pool.num_waiting + queued,
                                   pool_kv_tokens_allocated=self.pool.kv_allocated(),
                                   pool_kv_tokens_reserved=self.pool.kv_reserved())
        if self.pool.prefix is not None:
            out.update(self.pool.prefix.stats())
        return out
