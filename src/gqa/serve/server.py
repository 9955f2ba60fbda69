"""``gqa serve``'s HTTP side: an OpenAI-compatible API on starlette, served by uvicorn.

    POST /v1/chat/completions, POST /v1/completions   (``"stream": true``: server-sent events, ``data: [DONE]`` last)
    POST /v1/messages, POST /v1/messages/count_tokens (Anthropic's Messages API: ``messages_routes``)
    POST /v1/responses, GET|DELETE /v1/responses/{id} (OpenAI's Responses API: ``responses_routes``)
    GET  /v1/models, /v1/models/{id}, GET /health, GET /metrics          (Prometheus text)

What every API does with the engine (the body, the key, grammars, starting, reading and aborting answers) is
``driver.Driver``'s; this module holds the OpenAI chat and completions routes and puts the app together.

Errors come in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``; the Messages API's in Anthropic's,
``{"type": "error", "error": {"type", "message"}}``) with a 4xx status: malformed JSON, a missing or wrongly typed
field, an unknown model, a prompt that does not fit (before any work); 429 with ``Retry-After`` when the queue is
full; 401 without the ``--api-key`` bearer token (or, for the Messages API, ``x-api-key``); 503 while the engine
thread is not running (never a request that waits on a thread that is gone). A client that disconnects
mid-stream has its request aborted. On SIGTERM uvicorn stops accepting connections and lets running responses
finish (up to ``graceful_seconds``; what is left is cancelled), then the engine thread stops.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .async_engine import AsyncEngine
from .driver import ClientLeft, Driver, JSONResponse, close, engine_failure, fail, merged
from .messages_routes import MessagesRoutes
from .messages_routes import fail as anthropic_fail
from .openai_api import (
    ApiError,
    ParsedRequest,
    TextOffsets,
    completion_body,
    error_body,
    logprobs_body,
    new_id,
    parse_chat,
    parse_completion,
    to_json,
    usage,
)
from .prompt_logprobs import prompt_logprobs
from .request import RequestOutput
from .responses_routes import ResponsesRoutes
from .tool_stream import ToolCallStream
from .tools import finish_reason, tool_calls_in

__all__ = ["build_app"]


MAX_BODY_BYTES = 16 * 2**20  # a request body larger than this gets 413 (--max-body-mib)


def whole(body: dict) -> JSONResponse:
    """A whole answer's response; one holding a number JSON cannot carry is a 500 in OpenAI's shape (never invalid
    JSON, never a plain-text 500)."""
    try:
        return JSONResponse(body)
    except ValueError as e:
        return JSONResponse(error_body(ApiError(f"the response cannot be written as JSON: {e}", 500)), 500)


def event(body: dict) -> str:
    """``body`` as a server-sent event; one holding a number JSON cannot carry is an error event instead."""
    try:
        return f"data: {to_json(body)}\n\n"
    except ValueError as e:
        return f"data: {to_json(error_body(ApiError(f'the response cannot be written as JSON: {e}', 500)))}\n\n"


def build_app(
    engine: AsyncEngine, tokenizer, model_name: str, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES
) -> Starlette:
    """The ASGI app serving ``engine`` (started and stopped with the app's lifespan) as model ``model_name``."""
    driver = Driver(engine, tokenizer, model_name, api_key, max_body_bytes)
    started = int(time.time())

    async def health(request: Request) -> Response:
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    card = {"id": model_name, "object": "model", "created": started, "owned_by": "gqa"}

    async def models(request: Request) -> Response:
        if not driver.authorized(request):
            return fail(ApiError("a valid API key is required (Authorization: Bearer KEY)", 401))
        return JSONResponse({"object": "list", "data": [card]})

    async def model(request: Request) -> Response:  # the openai client's models.retrieve
        if not driver.authorized(request):
            return fail(ApiError("a valid API key is required (Authorization: Bearer KEY)", 401))
        name = request.path_params["name"]
        if name != model_name:
            return fail(ApiError(f"the model '{name}' does not exist; this server has {[model_name]}", 404, "model",
                                 code="model_not_found"))  # fmt: skip
        return JSONResponse(card)

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
            ("gqa_prefix_cache_hits_total", "counter",
             "prompt blocks served from the prefix cache (requests admitted the first time)", s.prefix_cache_hits),
            ("gqa_prefix_cache_queries_total", "counter",
             "full prompt blocks of the requests admitted the first time (hit or computed)", s.prefix_cache_queries),
            ("gqa_prefix_cache_resumed_hits_total", "counter",
             "prompt blocks served from the prefix cache to requests taken up again after preemption",
             s.prefix_cache_resumed_hits),
            ("gqa_prefix_cache_resumed_queries_total", "counter",
             "full prompt blocks of the requests taken up again after preemption", s.prefix_cache_resumed_queries),
            ("gqa_prefix_cache_disk_hits_total", "counter", "prompt blocks read from --prefix-cache-dir",
             s.prefix_cache_disk_hits),
            ("gqa_prompt_tokens_total", "counter", "prompt tokens prefilled", s.prompt_tokens),
            ("gqa_generation_tokens_total", "counter", "tokens generated", s.generation_tokens),
            ("gqa_preemptions_total", "counter", "requests preempted for blocks", s.preemptions),
            ("gqa_draft_tokens_total", "counter", "draft tokens verified (--speculate)", s.draft_tokens),
            ("gqa_draft_tokens_accepted_total", "counter", "draft tokens accepted", s.draft_tokens_accepted),
            ("gqa_steps_total", "counter", "engine steps run", s.steps),
            ("gqa_cuda_graph_steps_total", "counter", "steps replayed from a CUDA graph (--device cuda)",
             s.cuda_graph_steps),
            ("gqa_engine_errors_total", "counter", "engine steps that raised", engine.errors),
            ("gqa_generation_tokens_per_second", "gauge", "tokens generated per second over the last 10 s",
             round(engine.tokens_per_second(), 3)),
        ):  # fmt: skip
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def completions(request: Request, chat: bool) -> Response:
        if not driver.authorized(request):
            return fail(ApiError("a valid API key is required (Authorization: Bearer KEY)", 401))
        created = int(time.time())
        parse = parse_chat if chat else parse_completion
        outputs: list[AsyncIterator[RequestOutput]] = []  # one per answer (``n``)
        try:
            body = await driver.read_json(request)
            parsed = await driver.parse(body, lambda b: parse(b, tokenizer, [model_name], driver.context, driver.pool))
            grammar = await driver.compiled(parsed, request)  # held until the answers hold it: the engine finds it
            if parsed.prompt_logprobs is not None or parsed.score_only:  # the model reads the prompt before start():
                engine.engine.check(parsed.prompt_ids, parsed.params)  # check it now (vocabulary, context)
            prompt_entries = await scored(parsed)
            if parsed.score_only:
                return score_response(new_id("cmpl"), parsed, prompt_entries, created)
            firsts = await driver.start(parsed, outputs)  # raises here, before any response, for a request refused
            del grammar  # each answer's grammar state holds it now
        except ClientLeft:
            return Response(status_code=499)
        except ApiError as e:
            return fail(e)
        except Exception as e:  # the engine refusing the request (400), a full queue (429), a stopped engine (503)
            return fail(driver.refusal(e, "messages" if chat else "prompt"))
        rid = new_id("chatcmpl" if chat else "cmpl")
        if parsed.stream:
            return StreamingResponse(
                stream(rid, parsed, firsts, outputs, chat, created, prompt_entries),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )  # fmt: skip
        try:
            ends = await driver.collect(request, firsts, outputs)
        except ClientLeft:
            return Response(status_code=499)
        except ApiError as e:
            return fail(e)
        choices = []
        kept = ends if parsed.best_of is None else best(ends, parsed.best_of)
        for got in kept:
            last = got[-1]
            logprobs = None
            if parsed.params.logprobs is not None and not parsed.hide_logprobs:
                entries = [*(prompt_entries or ()), *(e for out in got for e in out.logprobs or ())]
                logprobs = logprobs_body(entries, tokenizer, chat)
            text = parsed.echo + "".join(out.text for out in got)
            choices.append(completion_body(rid, parsed.model, text, last.finish_reason, {}, chat, created, logprobs))
            if parsed.tools is not None and parsed.tools.choice != "none":  # what the stream sends (tool_stream)
                content, calls = tool_calls_in(text, parsed.tools)
                choice = choices[-1]["choices"][0]
                choice["message"] = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
                choice["finish_reason"] = finish_reason([c["function"]["arguments"] for c in calls], last.finish_reason)
        body = choices[0]
        body["choices"] = [c["choices"][0] | {"index": i} for i, c in enumerate(choices)]
        body["usage"] = usage(firsts[0].prompt_tokens, sum(got[-1].completion_tokens for got in ends))
        return whole(body)

    def best(ends: list[list[RequestOutput]], n: int) -> list[list[RequestOutput]]:
        """The ``n`` answers with the highest mean logprob of their tokens (``best_of``), best first; ties by order."""

        def mean_logprob(got: list[RequestOutput]) -> float:
            values = [lp for out in got for _, lp, _ in out.logprobs or ()]
            return sum(values) / len(values) if values else float("-inf")

        order = sorted(range(len(ends)), key=lambda i: (-mean_logprob(ends[i]), i))
        return [ends[i] for i in order[:n]]

    async def scored(parsed: ParsedRequest) -> list | None:
        """The prompt's own logprobs (echo with logprobs), computed in the engine thread; None when not asked."""
        if parsed.prompt_logprobs is None:
            return None
        top, ids = parsed.prompt_logprobs, parsed.prompt_ids
        return await engine.run_in_engine(lambda e: prompt_logprobs(e.runner.model, ids, top))

    def score_response(rid: str, parsed: ParsedRequest, entries: list | None, created: int) -> Response:
        """``echo`` with ``max_tokens: 0``: each choice is the prompt (with its logprobs), nothing generated."""
        logprobs = None if entries is None else logprobs_body(entries, tokenizer, False)
        body = completion_body(rid, parsed.model, parsed.echo, "length", None if parsed.stream else {}, False,
                               created, logprobs)  # fmt: skip
        body["choices"] = [body["choices"][0] | {"index": i} for i in range(parsed.best_of or parsed.n)]
        if not parsed.stream:
            body["usage"] = usage(len(parsed.prompt_ids), 0)
            return whole(body)
        events = [event(body)]
        if parsed.include_usage:
            tail = body | {"choices": [], "usage": usage(len(parsed.prompt_ids), 0)}
            events.append(event(tail))
        events.append("data: [DONE]\n\n")
        return StreamingResponse(iter(events), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def stream(
        rid: str, parsed: ParsedRequest, firsts: list[RequestOutput], outputs: list, chat: bool, created: int,
        prompt_entries: list | None = None,
    ) -> AsyncIterator[str]:  # fmt: skip
        def chunk(i: int, text: str, reason: str | None, logprobs: dict | None = None) -> dict:
            body = completion_body(rid, parsed.model, text, reason, None, chat, created, logprobs)
            body["choices"][0]["index"] = i
            return body

        n = parsed.n
        # per answer: the logprobs of tokens whose text is still held back, the text offsets counted so far (the
        # echoed prompt's, then its own: across chunks), and the tokens it generated once it finished
        pending, offsets, tokens = [[] for _ in range(n)], [TextOffsets() for _ in range(n)], [None] * n
        calling = None  # per answer, its tool calls read as they stream
        if parsed.tools is not None and parsed.tools.choice != "none":
            calling = [ToolCallStream(parsed.tools) for _ in range(n)]
        answers = merged(firsts, outputs)
        try:
            for i in range(n):
                if chat:
                    head = chunk(i, "", None)
                    head["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                    yield event(head)
                elif parsed.echo:
                    logprobs = None
                    if prompt_entries is not None:  # the prompt's own logprobs go with its text
                        logprobs = logprobs_body(prompt_entries, tokenizer, False, offsets[i])
                    yield event(chunk(i, parsed.echo, None, logprobs))
            async for i, out in answers:
                if isinstance(out, Exception):  # the engine stopped mid-stream: an error event, then the stream's end
                    yield event(error_body(engine_failure(out)))
                    break
                if out.finish_reason == "error":
                    yield event(error_body(ApiError(f"the request failed in the engine: {out.error}", 500)))
                    break
                pending[i] += out.logprobs or ()
                if calling is not None:  # an answer that may call tools: its content and calls as they come
                    content, calls = calling[i].feed(out.text)
                    if out.finished:
                        more, last = calling[i].finish()
                        content, calls = content + more, calls + last
                    sends = [chunk(i, content, None)] if content else []
                    if calls:
                        sends.append(chunk(i, "", None))
                        sends[-1]["choices"][0]["delta"] = {"tool_calls": calls}
                    if out.finished:
                        sends.append(chunk(i, "", calling[i].finish_reason(out.finish_reason)))
                    if sends and pending[i] and parsed.params.logprobs is not None:  # the tokens held back so far go
                        logprobs = logprobs_body(pending[i], tokenizer, chat, offsets[i])  # with the next chunk sent
                        sends[0]["choices"][0]["logprobs"], pending[i] = logprobs, []
                    for body in sends:
                        yield event(body)
                elif out.text or out.finished:
                    logprobs = None
                    if parsed.params.logprobs is not None:
                        logprobs = logprobs_body(pending[i], tokenizer, chat, offsets[i])
                    pending[i] = []
                    yield event(chunk(i, out.text, out.finish_reason, logprobs))
                if out.finished:
                    tokens[i] = out.completion_tokens
                    if all(t is not None for t in tokens):
                        if parsed.include_usage:
                            body = chunk(0, "", None)
                            body["choices"], body["usage"] = [], usage(out.prompt_tokens, sum(tokens))
                            yield event(body)
                        break
            yield "data: [DONE]\n\n"
        finally:
            await answers.aclose()
            await close(outputs)  # a client that left: the unfinished requests are aborted, their blocks freed

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:  # off the event loop (a model the router unloads: the other models' requests go on meanwhile)
            await engine.aclose()

    async def completion(request: Request) -> Response:
        return await completions(request, chat=False)

    async def chat_completion(request: Request) -> Response:
        return await completions(request, chat=True)

    routes = [
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/models", models),
        Route("/v1/models/{name:path}", model),
        Route("/v1/completions", completion, methods=["POST"]),
        Route("/v1/chat/completions", chat_completion, methods=["POST"]),
        *MessagesRoutes(driver).routes,
        *ResponsesRoutes(driver).routes,
    ]

    def failed(request: Request, e: ApiError) -> Response:
        """An error no route answered, in the shape of the API the path belongs to."""
        return (anthropic_fail if request.url.path.startswith("/v1/messages") else fail)(e)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return failed(request, ApiError(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code))

    async def unexpected(request: Request, exc: Exception) -> Response:
        # the last net under every route: a bug still answers in the API's error shape (the client's library reads it),
        # never starlette's plain-text 500; starlette re-raises it afterwards, so the server's log keeps the traceback
        message = f"{request.method} {request.url.path} failed: {type(exc).__name__}: {exc}"
        return failed(request, ApiError(message, 500))

    handlers = {HTTPException: http_error, Exception: unexpected}
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
