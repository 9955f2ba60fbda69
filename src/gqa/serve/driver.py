"""What every HTTP API of ``gqa serve`` does with the engine, whatever shape its requests come in: the body read
(bounded), the key checked, a parsed request's grammar checked and compiled (off the parsing threads), its answers
started and their outputs read — merged as they come, or collected whole — and closed (aborted, their blocks freed)
when the client leaves. The front-ends (``server``'s OpenAI routes, ``messages_routes``, ``responses_routes``) only
translate their API's shapes to a ``ParsedRequest`` and the outputs back.

Failures come out as ``ApiError`` (status, message, field), whose body each front-end writes in its API's shape, or
``ClientLeft`` (the client disconnected first: answered 499, which nobody reads).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse as StarletteJSONResponse

from .async_engine import AsyncEngine, EngineStopped, QueueFull
from .grammar_compiles import CompileBusy, GrammarCompiles
from .openai_api import ApiError, ParsedRequest, error_body, to_json
from .request import EngineError, RequestOutput

__all__ = ["ClientLeft", "Driver", "JSONResponse", "fail"]


class ClientLeft(Exception):
    """The client disconnected before its response began."""


class JSONResponse(StarletteJSONResponse):
    """A JSON response written by ``to_json``: ``ValueError`` (when made) for a body holding NaN or an infinity."""

    def render(self, content: object) -> bytes:
        return to_json(content).encode("utf-8")


def fail(e: ApiError) -> JSONResponse:
    """``e`` answered in OpenAI's error shape; ``Retry-After`` where retrying later helps."""
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(error_body(e), status_code=e.status, headers=headers)


def not_json(constant: str) -> float:
    """Python's JSON decoder reads ``NaN``, ``Infinity`` and ``-Infinity``; JSON has no such values."""
    raise ValueError(f"{constant} is not a JSON value")


class Driver:
    """``engine`` served as ``model_name`` to the HTTP front-ends (one per app). ``api_key``: the key every request
    must carry (``None``: open); ``max_body_bytes``: the largest request body read."""

    def __init__(
        self, engine: AsyncEngine, tokenizer, model_name: str, api_key: str | None, max_body_bytes: int
    ) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        self.context = engine.engine.config.max_position_embeddings
        blocks = engine.engine.blocks
        self.pool = blocks.num_blocks * blocks.block_size  # token slots of the KV cache: what one request can fill
        self.grammars = engine.engine.grammars
        # structured output's compiles, off the parsing threads
        self.compiles = None if self.grammars is None else GrammarCompiles(self.grammars)

    # -- the request ---------------------------------------------------------------------------------------------------

    def authorized(self, request: Request, x_api_key: bool = False) -> bool:
        """Whether ``request`` carries the key: ``Authorization: Bearer KEY``, or (``x_api_key``: Anthropic's way)
        an ``x-api-key: KEY`` header."""
        if self.api_key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if x_api_key and "x-api-key" in request.headers:
            scheme, token = "bearer", request.headers["x-api-key"]
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key.encode())

    async def read_json(self, request: Request) -> object:
        """The body as JSON: 415 unless its Content-Type is JSON (a plain-text POST is a request any web page can
        send cross-origin), 413 past ``max_body_bytes`` (checked on the declared length, then while reading)."""
        limit = self.max_body_bytes
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise ApiError(f"Content-Type must be application/json, got {media or 'none'!r}", 415)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(f"the request body ({int(declared)} bytes) exceeds the limit of {limit}", 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(f"the request body exceeds the limit of {limit} bytes", 413)
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks), parse_constant=not_json)
        except RecursionError:
            raise ApiError("the request body is nested too deeply") from None
        except ValueError as e:  # the decoder's errors, bad UTF-8, an integer of over 4,300 digits, NaN
            raise ApiError(f"the request body is not valid JSON: {e}") from e

    async def parse(self, body: object, parse: Callable[[object], ParsedRequest]) -> ParsedRequest:
        """``parse(body)`` and the grammar's spec checked (what is refused before compiling), off the event loop:
        tokenizing and the chat template must not stall /health on a huge prompt."""
        return await asyncio.to_thread(lambda: self.checked(parse(body)))

    def checked(self, parsed: ParsedRequest) -> ParsedRequest:
        structured = parsed.params.structured
        if structured is not None:
            if self.grammars is None:
                raise ApiError("structured output needs the engine's tokenizer", param=parsed.structured_field)
            try:
                self.grammars.check(structured)
            except ValueError as e:
                raise ApiError(str(e), param=parsed.structured_field) from e
        return parsed

    async def compiled(self, parsed: ParsedRequest, request: Request) -> object | None:
        """The request's grammar compiled (``GrammarCompiles``: bounded in time, never on the parsing threads), or
        ``None`` without one; ``ClientLeft`` when the client disconnects first (the compile is left behind). Hold it
        until the answers are started: the engine finds it then."""
        if parsed.params.structured is None:
            return None
        job = asyncio.ensure_future(self.compiles.compile(parsed.params.structured))
        left = asyncio.ensure_future(client_left(request))
        try:
            await asyncio.wait({job, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            if not job.done():  # the client left first (or this request was cancelled): the compile is left behind
                job.cancel()
        if not job.done() or job.cancelled():  # cancel() only asks: the job is done on a later turn of the loop
            raise ClientLeft
        try:
            return job.result()
        except ValueError as e:
            raise ApiError(str(e), param=parsed.structured_field) from e
        except CompileBusy as e:
            raise ApiError(f"the server is busy compiling grammars ({e})", 429) from e

    # -- the answers ---------------------------------------------------------------------------------------------------

    async def begin(
        self, parsed: ParsedRequest, request: Request, outputs: list, field: str = "messages"
    ) -> list[RequestOutput]:
        """Compile the grammar, start the answers (into ``outputs``) and wait for their first outputs: every refusal
        as an ``ApiError`` (an ``EngineError`` naming ``field``), or ``ClientLeft``."""
        try:
            grammar = await self.compiled(parsed, request)  # held until the answers hold it: the engine finds it
            firsts = await self.start(parsed, outputs)
            del grammar
            return firsts
        except (ApiError, ClientLeft):
            raise
        except Exception as e:
            raise self.refusal(e, field) from e

    def refusal(self, e: Exception, field: str) -> ApiError:
        """What starting a request raised, as the API's error: the engine refusing it names ``field``."""
        if isinstance(e, EngineError):
            return ApiError(str(e), param=e.param or field)
        if isinstance(e, QueueFull):
            return ApiError(f"the server is busy ({e}); retry later", 429)
        return engine_failure(e)

    async def start(self, parsed: ParsedRequest, outputs: list) -> list[RequestOutput]:
        """Submit the request's ``n`` answers (into ``outputs``) and wait for their first outputs. The first answer
        goes alone: once its prompt is read, the others find the prompt's full blocks in the prefix cache."""
        try:
            outputs.append(self.engine.generate(parsed.prompt_ids, parsed.params))
            firsts = [await anext(outputs[0])]
            rest = [self.engine.generate(parsed.prompt_ids, parsed.params.for_choice(i)) for i in range(1, parsed.n)]
            outputs += rest
            got = await asyncio.gather(*(anext(o) for o in rest), return_exceptions=True)
        except BaseException:
            await close(outputs)
            raise
        for item in got:
            if isinstance(item, BaseException):
                await close(outputs)
                raise item
        return firsts + got

    async def collect(self, request: Request, firsts: list[RequestOutput], outputs: list) -> list[list[RequestOutput]]:
        """Every answer's outputs to its end (closed afterwards, whatever happens): ``ClientLeft`` when the client
        leaves first (the requests are aborted), an ``ApiError`` when the engine fails one."""
        ends = [[first] for first in firsts]

        async def read(i: int) -> None:
            async for out in outputs[i]:
                ends[i].append(out)

        tasks = [asyncio.ensure_future(read(i)) for i in range(len(firsts))]
        task, left = asyncio.gather(*tasks), asyncio.ensure_future(client_left(request))
        try:
            await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():  # a client that leaves before its whole response: the request is aborted
                raise ClientLeft
            task.result()
        except ClientLeft:
            raise
        except Exception as e:  # an answer's stream raised (the engine stopped): the other answers stop too
            raise engine_failure(e) from e
        finally:
            left.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await close(outputs)  # the unfinished answers' requests are aborted, their blocks freed
        for got in ends:
            if got[-1].finish_reason == "error":
                raise ApiError(f"the request failed in the engine: {got[-1].error}", 500)
        return ends


async def client_left(request: Request) -> None:
    """Returns when the client disconnects (to be awaited once the body is read: the next message)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def close(outputs: list) -> None:
    """Close answers' output streams (an unfinished one's request is aborted, its blocks freed)."""
    for o in outputs:
        await o.aclose()


async def merged(firsts: list[RequestOutput], outputs: list) -> AsyncIterator[tuple[int, object]]:
    """``(answer index, output or the exception its stream raised)`` as they come; one answer is read directly."""
    if len(outputs) == 1:
        yield 0, firsts[0]
        try:
            async for out in outputs[0]:
                yield 0, out
        except Exception as e:
            yield 0, e
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for out in outputs[i]:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))

    for i, first in enumerate(firsts):
        queue.put_nowait((i, first))
    tasks = [asyncio.ensure_future(pump(i)) for i, first in enumerate(firsts) if not first.finished]
    try:
        while True:
            yield await queue.get()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def engine_failure(e: Exception) -> ApiError:
    """An answer's stream (or its start) raising: 503 while the engine thread is not running, else 500."""
    if isinstance(e, EngineStopped):
        return ApiError(f"the engine is not running ({e}); retry later", 503)
    if isinstance(e, ApiError):
        return e
    return ApiError(f"the request failed in the engine: {type(e).__name__}: {e}", 500)
