"""One HTTP front over several replicas of the server (``gqa serve --replicas N``): an ASGI app that passes each
request to a replica's own ``gqa serve`` (over HTTP, with ``httpx2``; SGLang's router does the same) and its answer,
streamed, back.

    POST /v1/...              sent to the replica ``replica_routing.ReplicaRouter`` picks from the body's prompt (a
                              ``previous_response_id``: the replica that holds it); a replica that cannot be reached
                              is marked down and the request goes to another; one that fails while answering ends the
                              answer with a 503 in OpenAI's shape (an SSE ``error`` event once streaming)
    GET  /health              the replicas' states; 200 while one serves, else 503
    GET  /metrics             each replica's metrics labelled ``replica="i"``, their sums as ``replica="all"``, and
                              the front's: requests sent to each replica, and why, and whether it is up
    other requests            (``GET /v1/models``, ``GET`` / ``DELETE /v1/responses/{id}``) each serving replica in
                              turn until one answers other than 404

A client that disconnects closes its request to the replica (which then cancels it). Every ``health_interval``
seconds each replica's ``/health`` is asked (and its process, when it is a local one): a replica whose process ended,
whose engine stopped (503), or that did not answer for ``hang_seconds`` is marked down, reported and never sent a
request again; when none is left ``on_all_down`` is called (the CLI stops the front: exit 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx2
from starlette.responses import JSONResponse, PlainTextResponse, Response

from .asgi_calls import Message, Receive, Send, read_body
from .model_router import MAX_BODY_BYTES, fail, merged_metrics
from .openai_api import ApiError, error_body
from .replica_routing import ReplicaRouter, chunk_keys, prompt_text

__all__ = ["Replica", "ReplicaFront", "pool_tokens", "summed_metrics"]

HEALTH_INTERVAL_S = 1.0
HANG_SECONDS = 30.0  # a replica whose /health has not answered this long is down
LOOKUP_TIMEOUT_S = 10.0  # a stored response looked up, a replica's metrics read
_PASSED_HEADERS = ("authorization", "x-api-key", "content-type", "accept", "anthropic-version", "anthropic-beta",
                   "openai-organization", "openai-project", "user-agent")  # fmt: skip
SHARED_SETTINGS = ("gqa_kv_block_size",)  # gauges that are a setting, the same on every replica: not summed
_DROPPED_ANSWER_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server"}


@dataclass
class Replica:
    """A replica's server: its base URL and, for a local one, ``exit_code()`` (``None`` while its process runs)."""

    url: str
    exit_code: Callable[[], int | None] = lambda: None
    pid: int | None = None  # a local replica's process
    sized: bool = False  # whether the router knows its KV pool's size
    state: str = "up"  # up | down
    reason: str = ""
    last_answer: float = field(default_factory=time.monotonic)


class ReplicaFront:
    """The ASGI app in front of ``replicas`` (module docstring)."""

    def __init__(
        self, replicas: list[Replica], router: ReplicaRouter, *, max_body_bytes: int = MAX_BODY_BYTES,
        health_interval: float = HEALTH_INTERVAL_S, hang_seconds: float = HANG_SECONDS,
        on_all_down: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        if len(replicas) != len(router.up):
            raise ValueError(f"{len(replicas)} replicas for a router of {len(router.up)}")
        self.replicas, self.router, self.max_body_bytes = replicas, router, max_body_bytes
        self.health_interval, self.hang_seconds, self.on_all_down = health_interval, hang_seconds, on_all_down
        self.failed = [0] * len(replicas)  # requests that failed because the replica did
        self._client: httpx2.AsyncClient | None = None
        self._watch: asyncio.Task | None = None
        self._checks: set[asyncio.Task] = set()

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            try:
                await self._http(scope, receive, send)
            except ApiError as e:
                await fail(e)(scope, receive, send)

    # -- routing ---------------------------------------------------------------------------------------------------

    async def _http(self, scope: Message, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        if method in ("GET", "HEAD") and path in ("/health", "/metrics"):
            response = await (self._health() if path == "/health" else self._metrics())
            await response(scope, receive, send)
        elif method == "POST":
            body = await read_body(receive, self.max_body_bytes)
            await self._routed(scope, body, receive, send)
        else:  # GET /v1/models: the first replica that answers
            await self._first_found(scope, receive, send)

    async def _routed(self, scope: Message, body: bytes, receive: Receive, send: Send) -> None:
        """A POST on the replica the router picks, another one if it cannot be reached (the request never ran)."""
        try:
            request = json.loads(body)
        except (ValueError, RecursionError):
            request = None  # the replica answers the 400
        request = request if isinstance(request, dict) else {}
        keys = chunk_keys(prompt_text(request))
        holder = await self._holder(scope, request.get("previous_response_id"))
        while True:
            self._serving()  # 503 when none is left
            if holder is not None and self.router.up[holder]:
                index = holder
                self.router.load[index] += 1
                self.router.sent_total[index] += 1
            else:
                index = self.router.pick(keys)
            ended = False

            async def counted(message: Message, index: int = index) -> None:
                nonlocal ended  # done before the answer's end goes out: the client's next request sees the load
                if message["type"] == "http.response.body" and not message.get("more_body") and not ended:
                    ended = True
                    self.router.done(index)
                await send(message)

            try:
                if await self._forward(index, scope, body, receive, counted):
                    return
            finally:
                if not ended:
                    self.router.done(index)
            holder = None

    async def _holder(self, scope: Message, response_id: object) -> int | None:
        """The replica holding the stored response ``response_id`` (``None``: none, or no id)."""
        if not isinstance(response_id, str) or not response_id:
            return None
        headers = self._headers(scope)
        for index in self._serving():
            with contextlib.suppress(httpx2.HTTPError):
                r = await self._client.get(f"{self.replicas[index].url}/v1/responses/{response_id}", headers=headers,
                                           timeout=LOOKUP_TIMEOUT_S)  # fmt: skip
                if r.status_code == 200:
                    return index
        return None

    async def _first_found(self, scope: Message, receive: Receive, send: Send) -> None:
        """A request with no body to route by: each serving replica until one answers other than 404."""
        last: list[Message] = []
        for index in self._serving():
            held: list[Message] = []

            async def hold(message: Message, held: list[Message] = held) -> None:
                held.append(message)

            if not await self._forward(index, scope, b"", receive, hold):
                continue
            last = held
            if held and held[0]["status"] != 404:
                break
        if not last:
            raise ApiError("no replica could be reached", 503)
        for message in last:
            await send(message)

    def _serving(self) -> list[int]:
        live = [i for i, r in enumerate(self.replicas) if r.state == "up"]
        if not live:
            raise ApiError("no replica of this server is serving", 503)
        return live

    # -- passing a request on ----------------------------------------------------------------------------------------

    async def _forward(self, index: int, scope: Message, body: bytes, receive: Receive, send: Send) -> bool:
        """``scope``'s request with ``body`` on replica ``index``, its answer streamed to ``send``. ``False`` when the
        replica could not be reached (it is marked down; nothing was sent), ``True`` once an answer went out."""
        replica = self.replicas[index]
        query = scope.get("query_string", b"").decode("latin-1")
        url = replica.url + scope["path"] + (f"?{query}" if query else "")
        request = self._client.build_request(scope["method"], url, headers=self._headers(scope), content=body)
        try:
            answer = await self._client.send(request, stream=True)
        except (httpx2.ConnectError, httpx2.ConnectTimeout) as e:
            self._mark_down(index, self._exit_reason(index) or f"cannot be reached ({type(e).__name__})")
            return False
        except httpx2.HTTPError as e:  # sent, and then the replica failed
            reason = await self._exited(index)
            if reason:  # it is gone and answered nothing: another replica takes the request
                self._mark_down(index, reason)
                return False
            self.failed[index] += 1
            self._check_soon(index)
            await fail(ApiError(f"replica {index} failed: {type(e).__name__}", 503))(scope, receive, send)
            return True
        try:
            await self._stream(index, answer, scope, receive, send)
        finally:
            await answer.aclose()
        return True

    async def _stream(self, index: int, answer: httpx2.Response, scope: Message, receive: Receive, send: Send) -> None:
        """``answer`` to the client; a client that disconnects ends it (closing it cancels the replica's work)."""
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers.multi_items()
                   if k.lower() not in _DROPPED_ANSWER_HEADERS]  # fmt: skip
        events = answer.headers.get("content-type", "").startswith("text/event-stream")

        async def pump() -> None:
            await send({"type": "http.response.start", "status": answer.status_code, "headers": headers})
            try:
                async for chunk in answer.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx2.HTTPError as e:  # the replica failed mid-answer
                self.failed[index] += 1
                reason = await self._exited(index)
                if reason:  # marked down before the client hears: its next request goes elsewhere
                    self._mark_down(index, reason)
                else:
                    self._check_soon(index)
                if events:
                    error = error_body(ApiError(f"replica {index} failed: {type(e).__name__}", 503))
                    await send({"type": "http.response.body", "more_body": True,
                                "body": f"event: error\ndata: {json.dumps(error)}\n\n".encode()})  # fmt: skip
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.ensure_future(pump()), asyncio.ensure_future(disconnected())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if tasks[0] in done and tasks[0].exception() is not None and not isinstance(tasks[0].exception(), OSError):
            raise tasks[0].exception()

    @staticmethod
    def _headers(scope: Message) -> dict[str, str]:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        return {k: v for k, v in headers.items() if k in _PASSED_HEADERS}

    # -- health ------------------------------------------------------------------------------------------------------

    def _mark_down(self, index: int, reason: str) -> None:
        replica = self.replicas[index]
        if replica.state == "down":
            return
        replica.state, replica.reason = "down", reason
        self.router.down(index)
        say(f"replica {index} ({replica.url}) is down: {reason}; "
            f"{sum(r.state == 'up' for r in self.replicas)} of {len(self.replicas)} serving")  # fmt: skip
        if all(r.state == "down" for r in self.replicas) and self.on_all_down is not None:
            self.on_all_down()

    def _exit_reason(self, index: int) -> str:
        code = self.replicas[index].exit_code()
        return "" if code is None else f"its process exited with code {code}"

    async def _exited(self, index: int, wait: float = 0.5) -> str:
        """Why replica ``index``'s process ended, waiting ``wait`` seconds at most for a process whose connection
        just broke to be seen ended ("" if it runs, or is not a local one)."""
        deadline = time.monotonic() + wait
        while not (reason := self._exit_reason(index)) and self.replicas[index].pid is not None:
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        return reason

    def _check_soon(self, index: int) -> None:
        task = asyncio.ensure_future(self._check(index))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _check(self, index: int) -> None:
        """Ask replica ``index`` whether it serves; mark it down when it does not (module docstring)."""
        replica = self.replicas[index]
        if replica.state == "down":
            return
        reason = self._exit_reason(index)
        if reason:
            self._mark_down(index, reason)
            return
        if not replica.sized:  # how much its prefix cache holds: the router forgets past it, as the replica does
            with contextlib.suppress(httpx2.HTTPError, ValueError):
                tokens = pool_tokens((await self._client.get(replica.url + "/metrics", timeout=10)).text)
                if tokens:
                    self.router.set_capacity(index, tokens)
                    replica.sized = True
        try:
            r = await self._client.get(replica.url + "/health", timeout=self.hang_seconds)
        except (httpx2.ConnectError, httpx2.ConnectTimeout) as e:
            self._mark_down(index, f"cannot be reached ({type(e).__name__})")
            return
        except httpx2.HTTPError:
            if time.monotonic() - replica.last_answer > self.hang_seconds:
                self._mark_down(index, f"no answer to /health for {self.hang_seconds:g} s")
            return
        replica.last_answer = time.monotonic()
        if r.status_code == 503:
            self._mark_down(index, f"its engine stopped ({r.text[:200]})")

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await asyncio.gather(*(self._check(i) for i in range(len(self.replicas))), return_exceptions=True)

    async def _health(self) -> Response:
        states = [{"replica": i, "url": r.url, "state": r.state, "load": self.router.load[i]}
                  | ({"pid": r.pid} if r.pid is not None else {}) | ({"reason": r.reason} if r.reason else {})
                  for i, r in enumerate(self.replicas)]  # fmt: skip
        serving = sum(r.state == "up" for r in self.replicas)
        status = "ok" if serving == len(self.replicas) else "degraded" if serving else "down"
        return JSONResponse({"status": status, "replicas": states}, status_code=200 if serving else 503)

    async def _metrics(self) -> Response:
        router = self.router
        own = {
            ("gqa_replica_up", "gauge", "whether the replica serves (1) or is down (0)"):
                [int(r.state == "up") for r in self.replicas],
            ("gqa_replica_requests_total", "counter", "requests the front sent to the replica"): router.sent_total,
            ("gqa_replica_prefix_routed_total", "counter", "requests sent to the replica because it held their prefix"):
                router.by_prefix,
            ("gqa_replica_failed_total", "counter", "requests that failed because the replica did"): self.failed,
            ("gqa_replica_load", "gauge", "requests sent to the replica and not yet answered"): router.load,
        }  # fmt: skip
        lines = []
        for (metric, kind, help_), values in own.items():
            lines += [f"# HELP {metric} {help_}", f"# TYPE {metric} {kind}"]
            lines += [f'{metric}{{replica="{i}"}} {v}' for i, v in enumerate(values)]
        texts = {}
        for index in [i for i, r in enumerate(self.replicas) if r.state == "up"]:
            with contextlib.suppress(httpx2.HTTPError):
                r = await self._client.get(self.replicas[index].url + "/metrics", timeout=LOOKUP_TIMEOUT_S)
                if r.status_code == 200:
                    texts[str(index)] = r.text
        if texts:
            texts["all"] = summed_metrics(list(texts.values()))
        text = "\n".join(lines) + "\n" + merged_metrics(texts, key="replica")
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # -- lifespan ----------------------------------------------------------------------------------------------------

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                limits = httpx2.Limits(max_connections=None, max_keepalive_connections=64)
                timeout = httpx2.Timeout(connect=5.0, read=None, write=60.0, pool=None)
                self._client = httpx2.AsyncClient(limits=limits, timeout=timeout, trust_env=False)
                await asyncio.gather(*(self._check(i) for i in range(len(self.replicas))), return_exceptions=True)
                self._watch = asyncio.ensure_future(self._watch_loop())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._watch is not None:
                    self._watch.cancel()
                    await asyncio.gather(self._watch, return_exceptions=True)
                if self._client is not None:
                    await self._client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


def pool_tokens(text: str) -> int:
    """The token slots of a replica's KV pool, from its Prometheus ``text`` (0 when it does not say)."""
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("gqa_kv_blocks_free", "gqa_kv_blocks_used", "gqa_kv_block_size"):
            values[name] = float(value)
    if len(values) < 3:
        return 0
    return int((values["gqa_kv_blocks_free"] + values["gqa_kv_blocks_used"]) * values["gqa_kv_block_size"])


def summed_metrics(texts: list[str]) -> str:
    """One Prometheus text whose samples are the sums of ``texts``' same samples (metric name and labels): a total
    over the replicas (counters, gauges and histogram buckets alike add up; a setting every replica shares, as
    ``SHARED_SETTINGS``, is the first one's); each family's ``# HELP`` / ``# TYPE`` as the first text that has it
    says."""
    lines: list[str] = []
    totals: dict[str, float] = {}
    for text in texts:
        for line in text.splitlines():
            if line.startswith("#"):
                if line not in lines:
                    lines.append(line)
            elif line.strip():
                metric, _, value = line.rpartition(" ")
                try:
                    number = float(value)
                except ValueError:
                    continue
                if metric not in totals:
                    lines.append(metric)
                    totals[metric] = 0.0
                elif metric.partition("{")[0] in SHARED_SETTINGS:
                    continue
                totals[metric] += number
    return "".join(f"{line} {totals[line]:.17g}\n" if line in totals else line + "\n" for line in lines)


def say(text: str) -> None:
    print(f"gqa serve: {text}", file=sys.stderr, flush=True)
