"""The engine thread: runs ticks (`engine.step()`) and queues each tick's outputs with a stats
snapshot for the send thread. It never sends, and nothing else calls `engine.step()`."""
from __future__ import annotations

import threading
import time
import traceback

from exspec_messages import STOP, EngineDead, StepFailed, Tick


class EngineThread:
    def __init__(self, engine, sends, lifecycle, log):
        self.engine = engine
        self.log = log
        self.sends = sends
        self.lifecycle = lifecycle
        self.tick_started: float | None = None   # set during a tick; read by the watchdog
        self._stop = threading.Event()           # read by this thread only
        self._thread = threading.Thread(target=self._loop, name="exspec-engine", daemon=True)

    @property
    def ident(self):
        return self._thread.ident

    def start(self):
        self._thread.start()

    def stop(self, grace_s: float) -> bool:
        """Let the pool empty for up to grace_s (unless the engine is dead: it never would),
        then stop the loop and join it. True when the thread ended."""
        deadline = time.monotonic() + grace_s
        while self.engine.has_unfinished() and not self.lifecycle.dead and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(timeout=max(1.0, deadline - time.monotonic()))
        return not self._thread.is_alive()

    def _loop(self):
        try:
            while True:
                if self.lifecycle.dead:   # the watchdog gave up on this thread's last tick
                    self._stop.wait()
                    break
                if not self.engine.has_unfinished():
                    if self._stop.is_set():
                        break
                    self.engine.wait_for_work(timeout=0.5)
                    continue
                self._tick()
        except BaseException:   # e.g. EngineCrash: nothing runs ticks any more
            message = traceback.format_exc()
            self.log.error(f"exspec: the engine thread died: {message}")
            self.sends.put(EngineDead(f"the engine thread died: {message.strip().splitlines()[-1]}"))
            self._stop.wait()   # the send thread answers every request until finalize
        finally:
            self.sends.put(STOP)

    def _tick(self):
        self.tick_started = time.monotonic()
        try:
            outputs = self.engine.step()
            stats = self.engine.stats()
        except Exception:
            message = traceback.format_exc(limit=5)
            self.log.error(f"exspec: engine step failed: {message}")
            self.sends.put(StepFailed(message.strip().splitlines()[-1]))
            time.sleep(0.05)
            return
        finally:
            self.tick_started = None
        if not self.lifecycle.dead:
            self.sends.put(Tick(outputs, stats))
