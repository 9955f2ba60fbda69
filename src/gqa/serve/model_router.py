"""Several models behind one server: an ASGI app in front of one ``server.build_app`` app per model, which picks the
app by the request body's ``model``, loads a model on its first request and unloads the least recently used one when
a count or a memory budget would be exceeded (``loaded_models``).

    POST /v1/...     routed by the JSON body's ``model`` (the body is read here and replayed to the model's app, so
                     every route of ``build_app`` works unchanged, streaming included); an unknown model is a 404
                     naming the served ones, a body without ``model`` a 400 naming the field
    GET  /v1/models  every served model, ``"loaded": true/false`` (``/v1/models/{id}``: one of them)
    GET  /health     ok while every loaded model's engine runs; ``models``: each one's state
    GET  /metrics    the loaded models' metrics with a ``model`` label, and the loads and unloads
    other requests   (no body to route by: ``GET /v1/responses/{id}``) the loaded models' apps, most recently used
                     first, until one answers other than 404

A request for a model being loaded waits for that one load (at most ``load_wait`` seconds: then 503, retry later).
Loads and unloads happen one at a time. An unload first lets the model's running requests finish (at most
``drain_seconds``: then its engine aborts them), then runs the app's shutdown (its engine thread stops), drops every
reference, collects and hands the freed heap back to the system (``malloc_trim``), so that the memory really goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import json
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.responses import JSONResponse, PlainTextResponse, Response

from .asgi_calls import ASGIApp, Lifespan, Message, Receive, Send, get, read_body, replay
from .loaded_models import LoadedModels
from .openai_api import ApiError, error_body

__all__ = ["LOAD_WAIT_SECONDS", "Loaded", "ModelRouter", "ServedModel", "merged_metrics"]

LOAD_WAIT_SECONDS = 120.0  # a request waits this long at most for its model's load (then 503)
DRAIN_SECONDS = 30.0  # an unload lets running requests finish this long at most (uvicorn's graceful shutdown's time)
MAX_BODY_BYTES = 16 * 2**20


@dataclass
class Loaded:
    """A model loaded: its app (``build_app``'s, lifespan not started), its engine (``alive``), its bytes."""

    app: ASGIApp
    engine: object
    nbytes: int  # weights + KV pool


@dataclass
class ServedModel:
    """A model the router may load: ``load()`` (slow: run on a worker thread), and the bytes it is expected to take
    before its first load has told (the files' size, say)."""

    load: Callable[[], Loaded]
    nbytes: int


@dataclass
class Running:
    """A model's app serving: the requests in it now, whether it is being unloaded."""

    loaded: Loaded
    lifespan: Lifespan
    active: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    closing: bool = False

    def hold(self) -> None:
        """A request holds a slot in it: it is not unloaded under the request."""
        self.active += 1
        self.idle.clear()

    def release(self) -> None:
        self.active -= 1
        if not self.active:
            self.idle.set()


@dataclass
class Counts:
    loads: int = 0
    unloads: int = 0
    load_seconds: float = 0.0  # the last load's


class ModelRouter:
    """The ASGI app serving ``models`` (name -> ``ServedModel``), loaded on demand under ``loaded``'s bounds."""

    def __init__(
        self, models: dict[str, ServedModel], loaded: LoadedModels, api_key: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES, load_wait: float = LOAD_WAIT_SECONDS,
        drain_seconds: float = DRAIN_SECONDS,
    ) -> None:  # fmt: skip
        if not models:
            raise ValueError("models must name at least one model")
        self.models, self.loaded, self.api_key = models, loaded, api_key
        self.max_body_bytes, self.load_wait, self.drain_seconds = max_body_bytes, load_wait, drain_seconds
        self.counts = {name: Counts() for name in models}
        self._running: dict[str, Running] = {}
        self._loading: dict[str, asyncio.Task] = {}
        self._tickets: dict[str, list[asyncio.Future]] = {}  # the requests waiting for a model's load
        self._lock: asyncio.Lock | None = None  # one load or unload at a time (made on the serving loop)
        self._started = int(time.time())

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    # -- routing ---------------------------------------------------------------------------------------------------

    async def _http(self, scope: Message, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        try:
            if path in ("/health", "/metrics", "/v1/models") and method in ("GET", "HEAD"):
                if path == "/v1/models" and not self._authorized(scope):
                    raise self._unauthorized()
                answer = {"/health": self._health, "/metrics": self._metrics, "/v1/models": self._models}[path]
                response = await answer()
            elif path.startswith("/v1/models/") and method in ("GET", "HEAD"):
                if not self._authorized(scope):
                    raise self._unauthorized()
                response = self._model_card(path.removeprefix("/v1/models/"))
            elif method == "POST":
                body = await read_body(receive, self.max_body_bytes)
                name = self._model_of(scope, body)
                await self._serve(name, scope, replay(body, receive), send)
                return
            else:
                await self._first_found(scope, receive, send)
                return
        except ApiError as e:
            response = fail(e)
        await response(scope, receive, send)

    def _model_of(self, scope: Message, body: bytes) -> str:
        """The served model the body's ``model`` names; 401 before any word about the models to a client without the
        key, 4xx in OpenAI's shape for a body that names none of them."""
        if not self._authorized(scope):
            raise self._unauthorized()
        served = list(self.models)
        media = headers_of(scope).get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise ApiError(f"Content-Type must be application/json, got {media or 'none'!r}", 415)
        try:
            request = json.loads(body)
        except (ValueError, RecursionError) as e:
            raise ApiError(f"the request body is not valid JSON: {e}") from None
        model = request.get("model") if isinstance(request, dict) else None
        if model is None:
            raise ApiError(f"'model' is required: this server has {served}", param="model")
        if not isinstance(model, str):
            raise ApiError(f"'model' must be a string, got {type(model).__name__}", param="model")
        if model not in self.models:
            raise ApiError(f"the model '{model}' does not exist; this server has {served}", 404, "model",
                           code="model_not_found")  # fmt: skip
        return model

    async def _serve(self, name: str, scope: Message, receive: Receive, send: Send) -> None:
        """The request on model ``name``'s app, loaded first if it is not."""
        try:
            running = await self._ready(name)
        except ApiError as e:
            await fail(e)(scope, receive, send)
            return
        try:
            await running.loaded.app(dict(scope), receive, send)  # a copy: the app writes itself into its scope
        finally:
            running.release()

    async def _first_found(self, scope: Message, receive: Receive, send: Send) -> None:
        """A request with no body to route by: the loaded models' apps, most recently used first, until one answers
        other than 404 (its answer, or the last 404, goes back)."""
        answer: list[Message] = []
        for name in reversed(self.loaded.names):
            running = self._running.get(name)
            if running is None or running.closing:  # unloaded meanwhile: not loaded again for this
                continue
            answer = []

            async def hold(message: Message, answer: list[Message] = answer) -> None:
                answer.append(message)

            await self._serve(name, scope, receive, hold)
            if answer and answer[0]["type"] == "http.response.start" and answer[0]["status"] != 404:
                break
        if not answer:
            if not self._authorized(scope):  # the models are named to a client with the key only
                raise self._unauthorized()
            raise ApiError(f"{scope['method']} {scope['path']}: not found (no model is loaded; this server has "
                           f"{list(self.models)})", 404)  # fmt: skip
        for message in answer:
            await send(message)

    # -- loading and unloading -------------------------------------------------------------------------------------

    async def _ready(self, name: str) -> Running:
        """Model ``name``'s app with a slot held for this request (``release`` it): loaded now, or once the load under
        way (or a new one) is done; 503 past ``load_wait``, 500 if the load failed. A load hands its app to the
        requests that waited for it with their slots held, so no later load unloads it before they have run (else two
        models with room for one could unload each other for ever, serving nobody)."""
        running = self._running.get(name)
        if running is not None and not running.closing:
            self.loaded.touch(name)
            running.hold()
            return running
        ticket = asyncio.get_running_loop().create_future()
        self._tickets.setdefault(name, []).append(ticket)
        task = self._loading.get(name)
        if task is None or task.done():  # the load runs as a task of its own: a request that gives up leaves it
            task = self._loading[name] = asyncio.ensure_future(self._load(name))
            task.add_done_callback(self._loaded_callback(name))
        try:
            await asyncio.wait({ticket}, timeout=self.load_wait)
        except BaseException:  # cancelled: a slot handed over at that moment goes back
            if ticket.done() and not ticket.cancelled() and ticket.exception() is None:
                ticket.result().release()
            raise
        finally:
            if not ticket.done():  # gave up: the load leaves this request out
                self._tickets[name].remove(ticket)
                ticket.cancel()
        if ticket.cancelled():
            raise ApiError(f"the model '{name}' is still loading (waited {self.load_wait:g} s); retry later", 503)
        return ticket.result()  # the failed load's ApiError raises here

    def _loaded_callback(self, name: str) -> Callable[[asyncio.Task], None]:
        def done(task: asyncio.Task) -> None:
            if self._loading.get(name) is task:
                del self._loading[name]
            if not task.cancelled():
                task.exception()  # read: its requests were told (a failed load is not logged as never retrieved)

        return done

    async def _load(self, name: str) -> None:
        """Load ``name`` (once the models it must make room for are unloaded) and hand it to the requests waiting."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            try:
                running = self._running.get(name)  # loaded by the load before this one, or loaded now
                running = running or await self._bring_up(name)
            except BaseException as e:
                error = ApiError(f"the model '{name}' could not be loaded: {type(e).__name__}: {e}", 500)
                if not isinstance(e, Exception):  # the server is stopping
                    error = ApiError("the server is shutting down", 503)
                for ticket in self._tickets.pop(name, []):
                    ticket.set_exception(error)
                raise
            for ticket in self._tickets.pop(name, []):  # each slot held now, before another load may run
                running.hold()
                ticket.set_result(running)

    async def _bring_up(self, name: str) -> Running:
        """Load ``name`` under the lock, unloading the least recently used models that must make room."""
        served = self.models[name]
        for other in self.loaded.to_unload(name, served.nbytes):
            await self._unload(other)
        start = time.perf_counter()
        loaded = await asyncio.to_thread(served.load)
        lifespan = Lifespan(loaded.app)
        await lifespan.startup()  # the engine thread starts
        served.nbytes = loaded.nbytes  # what it really takes: the next load's estimate
        for other in self.loaded.to_unload(name, loaded.nbytes):  # more than estimated: more room
            await self._unload(other)
        self.loaded.add(name, loaded.nbytes)
        running = self._running[name] = Running(loaded, lifespan)
        counts = self.counts[name]
        counts.loads, counts.load_seconds = counts.loads + 1, time.perf_counter() - start
        say(f"loaded {name} in {counts.load_seconds:.2f} s ({loaded.nbytes / 2**30:.2f} GiB; loaded now: "
            f"{', '.join(self.loaded.names)})")  # fmt: skip
        return running

    async def _unload(self, name: str) -> None:
        """Unload ``name`` (under the lock): its requests finish (``drain_seconds`` at most), its app stops, its
        memory goes back to the system."""
        running = self._running[name]
        running.closing = True  # new requests for it wait for a load of their own
        self.loaded.remove(name)
        if running.active:
            try:
                await asyncio.wait_for(running.idle.wait(), self.drain_seconds)
            except asyncio.TimeoutError:
                say(f"unloading {name}: {running.active} request(s) still running after {self.drain_seconds:g} s "
                    "are aborted")  # fmt: skip
        try:
            await running.lifespan.shutdown()  # the engine thread stops (and aborts what is left)
        finally:
            del self._running[name]
            running.loaded = running.lifespan = None
            del running
            release_memory()
            self.counts[name].unloads += 1
            say(f"unloaded {name}")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """Nothing is loaded at startup (a model loads on its first request); at shutdown every loaded one stops."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                # what the imports made stays for good: an unload's collection then walks the models' objects alone
                # (0.05 s, not 0.2-0.3 s on 2 busy cores; the weights hang in reference cycles, so it must collect)
                gc.freeze()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    await self.close()
                except Exception as e:
                    await send({"type": "lifespan.shutdown.failed", "message": str(e)})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                return

    async def close(self) -> None:
        """Stop every loaded model (loads under way are cancelled)."""
        for task in list(self._loading.values()):
            task.cancel()
        await asyncio.gather(*self._loading.values(), return_exceptions=True)
        for name in list(self._running):
            running = self._running.pop(name)
            self.loaded.remove(name)
            await running.lifespan.shutdown()

    # -- the router's own routes -----------------------------------------------------------------------------------

    def _state(self, name: str) -> str:
        running = self._running.get(name)
        if running is not None:
            return "unloading" if running.closing else "loaded"
        task = self._loading.get(name)
        return "loading" if task is not None and not task.done() else "unloaded"

    async def _health(self) -> Response:
        states = {name: self._state(name) for name in self.models}
        stopped = [n for n, r in self._running.items() if not r.closing and not r.loaded.engine.alive]
        if stopped:
            return JSONResponse({"status": "engine stopped", "models": states}, status_code=503)
        return JSONResponse({"status": "ok", "models": states})

    def _card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self._started, "owned_by": "gqa",
                "loaded": self._state(name) == "loaded"}  # fmt: skip

    async def _models(self) -> Response:
        return JSONResponse({"object": "list", "data": [self._card(name) for name in self.models]})

    def _model_card(self, name: str) -> Response:
        if name not in self.models:
            raise ApiError(f"the model '{name}' does not exist; this server has {list(self.models)}", 404, "model",
                           code="model_not_found")  # fmt: skip
        return JSONResponse(self._card(name))

    async def _metrics(self) -> Response:
        own = {
            ("gqa_model_loaded", "gauge", "whether the model is loaded (1) or not (0)"):
                {n: int(self._state(n) == "loaded") for n in self.models},
            ("gqa_model_bytes", "gauge", "the loaded model's weights and KV pool, in bytes"):
                {n: self.loaded.nbytes_of(n) for n in self.models},
            ("gqa_model_loads_total", "counter", "loads of the model"): {n: c.loads for n, c in self.counts.items()},
            ("gqa_model_unloads_total", "counter", "unloads of the model"):
                {n: c.unloads for n, c in self.counts.items()},
            ("gqa_model_load_seconds", "gauge", "the model's last load, in seconds"):
                {n: round(c.load_seconds, 3) for n, c in self.counts.items()},
        }  # fmt: skip
        lines = []
        for (metric, kind, help_), values in own.items():
            lines += [f"# HELP {metric} {help_}", f"# TYPE {metric} {kind}"]
            lines += [f"{metric}{{model={label(n)}}} {v}" for n, v in values.items()]
        texts = {}
        for name, running in list(self._running.items()):
            if not running.closing:
                status, body = await get(running.loaded.app, "/metrics")
                if status == 200:
                    texts[name] = body.decode()
        text = "\n".join(lines) + "\n" + merged_metrics(texts)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def _authorized(self, scope: Message) -> bool:
        if self.api_key is None:
            return True
        headers = headers_of(scope)
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            token = headers.get("x-api-key", "")  # the Messages API's header
        return secrets.compare_digest(token.strip().encode(), self.api_key.encode())

    @staticmethod
    def _unauthorized() -> ApiError:
        return ApiError("a valid API key is required (Authorization: Bearer KEY)", 401)


def fail(e: ApiError) -> Response:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(error_body(e), status_code=e.status, headers=headers)


def headers_of(scope: Message) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def label(value: str) -> str:
    """A Prometheus label value, quoted."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def merged_metrics(texts: dict[str, str], key: str = "model") -> str:
    """Prometheus texts, one per model (or replica: ``key``), as one: every sample labelled ``model="name"``, each
    metric's ``# HELP`` and ``# TYPE`` once, its samples together."""
    heads: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for source, text in texts.items():
        family = None
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split()[2]
                head = heads.setdefault(family, [])
                samples.setdefault(family, [])
                if line not in head:
                    head.append(line)
            elif line.strip() and not line.startswith("#") and family is not None:
                metric, _, value = line.rpartition(" ")
                name, brace, rest = metric.partition("{")
                labels = f"{key}={label(source)}" + ("," + rest[:-1] if brace and rest != "}" else "")
                samples[family].append(f"{name}{{{labels}}} {value}")
    return "".join("\n".join(heads[f] + samples[f]) + "\n" for f in heads)


def say(text: str) -> None:
    print(f"gqa serve: {text}", file=sys.stderr, flush=True)


def release_memory() -> None:
    """Collect what an unloaded model left (reference cycles) and hand the freed memory back: glibc keeps freed heap
    for reuse, so without ``malloc_trim`` the server's RSS would not go down; torch's CUDA allocator keeps freed
    device memory cached until ``empty_cache``."""
    gc.collect()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # not glibc (musl): nothing to trim with
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    torch = sys.modules.get("torch")  # loaded by then (the models are torch's); never imported here
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
