"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API over the engine
(``anthropic_api`` translates, ``driver.Driver`` drives). A key is taken as ``x-api-key`` (Anthropic's clients) or
``Authorization: Bearer``; ``anthropic-version`` is accepted and not needed. Errors are Anthropic's shape, with its
statuses (a stream that fails after it began ends with an ``error`` event)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from .answers import AnswerDeltas, whole_answer
from .anthropic_api import MessageEvents, count_tokens, error_body, event, message_body, new_id, parse_messages
from .driver import ClientLeft, Driver, JSONResponse, close, engine_failure, merged
from .openai_api import ApiError, ParsedRequest
from .request import RequestOutput

__all__ = ["MessagesRoutes", "fail"]

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def fail(e: ApiError) -> JSONResponse:
    """``e`` answered in Anthropic's shape; ``Retry-After`` where retrying later helps."""
    headers = {"Retry-After": "1"} if e.status in (429, 503, 529) else None
    return JSONResponse(error_body(e), status_code=e.status, headers=headers)


class MessagesRoutes:
    """The Messages API's routes for one app (``routes``)."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    @property
    def routes(self) -> list[Route]:
        return [Route("/v1/messages", self.create, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])]  # fmt: skip

    async def create(self, request: Request) -> Response:
        d = self.driver
        if not d.authorized(request, x_api_key=True):
            return fail(ApiError("a valid API key is required (x-api-key: KEY)", 401))
        outputs: list[AsyncIterator[RequestOutput]] = []
        try:
            body = await d.read_json(request)
            parsed = await d.parse(body, lambda b: parse_messages(b, d.tokenizer, [d.model_name], d.context, d.pool))
            firsts = await d.begin(parsed, request, outputs)
            rid = new_id("msg")
            if parsed.stream:
                return StreamingResponse(self.stream(rid, parsed, firsts, outputs), media_type="text/event-stream",
                                         headers=STREAM_HEADERS)  # fmt: skip
            (got,) = await d.collect(request, firsts, outputs)
        except ClientLeft:
            return Response(status_code=499)
        except ApiError as e:
            return fail(e)
        return JSONResponse(message_body(rid, parsed.model, whole_answer(parsed, got, d.tokenizer)))

    async def count_tokens(self, request: Request) -> Response:
        d = self.driver
        if not d.authorized(request, x_api_key=True):
            return fail(ApiError("a valid API key is required (x-api-key: KEY)", 401))
        try:
            body = await d.read_json(request)
            n = await asyncio.to_thread(count_tokens, body, d.tokenizer, [d.model_name])  # off the loop: a template
        except ApiError as e:
            return fail(e)
        return JSONResponse({"input_tokens": n})

    async def stream(
        self, rid: str, parsed: ParsedRequest, firsts: list[RequestOutput], outputs: list
    ) -> AsyncIterator[str]:
        events, deltas = MessageEvents(rid, parsed.model), AnswerDeltas(parsed, self.driver.tokenizer)
        answers = merged(firsts, outputs)
        try:
            for e in events.start(firsts[0].prompt_tokens):
                yield e
            async for _, out in answers:
                if isinstance(out, Exception) or out.finish_reason == "error":
                    why = engine_failure(out) if isinstance(out, Exception) else ApiError(
                        f"the request failed in the engine: {out.error}", 500)  # fmt: skip
                    yield event("error", {"error": error_body(why)["error"]})
                    break
                for e in events.deltas(deltas.feed(out)):
                    yield e
                if out.finished:
                    for e in events.end(deltas.end):
                        yield e
                    break
        finally:
            await answers.aclose()
            await close(outputs)  # a client that left: the request is aborted, its blocks freed
