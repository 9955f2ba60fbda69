"""``POST /v1/responses``, ``GET /v1/responses/{id}`` and ``DELETE /v1/responses/{id}``: OpenAI's Responses API over
the engine (``responses_api`` translates, ``driver.Driver`` drives, ``response_store`` keeps them). Errors are OpenAI's
shape; an unknown ``previous_response_id`` or id is a 404. A stream that fails after it began ends with a
``response.failed`` event."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from . import responses_api as api
from .answers import AnswerDeltas, whole_answer
from .driver import ClientLeft, Driver, JSONResponse, close, engine_failure, fail, merged
from .openai_api import ApiError, ParsedRequest, logprobs_body
from .request import RequestOutput
from .response_store import ResponseStore

__all__ = ["ResponsesRoutes"]

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ResponsesRoutes:
    """The Responses API's routes for one app (``routes``), its responses kept in ``store``."""

    def __init__(self, driver: Driver, store: ResponseStore | None = None) -> None:
        self.driver = driver
        self.store = store if store is not None else ResponseStore()

    @property
    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
                Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"])]  # fmt: skip

    def _stored(self, rid: object, param: str | None = None) -> list[dict[str, Any]]:
        """The conversation of stored response ``rid``; a 404 naming ``param`` when there is none."""
        stored = self.store.get(rid) if isinstance(rid, str) else None
        if stored is None:
            code = "previous_response_not_found" if param else None
            raise ApiError(f"Response with id '{str(rid)[:80]}' not found.", 404, param, code=code)
        return stored.conversation

    async def create(self, request: Request) -> Response:
        d = self.driver
        if not d.authorized(request):
            return fail(ApiError("a valid API key is required (Authorization: Bearer KEY)", 401))
        created = int(time.time())
        outputs: list[AsyncIterator[RequestOutput]] = []
        try:
            body = await d.read_json(request)
            previous = body.get("previous_response_id") if isinstance(body, dict) else None
            history = None if previous is None else self._stored(previous, "previous_response_id")
            t = api.translate(body, history)
            parsed = await d.parse(t, lambda t: api.parse(t, d.tokenizer, [d.model_name], d.context, d.pool))
            firsts = await d.begin(parsed, request, outputs, field="input")
            rid = api.new_id("resp")
            if parsed.stream:
                return StreamingResponse(self.stream(rid, created, t, parsed, firsts, outputs),
                                         media_type="text/event-stream", headers=STREAM_HEADERS)  # fmt: skip
            (got,) = await d.collect(request, firsts, outputs)
        except ClientLeft:
            return Response(status_code=499)
        except ApiError as e:
            return fail(e)
        answer = whole_answer(parsed, got, d.tokenizer)
        logprobs = self._logprobs(parsed)
        entries = None if logprobs is None else logprobs([e for out in got for e in out.logprobs or ()])
        body = api.response_body(rid, created, parsed.model, t.echo, api.output_items(answer, entries), answer)
        self.keep(t, body)
        return JSONResponse(body)

    def _logprobs(self, parsed: ParsedRequest) -> Callable[[list], list] | None:
        """Token logprobs -> the ``output_text.logprobs`` items (chat's ``logprobs.content`` items), where asked."""
        if parsed.params.logprobs is None:
            return None
        return lambda entries: logprobs_body(entries, self.driver.tokenizer, chat=True)["content"]

    def keep(self, t: api.Translated, body: dict[str, Any]) -> None:
        if t.store:
            self.store.put(body, [*t.conversation, api.assistant_turn(body["output"])])

    async def retrieve(self, request: Request) -> Response:
        if not self.driver.authorized(request):
            return fail(ApiError("a valid API key is required (Authorization: Bearer KEY)", 401))
        rid = request.path_params["response_id"]
        stored = self.store.get(rid)
        if stored is None:
            return fail(ApiError(f"Response with id '{rid[:80]}' not found.", 404))
        return JSONResponse(stored.body)

    async def delete(self, request: Request) -> Response:
        if not self.driver.authorized(request):
            return fail(ApiError("a valid API key is required (Authorization: Bearer KEY)", 401))
        rid = request.path_params["response_id"]
        if not self.store.delete(rid):
            return fail(ApiError(f"Response with id '{rid[:80]}' not found.", 404))
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    async def stream(
        self, rid: str, created: int, t: api.Translated, parsed: ParsedRequest, firsts: list[RequestOutput],
        outputs: list,
    ) -> AsyncIterator[str]:  # fmt: skip
        events = api.ResponseEvents(api.response_body(rid, created, parsed.model, t.echo, [], None),
                                    self._logprobs(parsed))  # fmt: skip
        deltas = AnswerDeltas(parsed, self.driver.tokenizer)
        answers = merged(firsts, outputs)
        try:
            for e in events.start():
                yield e
            async for _, out in answers:
                if isinstance(out, Exception) or out.finish_reason == "error":
                    why = engine_failure(out) if isinstance(out, Exception) else ApiError(
                        f"the request failed in the engine: {out.error}", 500)  # fmt: skip
                    yield events.failed(why.message)
                    break
                for e in events.deltas(deltas.feed(out), out.logprobs or ()):
                    yield e
                if out.finished:
                    last, body = events.end(deltas.end)
                    self.keep(t, body)
                    for e in last:
                        yield e
                    break
        finally:
            await answers.aclose()
            await close(outputs)  # a client that left: the request is aborted, its blocks freed
