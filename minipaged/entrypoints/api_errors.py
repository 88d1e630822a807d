"""Errors in OpenAI's shape (the OS's errno): every failure a client can cause, or meet, is
answered as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status, never
as a traceback.

A system call that fails returns a number the caller can act on and leaves the kernel as
it was; here a refused request gets a 4xx naming the field at fault, an engine that
cannot serve gets a 503, and nothing else is disturbed. ``install_error_handlers`` routes
each kind of exception a route may raise to its answer.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.async_llm_engine import EngineDeadError, RequestAbortedError

logger = logging.getLogger("minipaged")


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=error_body(self.message, self.type, self.param,
                                                                         self.code or str(self.status)))


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def field_of(message: str, fields) -> str | None:
    """The request field an engine error message names, if any (for the error's ``param``): the
    one it starts with, else the longest it names."""
    first = re.match(r"[A-Za-z_]+", message)
    if first is not None and first.group() in fields:
        return first.group()
    for name in sorted(fields, key=len, reverse=True):
        if re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message):
            return name
    return None


class ClientGone(Exception):
    """The client disconnected before its answer was ready (its requests are aborted)."""


def install_error_handlers(app: FastAPI) -> None:
    """Each exception a route can raise, answered in OpenAI's shape."""
    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, err: RequestValidationError):
        problems = err.errors()
        if any(e.get("type") == "json_invalid" for e in problems):
            return APIError(400, f"the request body is not valid JSON ({problems[0].get('ctx', {}).get('error', '')})"
                            .replace(" ()", ""), param=None).response()
        first = problems[0] if problems else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None          # the request's field (pydantic adds union branches)
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                            for e in problems[:5])
        return APIError(400, message or "malformed request body", param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException):
        return APIError(err.status_code, str(err.detail), "NotFoundError" if err.status_code == 404
                        else "invalid_request_error").response()

    @app.exception_handler(RequestAbortedError)
    @app.exception_handler(EngineDeadError)
    async def unavailable(_: Request, err: Exception):      # a shutdown, not a bug: no traceback
        return APIError(503, str(err), "ServiceUnavailableError").response()

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, __: ClientGone):
        return Response(status_code=499)            # nobody is listening; nginx's "client closed"

    @app.exception_handler(Exception)
    async def internal(_: Request, err: Exception):
        logger.error("internal error: %s: %s", type(err).__name__, err)
        status = 503 if isinstance(err, (EngineDeadError, RequestAbortedError)) else 500
        return APIError(status, "the server could not answer this request" if status == 500 else str(err),
                        "InternalServerError" if status == 500 else "ServiceUnavailableError").response()

