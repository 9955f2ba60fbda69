"""ASGI plumbing for an app that runs other apps in the same process (``model_router``): an app's lifespan driven by
hand, a request's body replayed to the app it is routed to, a GET answered in memory.

    lifespan = Lifespan(app)
    await lifespan.startup()            # the app's startup (an engine thread starts); RuntimeError if it failed
    await app(scope, replay(body, receive), send)
    status, body = await get(app, "/metrics")
    await lifespan.shutdown()
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .openai_api import ApiError

__all__ = ["ASGIApp", "Lifespan", "get", "read_body", "replay"]

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]


class Lifespan:
    """``app``'s lifespan protocol run by hand: what uvicorn does for the app it serves, for an app served inside
    another (whose own lifespan uvicorn drives)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._to_app: asyncio.Queue = asyncio.Queue()
        self._from_app: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def startup(self) -> None:
        """The app's startup; ``RuntimeError`` with its message if it failed."""
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self._task = asyncio.ensure_future(self.app(scope, self._to_app.get, self._from_app.put))
        await self._step("startup")

    async def shutdown(self) -> None:
        """The app's shutdown (after a startup); ``RuntimeError`` with its message if it failed."""
        if self._task is None:
            return
        try:
            await self._step("shutdown")
        finally:
            task, self._task = self._task, None
            await asyncio.gather(task, return_exceptions=True)

    async def _step(self, phase: str) -> None:
        await self._to_app.put({"type": f"lifespan.{phase}"})
        answer = asyncio.ensure_future(self._from_app.get())
        await asyncio.wait({answer, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if not answer.done():  # the app returned (or raised) without answering
            answer.cancel()
            error = self._task.exception()
            raise RuntimeError(f"the app's lifespan {phase} failed: {error!r}")
        message = answer.result()
        if message["type"] != f"lifespan.{phase}.complete":
            raise RuntimeError(f"the app's lifespan {phase} failed: {message.get('message', '')}")


async def read_body(receive: Receive, limit: int) -> bytes:
    """A request's whole body from ``receive``; ``ApiError`` 413 past ``limit`` bytes, 499 if the client left."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ApiError("the client disconnected", 499)
        chunk, more = message.get("body", b""), message.get("more_body", False)
        size += len(chunk)
        if size > limit:
            raise ApiError(f"the request body exceeds the limit of {limit} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands over ``body`` (already read from ``receive``) first, then what ``receive`` gets (a
    client's disconnect): the app a request is routed to reads the request as it came."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def get(app: ASGIApp, path: str) -> tuple[int, bytes]:
    """``GET path`` on ``app`` in this process: its status and whole body."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": [],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {},
    }  # fmt: skip
    status, chunks = 500, []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)
