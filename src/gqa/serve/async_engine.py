"""The engine on a thread of its own, for asyncio servers: coroutines submit requests and read each request's outputs
from its own ``asyncio.Queue``; the thread owns the ``Engine`` (nothing else touches it) and steps it while there is
work, sleeping otherwise. After a step it lets the consumers take up its outputs (write their chunks) before the next
step starts, for at most ``HANDOVER_SECONDS``: with as many cores as the kernels' threads, the event loop running
beside a native call stalls one of its threads (2 cores: +12% tok/s at one stream, ITL p99 -25%).

The thread does not die of a request: a request the engine refuses gets its error, a step that raises fails the
requests it held (``Engine.fail_step``) and the next step goes on. Should the thread end all the same, every request
still waiting gets ``EngineStopped`` at once, and so does every later one: nothing waits for a thread that is gone."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from .engine import Engine, EngineStats, RequestOutput
from .sampling import SamplingParams

__all__ = ["AsyncEngine", "EngineStopped", "QueueFull"]

ALIVE_CHECK_SECONDS = 1.0  # a request waiting for output looks this often whether the engine thread still runs
# After a step the engine thread waits (at most this long) until every output it handed over has been taken up by its
# consumer (the server wrote the chunk and asks for the next one) before it starts the next step: on a machine with as
# many cores as the kernels have threads, a consumer running beside the step's native call stalls one of its threads.
HANDOVER_SECONDS = 0.005


class QueueFull(RuntimeError):
    """More requests are in flight than the engine runs plus ``max_queue``: retry later."""


class EngineStopped(RuntimeError):
    """The engine thread is not running (not started, stopped, or ended by a fault): nothing can be served."""


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
        self._untaken = 0  # outputs posted and not yet taken up by their consumers, under _taken
        self._taken = threading.Condition()
        self.errors = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps, for tokens/s
        self._thread = threading.Thread(target=self._loop, name="gqa-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left and end the thread."""
        self._ask_to_stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    async def aclose(self, timeout: float = 30.0) -> None:
        """``stop`` without blocking the event loop (the thread finishes its step and flushes its prefix blocks
        meanwhile). The join runs on a worker thread that holds the thread object only, which lets go of this engine
        as it ends: nothing of the model is left referenced when the caller frees memory after."""
        self._ask_to_stop()
        thread = self._thread
        if thread.is_alive():
            await asyncio.to_thread(thread.join, timeout)

    def _ask_to_stop(self) -> None:
        self._stop = True
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def stats(self) -> EngineStats:
        """The engine's counters (read from this thread: each a single int, never half-written)."""
        return self.engine.stats()

    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._recent) if now - t <= window]
        return sum(n for _, n in recent) / window

    async def generate(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes. Raises ``EngineError`` (before any output) for a request the
        engine cannot take, ``QueueFull`` when too many are in flight, ``EngineStopped`` when the engine thread is
        not running (or stops before the request finishes)."""
        if not self.alive:
            raise EngineStopped("the engine is not running")
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
        finished = held = False
        try:
            while not finished:
                try:
                    out = await asyncio.wait_for(outputs.get(), ALIVE_CHECK_SECONDS)
                except asyncio.TimeoutError:
                    if not self._thread.is_alive():  # gone without a word (it posts EngineStopped as it ends)
                        self._forget(request_id)
                        raise EngineStopped("the engine stopped") from None
                    continue
                if isinstance(out, BaseException):
                    self._take()
                    raise out
                finished, held = out.finished, True
                yield out
                held = False
                self._take()  # the consumer has handled `out` and asks for the next one
        finally:
            if held:
                self._take()
            if not finished:  # the consumer left (disconnect, cancellation, an error): stop the request
                self._commands.put(("abort", request_id, None, None))
                self._wake.set()

    async def run_in_engine(self, fn: Callable[[Engine], Any]) -> Any:
        """``fn(engine)`` run in the engine thread between two steps (the model is the thread's alone), its result or
        its exception here. ``EngineStopped`` if the thread is not running or stops first."""
        if not self.alive:
            raise EngineStopped("the engine is not running")
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._commands.put(("call", None, fn, (loop, done)))
        self._wake.set()
        while True:
            finished, _ = await asyncio.wait({done}, timeout=ALIVE_CHECK_SECONDS)
            if finished:
                return done.result()
            if not self._thread.is_alive():
                raise EngineStopped("the engine stopped")

    # -- the engine thread -----------------------------------------------------------------------------------------

    def _forget(self, request_id: str) -> bool:
        """Stop posting to ``request_id``; whether it was still listened to."""
        if self._queues.pop(request_id, None) is None:
            return False
        with self._count_lock:
            self.in_flight -= 1
        return True

    def _take(self) -> None:
        """A consumer took up an output (it asks for the next one, or has the last)."""
        with self._taken:
            self._untaken = max(0, self._untaken - 1)
            if not self._untaken:
                self._taken.notify_all()

    def _post(self, request_id: str, item: object) -> None:
        entry = self._queues.get(request_id)
        if entry is None:
            return
        loop, q = entry
        if isinstance(item, BaseException) or item.finished:
            self._forget(request_id)
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody listens any more
            with self._taken:
                self._untaken += 1
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _loop(self) -> None:
        try:
            while self._serve():
                pass
        finally:  # however the thread ends: nobody waits for it
            for request_id in list(self._queues):
                self._post(request_id, EngineStopped("the engine stopped"))
            self.engine.close()  # the prefix cache's blocks still queued go to disk

    def _serve(self) -> bool:
        """One turn of the engine thread: the queued commands, then a step (or a wait for work); False to end."""
        engine = self.engine
        self._take_commands()
        if self._stop:
            for request_id in list(engine.requests):
                self._post_output(engine.abort(request_id))
            return False
        if not engine.has_work:
            self._wake.wait(0.5)
            self._wake.clear()
            return True
        try:
            outputs = engine.step()
        except Exception as e:  # a fault of the step: its requests fail, the engine serves on
            traceback.print_exc()
            self.errors += 1
            outputs = engine.fail_step(f"{type(e).__name__}: {e}")
        tokens = sum(len(o.token_ids) for o in outputs)
        self._recent.append((time.monotonic(), tokens))
        while self._recent and time.monotonic() - self._recent[0][0] > 60:
            self._recent.popleft()
        for o in outputs:
            self._post(o.request_id, o)
        with self._taken:  # the consumers write their chunks before the next step starts (HANDOVER_SECONDS at most)
            self._taken.wait_for(lambda: not self._untaken, HANDOVER_SECONDS)
            self._untaken = 0
        return True

    def _take_commands(self) -> None:
        while True:
            try:
                op, request_id, prompt, params = self._commands.get_nowait()
            except queue.Empty:
                return
            if op == "call":
                self._call(prompt, *params)
                continue
            try:
                if op == "add":
                    self.engine.add(prompt, params, request_id)
                else:
                    self._post_output(self.engine.abort(request_id))
            except Exception as e:  # a request the engine refuses (or cannot take): that request's error alone
                if op == "add":
                    self._post(request_id, e)
                else:
                    traceback.print_exc()

    def _call(self, fn: Callable[[Engine], Any], loop: asyncio.AbstractEventLoop, done: asyncio.Future) -> None:
        """``run_in_engine``'s work: ``fn(engine)``, its result or exception handed to ``done`` on ``loop``."""
        try:
            result, error = fn(self.engine), None
        except Exception as e:  # the caller's error alone: the engine serves on
            result, error = None, e

        def settle() -> None:
            if not done.done():  # the caller may have gone (a disconnect cancels it)
                done.set_exception(error) if error is not None else done.set_result(result)

        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits
            loop.call_soon_threadsafe(settle)

    def _post_output(self, out: RequestOutput | None) -> None:
        if out is not None:
            self._post(out.request_id, out)
