"""The server's grammar compiles: on threads of their own, bounded in time, left behind by a request that goes.

xgrammar compiles in C++ with the GIL released, and cannot be stopped midway: a 40-character regular expression can
take minutes. So ``GrammarCompiles`` runs at most ``threads`` compiles at once, each on a daemon thread of its own —
never the pool the server parses requests on, so a plain request never waits behind a grammar. A request waits at
most ``seconds`` for a free thread (then ``CompileBusy``: the server answers 429) and ``seconds`` more for its compile
(then a ``ValueError``: the server's 400 says the spec is too complex). A request that stops waiting (its client left,
or its time ran out) leaves its compile behind: one that has not started never starts; one under way runs to its end
(the grammar is cached) and keeps its thread until then, so compiles nobody waits for still count against
``threads``. Requests for the same spec share one compile.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

from .structured import Grammars, StructuredOutput

__all__ = ["COMPILE_SECONDS", "COMPILE_THREADS", "CompileBusy", "GrammarCompiles"]

COMPILE_THREADS = 2  # compiles at once (each uses one core; xgrammar's compiler may use two)
COMPILE_SECONDS = 10.0  # a request's wait for a thread, then for its compile (a schema within schema_check's
# bounds compiles in ~3 s at most; past the deadline the compile goes on, its result cached)


class CompileBusy(Exception):
    """Every compile thread is taken (by compiles that may have been left behind): retry later."""


class GrammarCompiles:
    """``compile`` for the server's requests (one per event loop: it holds an ``asyncio.Semaphore``)."""

    def __init__(self, grammars: Grammars, threads: int = COMPILE_THREADS, seconds: float = COMPILE_SECONDS) -> None:
        self.grammars, self.threads, self.seconds = grammars, threads, seconds
        self._free = asyncio.Semaphore(threads)
        self._running: dict[StructuredOutput, asyncio.Future] = {}

    async def compile(self, s: StructuredOutput) -> Any:
        """``s`` compiled (``Grammars.compile``; at once when it was before). ``ValueError`` for a spec that is refused,
        does not compile, or does not compile within ``seconds``; ``CompileBusy`` when no thread frees up within
        ``seconds``. Cancelling the call (the client left) leaves the compile behind."""
        grammar = self.grammars.find(s)
        if grammar is not None:
            return grammar
        job = self._running.get(s)
        if job is None:
            try:
                await asyncio.wait_for(self._free.acquire(), self.seconds)
            except asyncio.TimeoutError:
                raise CompileBusy(f"{self.threads} grammars are compiling; retry later") from None
            if s in self._running or self.grammars.find(s) is not None:  # started, or done, while this one waited
                self._free.release()
                return await self.compile(s)
            job = self._start(s)
        try:
            return await asyncio.wait_for(asyncio.shield(job), self.seconds)
        except asyncio.TimeoutError:
            raise ValueError(f"the {s.kind} did not compile within {self.seconds:g} s: simplify it") from None

    def _start(self, s: StructuredOutput) -> asyncio.Future:
        """Compile ``s`` on a thread of its own (holding one of ``threads`` until it ends); its result in the future."""
        loop = asyncio.get_running_loop()
        job = loop.create_future()
        job.add_done_callback(lambda f: f.exception())  # an error nobody waits for any more is not logged
        self._running[s] = job

        def run() -> None:
            try:
                outcome = (self.grammars.compile(s), None)
            except Exception as e:
                outcome = (None, e)
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server stopped meanwhile
                loop.call_soon_threadsafe(self._end, s, job, *outcome)

        threading.Thread(target=run, name="gqa-grammar", daemon=True).start()  # daemon: never holds up an exit
        return job

    def _end(self, s: StructuredOutput, job: asyncio.Future, grammar: Any, error: Exception | None) -> None:
        del self._running[s]
        self._free.release()
        if error is None:
            job.set_result(grammar)
        else:
            job.set_exception(error)
