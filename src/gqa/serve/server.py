"""``gqa serve``'s HTTP side: an OpenAI-compatible API on starlette, served by uvicorn.

    POST /v1/chat/completions, POST /v1/completions   (``"stream": true``: server-sent events, ``data: [DONE]`` last)
    GET  /v1/models, GET /health, GET /metrics          (Prometheus text)

Errors come in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``) with a 4xx status: malformed
JSON, a missing or wrongly typed field, an unknown model, a prompt that does not fit (before any work); 429 with
``Retry-After`` when the queue is full; 401 without the ``--api-key`` bearer token; 503 while the engine thread is not
running (never a request that waits on a thread that is gone). A client that disconnects
mid-stream has its request aborted. On SIGTERM uvicorn stops accepting connections and lets running responses
finish (up to ``graceful_seconds``; what is left is cancelled), then the engine thread stops.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .async_engine import AsyncEngine, EngineStopped, QueueFull
from .openai_api import (
    ApiError,
    ParsedRequest,
    completion_body,
    error_body,
    logprobs_body,
    new_id,
    parse_chat,
    parse_completion,
    usage,
)
from .request import EngineError, RequestOutput

__all__ = ["build_app"]


MAX_BODY_BYTES = 16 * 2**20  # a request body larger than this gets 413 (--max-body-mib)


def build_app(
    engine: AsyncEngine, tokenizer, model_name: str, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES
) -> Starlette:
    """The ASGI app serving ``engine`` (started and stopped with the app's lifespan) as model ``model_name``."""
    context = engine.engine.config.max_position_embeddings
    blocks = engine.engine.blocks
    pool = blocks.num_blocks * blocks.block_size  # token slots of the KV cache: what one request can fill at most
    started = int(time.time())

    def fail(e: ApiError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status in (429, 503) else None
        return JSONResponse(error_body(e), status_code=e.status, headers=headers)

    def authorized(request: Request) -> bool:
        if api_key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())

    async def read_json(request: Request) -> object:
        """The body as JSON: 415 unless its Content-Type is JSON (a plain-text POST is a request any web page can
        send cross-origin), 413 past ``max_body_bytes`` (checked on the declared length, then while reading)."""
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise ApiError(f"Content-Type must be application/json, got {media or 'none'!r}", 415)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise ApiError(f"the request body ({int(declared)} bytes) exceeds the limit of {max_body_bytes}", 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise ApiError(f"the request body exceeds the limit of {max_body_bytes} bytes", 413)
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(f"the request body is not valid JSON: {e}") from e

    async def health(request: Request) -> Response:
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        if not authorized(request):
            return fail(ApiError("a valid API key is required (Authorization: Bearer KEY)", 401))
        card = {"id": model_name, "object": "model", "created": started, "owned_by": "gqa"}
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics(request: Request) -> Response:
        s = engine.stats()
        lines = []
        for name, kind, help_, value in (
            ("gqa_requests_waiting", "gauge", "requests waiting for a batch slot or blocks", s.waiting),
            ("gqa_requests_running", "gauge", "requests in the running batch", s.running),
            ("gqa_requests_in_flight", "gauge", "requests accepted and not finished", engine.in_flight),
            ("gqa_kv_blocks_free", "gauge", "KV cache blocks free (cached idle blocks included)", s.kv_blocks_free),
            ("gqa_kv_blocks_used", "gauge", "KV cache blocks in use", s.kv_blocks - s.kv_blocks_free),
            ("gqa_kv_block_size", "gauge", "token slots per KV block", s.kv_block_size),
            ("gqa_prefix_cache_hits_total", "counter", "prompt blocks served from the prefix cache",
             s.prefix_cache_hits),
            ("gqa_prefix_cache_queries_total", "counter", "full prompt blocks looked up", s.prefix_cache_queries),
            ("gqa_prompt_tokens_total", "counter", "prompt tokens prefilled", s.prompt_tokens),
            ("gqa_generation_tokens_total", "counter", "tokens generated", s.generation_tokens),
            ("gqa_preemptions_total", "counter", "requests preempted for blocks", s.preemptions),
            ("gqa_engine_errors_total", "counter", "engine steps that raised", engine.errors),
            ("gqa_generation_tokens_per_second", "gauge", "tokens generated per second over the last 10 s",
             round(engine.tokens_per_second(), 3)),
        ):  # fmt: skip
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    def prepare(body: object, chat: bool) -> ParsedRequest:
        """The request parsed and checked, its grammar (if any) compiled."""
        parsed = (parse_chat if chat else parse_completion)(body, tokenizer, [model_name], context, pool)
        if parsed.params.structured is not None:
            try:
                engine.engine.compile(parsed.params)
            except EngineError as e:
                raise ApiError(str(e), param=parsed.structured_field) from e
        return parsed

    async def completions(request: Request, chat: bool) -> Response:
        if not authorized(request):
            return fail(ApiError("a valid API key is required (Authorization: Bearer KEY)", 401))
        created = int(time.time())
        try:
            body = await read_json(request)
            # tokenizing, the chat template and a grammar's compilation off the event loop: a huge prompt or schema
            # must not stall /health
            parsed = await asyncio.to_thread(prepare, body, chat)
            outputs = engine.generate(parsed.prompt_ids, parsed.params)
            first = await anext(outputs)  # raises here, before any response, for a request the engine refuses
        except ApiError as e:
            return fail(e)
        except EngineError as e:
            return fail(ApiError(str(e), param="messages" if chat else "prompt"))
        except QueueFull as e:
            return fail(ApiError(f"the server is busy ({e}); retry later", 429))
        except Exception as e:  # EngineStopped: 503; anything else the engine raised: 500 — never a hang
            return fail(engine_failure(e))
        rid = new_id("chatcmpl" if chat else "cmpl")
        if parsed.stream:
            return StreamingResponse(
                stream(rid, parsed.model, first, outputs, chat, parsed.include_usage, created,
                       parsed.params.logprobs is not None),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )  # fmt: skip
        pieces, ends = [first.text], [first]

        async def collect() -> None:
            async for out in outputs:
                pieces.append(out.text)
                ends.append(out)

        async def client_left() -> None:  # the body is read: the next message is the disconnect
            while (await request.receive())["type"] != "http.disconnect":
                pass

        task, left = asyncio.ensure_future(collect()), asyncio.ensure_future(client_left())
        try:
            await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():  # a client that leaves before its whole response: the request is aborted
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await outputs.aclose()
                return Response(status_code=499)
            task.result()
        except Exception as e:
            return fail(engine_failure(e))
        finally:
            left.cancel()
        text, last = "".join(pieces), ends[-1]
        if last.finish_reason == "error":
            return fail(ApiError(f"the request failed in the engine: {last.error}", 500))
        use = usage(last.prompt_tokens, last.completion_tokens)
        logprobs = None
        if parsed.params.logprobs is not None:
            logprobs = logprobs_body([e for out in ends for e in out.logprobs or ()], tokenizer, chat)
        return JSONResponse(completion_body(rid, parsed.model, text, last.finish_reason, use, chat, created, logprobs))

    async def stream(
        rid: str, model: str, first: RequestOutput, outputs: AsyncIterator[RequestOutput], chat: bool,
        with_usage: bool, created: int, with_logprobs: bool,
    ) -> AsyncIterator[str]:  # fmt: skip
        def event(body: dict) -> str:
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        try:
            if chat:
                head = completion_body(rid, model, "", None, None, chat, created)
                head["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield event(head)
            # the logprobs of tokens whose text is still held back, and the text offset where they start
            out, pending, offset = first, [], 0
            while True:
                if out.finish_reason == "error":
                    yield event(error_body(ApiError(f"the request failed in the engine: {out.error}", 500)))
                    break
                pending += out.logprobs or ()
                if out.text or out.finished:
                    logprobs = logprobs_body(pending, tokenizer, chat, offset) if with_logprobs else None
                    if logprobs is not None and not chat:
                        offset += sum(len(s) for s in logprobs["tokens"])
                    pending = []
                    yield event(completion_body(rid, model, out.text, out.finish_reason, None, chat, created, logprobs))
                if out.finished:
                    if with_usage:
                        body = completion_body(rid, model, "", None, None, chat, created)
                        body["choices"], body["usage"] = [], usage(out.prompt_tokens, out.completion_tokens)
                        yield event(body)
                    break
                try:
                    out = await anext(outputs)
                except Exception as e:  # the engine stopped mid-stream: an error event, then the stream's end
                    yield event(error_body(engine_failure(e)))
                    break
            yield "data: [DONE]\n\n"
        finally:
            await outputs.aclose()  # a client that left: the request is aborted, its blocks freed

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    async def completion(request: Request) -> Response:
        return await completions(request, chat=False)

    async def chat_completion(request: Request) -> Response:
        return await completions(request, chat=True)

    def engine_failure(e: Exception) -> ApiError:
        if isinstance(e, EngineStopped):
            return ApiError(f"the engine is not running ({e}); retry later", 503)
        return ApiError(f"the request failed in the engine: {type(e).__name__}: {e}", 500)

    routes = [
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/models", models),
        Route("/v1/completions", completion, methods=["POST"]),
        Route("/v1/chat/completions", chat_completion, methods=["POST"]),
    ]

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return fail(ApiError(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code))

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
