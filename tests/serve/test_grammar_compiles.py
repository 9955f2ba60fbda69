"""The server's grammar compiles (``serve.grammar_compiles``) with compiles that end when the test says: a deadline
that answers in time while the compile goes on, a compile left by its request before it starts never starting, a full
set of threads refused as busy, one compile shared by the requests for the same spec."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from gqa.serve.grammar_compiles import CompileBusy, GrammarCompiles
from gqa.serve.structured import StructuredOutput

A, B = StructuredOutput("regex", "a+"), StructuredOutput("regex", "b+")


class Held:
    """Stands in for ``Grammars``: a compile blocks until ``release`` is set (at most 10 s)."""

    def __init__(self) -> None:
        self.release, self.done, self.calls = threading.Event(), {}, []

    def find(self, s: StructuredOutput) -> str | None:
        return self.done.get(s)

    def compile(self, s: StructuredOutput) -> str:
        self.calls.append(s)
        self.release.wait(10)
        self.done[s] = f"compiled {s.spec}"
        return self.done[s]


async def until(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_the_deadline_answers_in_time_and_the_compile_goes_on_to_the_cache():
    async def main() -> None:
        grammars = Held()
        compiles = GrammarCompiles(grammars, threads=1, seconds=0.2)
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"the regex did not compile within 0\.2 s"):
            await compiles.compile(A)
        assert time.monotonic() - start < 1
        with pytest.raises(CompileBusy, match="1 grammars are compiling"):  # A still holds the one thread
            await compiles.compile(B)
        grammars.release.set()
        await until(lambda: grammars.find(A) is not None)
        assert await compiles.compile(A) == "compiled a+" and grammars.calls == [A]  # from the cache
        assert await compiles.compile(B) == "compiled b+"

    asyncio.run(main())


def test_a_compile_left_before_it_starts_never_starts_and_one_spec_compiles_once():
    async def main() -> None:
        grammars = Held()
        compiles = GrammarCompiles(grammars, threads=1, seconds=5)
        first, again = asyncio.ensure_future(compiles.compile(A)), asyncio.ensure_future(compiles.compile(A))
        waiting = asyncio.ensure_future(compiles.compile(B))  # for the one thread A holds
        await until(lambda: grammars.calls == [A])
        waiting.cancel()  # its client left
        grammars.release.set()
        assert await first == await again == "compiled a+"
        await asyncio.sleep(0.2)
        assert grammars.calls == [A] and waiting.cancelled()
        assert await compiles.compile(B) == "compiled b+" and grammars.calls == [A, B]

    asyncio.run(main())


def test_an_error_reaches_every_request_waiting_for_it():
    class Failing(Held):
        def compile(self, s: StructuredOutput) -> str:
            raise ValueError(f"the {s.kind} does not compile: bad")

    async def main() -> None:
        compiles = GrammarCompiles(Failing(), threads=1, seconds=5)
        results = await asyncio.gather(compiles.compile(A), compiles.compile(A), return_exceptions=True)
        assert [str(r) for r in results] == ["the regex does not compile: bad"] * 2
        with pytest.raises(ValueError, match="does not compile"):  # the thread is free again
            await compiles.compile(B)

    asyncio.run(main())
