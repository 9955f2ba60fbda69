"""The engine on a thread of its own, for asyncio servers: coroutines submit requests and read each request's outputs
from its own ``asyncio.Queue``; the thread owns the ``Engine`` (nothing else touches it) and steps it while there is
work, sleeping otherwise."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator

from .engine import Engine, EngineError, RequestOutput
from .sampling import SamplingParams

__all__ = ["AsyncEngine", "QueueFull"]


class QueueFull(RuntimeError):
    """More requests are in flight than the engine runs plus ``max_queue``: retry later."""


class AsyncEngine:
    """``generate(prompt, params)`` yields a request's ``RequestOutput`` s as the engine thread produces them; leaving
    the iteration early (a client that disconnected) aborts the request and frees its blocks."""

    def __init__(self, engine: Engine, max_queue: int = 256) -> None:
        self.engine, self.max_queue = engine, max_queue
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stop = False
        self.in_flight = 0  # accepted and not finished; changed by both threads, under _count_lock
        self._count_lock = threading.Lock()
        self.errors = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps, for tokens/s
        self._thread = threading.Thread(target=self._loop, name="gqa-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left and end the thread."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._recent) if now - t <= window]
        return sum(n for _, n in recent) / window

    async def generate(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes. Raises ``EngineError`` (before any output) for a request the
        engine cannot take, ``QueueFull`` when too many are in flight."""
        self.engine.check(prompt, params)  # reads only the engine's settings: safe from this thread
        if self.in_flight >= self.engine.max_running + self.max_queue:
            raise QueueFull(f"{self.in_flight} requests in flight")
        request_id = f"req-{next(self._ids)}"
        outputs: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), outputs)
        with self._count_lock:
            self.in_flight += 1
        self._commands.put(("add", request_id, prompt, params))
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:  # the consumer left (disconnect, cancellation): stop the request
                self._commands.put(("abort", request_id, None, None))
                self._wake.set()

    # -- the engine thread -----------------------------------------------------------------------------------------

    def _post(self, request_id: str, item: object) -> None:
        entry = self._queues.get(request_id)
        if entry is None:
            return
        loop, q = entry
        final = isinstance(item, BaseException) or item.finished
        if final:
            del self._queues[request_id]
            with self._count_lock:
                self.in_flight -= 1
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody listens any more
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _loop(self) -> None:
        engine = self.engine
        while True:
            while True:
                try:
                    op, request_id, prompt, params = self._commands.get_nowait()
                except queue.Empty:
                    break
                if op == "add":
                    try:
                        engine.add(prompt, params, request_id)
                    except EngineError as e:
                        self._post(request_id, e)
                else:
                    out = engine.abort(request_id)
                    if out is not None:
                        self._post(request_id, out)
            if self._stop:
                for request_id in list(engine.requests):
                    out = engine.abort(request_id)
                    if out is not None:
                        self._post(request_id, out)
                return
            if not engine.has_work:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a fault of the decode step: the batch's requests fail, the engine serves on
                traceback.print_exc()
                self.errors += 1
                message = f"{type(e).__name__}: {e}"
                batch = [r.request_id for r in engine.running if r.state == "decode"]
                outputs = [o for rid in batch if (o := engine.fail(rid, message)) is not None]
            tokens = sum(len(o.token_ids) for o in outputs)
            self._recent.append((time.monotonic(), tokens))
            while self._recent and time.monotonic() - self._recent[0][0] > 60:
                self._recent.popleft()
            for o in outputs:
                self._post(o.request_id, o)
