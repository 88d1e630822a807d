"""Limits before work: what one connection or one request may take before any of its work is
done (the OS's rlimits).

A kernel caps what one process may hold (open files, memory, CPU seconds) so that one
process cannot starve the others. A server needs the same caps at its door, checked before
a request costs anything:

- ``BodySizeLimit``: a request body over ``max_bytes`` is answered 413 at once, from its
  Content-Length header when it sends one (nothing is read), else as soon as the bytes read
  pass the limit. A 50 MB prompt never reaches the JSON parser or the tokenizer. The rest of
  the body is read and dropped (uvicorn's lingering read: closing at once would reset a
  client still sending, which would never see the 413), for as long as the header timer allows. A body whose next piece does not come within ``read_timeout`` seconds is
  a 408 (a slow upload holds a connection as long as a slow head would).
- ``header_timeout_protocol``: a connection that has not sent a whole request head within
  ``seconds`` of opening (or of its previous answer) is closed: the slow-loris attack holds
  connections open by sending a header line now and then. uvicorn has no such timer; this
  is its own h11 protocol with one added. The same timer closes a connection whose answer
  went out while its body never finished (after an early 413, say), and an idle keep-alive
  connection, if uvicorn's keep-alive timer has not closed it first.
- uvicorn's own ``timeout_keep_alive`` (an idle connection between requests) and
  ``limit_concurrency`` (more connections or tasks than this get a 503) are passed through
  as they are (``uvicorn_limits``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class HTTPLimits:
    """The door's limits, as ``serve``'s flags give them (validated here). This module imports
    no web package at the top, so that the command line can show these defaults without one."""

    max_request_body_bytes: int = 16 * MIB   # larger bodies are a 413
    timeout_header_read: float = 15.0        # seconds to send a whole request head (and each piece of a body)
    timeout_keep_alive: float = 5.0          # seconds an idle connection is kept between requests (uvicorn's)
    limit_concurrency: int | None = None     # connections + tasks beyond this get a 503 (uvicorn's); None: no cap

    def __post_init__(self) -> None:
        if not (isinstance(self.max_request_body_bytes, int) and self.max_request_body_bytes > 0):
            raise ValueError(f"max_request_body_bytes must be a positive integer, got {self.max_request_body_bytes!r}")
        for name in ("timeout_header_read", "timeout_keep_alive"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.limit_concurrency is not None and not (isinstance(self.limit_concurrency, int)
                                                       and self.limit_concurrency >= 1):
            raise ValueError(f"limit_concurrency must be a positive integer or None, got {self.limit_concurrency!r}")

    def uvicorn_limits(self) -> dict:
        """uvicorn.Config keyword arguments: its own limits, and the protocol with the header timer."""
        return {"timeout_keep_alive": self.timeout_keep_alive, "limit_concurrency": self.limit_concurrency,
                "http": header_timeout_protocol(self.timeout_header_read)}


class BodySizeLimit:
    """ASGI middleware: a body over ``max_bytes`` is a 413 before the route sees it.

    The body is read here, up to the limit, and handed to the route whole (FastAPI reads a
    JSON body whole in any case); a later ``receive()`` goes to the client, so a route can
    still hear of a disconnect.
    """

    def __init__(self, app, max_bytes: int, read_timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout

    async def refuse(self, status: int, message: str, code: str, scope, receive, send, close: bool = False) -> None:
        """Answer now, before the body is read (and with ``close``, close the connection)."""
        from .api_errors import APIError  # noqa: PLC0415 (FastAPI: the serve extra; cli.py reads HTTPLimits)

        response = APIError(status, message, code=code).response()
        if close:
            response.headers["connection"] = "close"
        await response(scope, receive, send)

    async def too_large(self, size: str, scope, receive, send) -> None:
        await self.refuse(413, f"the request body is {size}: more than this server's limit of {self.max_bytes} "
                               "bytes (serve --max-request-body-bytes)", "request_too_large", scope, receive, send)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self.too_large(f"{int(declared)} bytes", scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout)
            except asyncio.TimeoutError:
                await self.refuse(408, f"the request body stopped arriving: nothing for {self.read_timeout:g} s "
                                       "(serve --timeout-header-read)", "request_timeout", scope, receive, send,
                                  close=True)
                return
            if message["type"] != "http.request":         # the client left while sending
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self.too_large(f"over {self.max_bytes} bytes", scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)


def _replay(messages: list, receive):
    """A ``receive`` that gives ``messages`` first, then the client's own."""
    async def replayed():
        return messages.pop(0) if messages else await receive()
    return replayed


def header_timeout_protocol(seconds: float) -> type:
    """uvicorn's h11 protocol with a header-read timer: armed when the connection opens and
    after each answer, it closes a connection whose next request head is not complete in
    ``seconds`` (with a 408 if some of it came; silently if nothing did, an idle keep-alive
    connection, which uvicorn's keep-alive timer closes first by default)."""
    import h11  # noqa: PLC0415 (uvicorn's dependency: the serve extra)
    from uvicorn.protocols.http.h11_impl import H11Protocol  # noqa: PLC0415

    class HeaderTimeoutProtocol(H11Protocol):
        header_timeout = seconds

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._bytes_since_armed = 0
            self._header_timer = self.loop.call_later(self.header_timeout, self._head_too_slow)

        def _disarm(self) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
            self._header_timer = None

        def data_received(self, data: bytes) -> None:
            self._bytes_since_armed = getattr(self, "_bytes_since_armed", 0) + len(data)
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _head_too_slow(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self.conn.their_state is not h11.IDLE:    # a request is under way: its head came in time
                answered = self.cycle is not None and self.cycle.response_complete
                if answered and self.conn.their_state is h11.SEND_BODY:
                    self.transport.close()           # answered early (a 413), and the body never ended
                else:
                    self._arm()                      # look again later: the answer is being made
                return
            if self._bytes_since_armed:
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n"
                                     b"connection: close\r\n\r\n")
            self.transport.close()

    return HeaderTimeoutProtocol
