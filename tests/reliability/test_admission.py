"""Admission (add_request: a grammar compile can take a second, a long prompt's tokenization
too) runs off Triton's execute thread: while one request is admitted slowly, the requests
behind it are admitted and served. The `admission` model's add_request sleeps 4 s for a
prompt holding "~" (fault_injection.admission_delay_s)."""
from __future__ import annotations

import concurrent.futures as cf
import time

from reliabilitykit import MODELS, clients

MODEL = "admission"
SLOW_S = MODELS[MODEL]["fault_injection"]["admission_delay_s"]
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def timed(server, prompt: str):
    start = time.monotonic()
    call = clients.grpc_stream(server.urls["grpc"], MODEL, [{"prompt": prompt, "sampling": GREEDY}],
                               timeout_s=60)[0]
    return call, time.monotonic() - start


def test_a_slow_admission_holds_up_neither_tritons_thread_nor_the_requests_behind_it(rel_server):
    alone, _ = timed(rel_server, "hello world")
    with cf.ThreadPoolExecutor(2) as pool:
        slow = pool.submit(timed, rel_server, "slow ~ request")
        time.sleep(0.5)   # the slow request is in add_request by now
        behind = pool.submit(timed, rel_server, "hello world")
        (fast_call, fast_s), (slow_call, slow_s) = behind.result(), slow.result()
    assert fast_call.responses[-1].error is None and slow_call.responses[-1].error is None
    assert fast_call.ids() == alone.ids()
    assert slow_s >= SLOW_S, slow_s
    # served while the slow one was still being admitted (before the fix it waited behind it
    # on Triton's execute thread)
    assert fast_s < SLOW_S / 2, f"the request behind a slow admission took {fast_s:.1f} s"
