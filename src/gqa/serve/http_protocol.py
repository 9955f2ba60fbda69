"""uvicorn's h11 HTTP protocol with a deadline for a request's headers.

uvicorn closes an idle keep-alive connection, but a connection that sends part of a request's headers and then
trickles (or nothing) is held open for ever: 50 such "slowloris" connections were all still open after 40 s. Here a
connection that has not finished a request's headers ``header_timeout`` seconds after it opened (or after its last
response) is closed, as nginx's ``client_header_timeout`` does; a request whose headers arrived is never cut, however
long its response takes.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["HeaderTimeoutH11Protocol", "with_header_timeout"]


class HeaderTimeoutH11Protocol(H11Protocol):
    header_timeout = 15.0  # seconds for a request's headers (``with_header_timeout`` makes a class with another)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._headers_due = None
        self._await_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        """From now, the next request's headers have ``header_timeout`` seconds: a new request cycle (uvicorn starts
        one when the headers are complete) before then keeps the connection."""
        if self._headers_due is not None:
            self._headers_due.cancel()
        self._headers_due = self.loop.call_later(self.header_timeout, self._close_if_waiting, self.cycle)

    def _close_if_waiting(self, cycle: object) -> None:
        idle = self.cycle is cycle and (cycle is None or self.cycle.response_complete)
        if idle and not self.transport.is_closing():
            self.transport.close()


def with_header_timeout(seconds: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class (uvicorn ``Config(http=...)``) that gives a request's headers ``seconds``."""
    if not seconds > 0:
        raise ValueError(f"--header-timeout must be > 0 seconds, got {seconds}")
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout": float(seconds)})
