"""OpenAI-style error bodies and the mapping from failures to HTTP statuses.

Every error leaves the server as ``{"error": {"message", "type", "code",
"param"}}`` with a 4xx/5xx status; overload answers carry ``Retry-After``.

No body carries an exception's text or a traceback: a 500 says "internal
error" and a request id; what happened is logged under that id
(:func:`internal_error`). An ``APIError(500, ...)`` raised anywhere is
rewritten the same way when it is built.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deploy.request_ids import new_request_id

logger = logging.getLogger("kvroute.ingress")

_STATUS_TO_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """A failure with a definite HTTP status, raised anywhere in the ingress."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        if status_code == 500 and code != "internal_error":  # never a detail to the client
            request_id = new_request_id("err")
            logger.error("internal error %s: %s", request_id, message)
            message, code, param = _internal_message(request_id), "internal_error", None
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return error_body(self.status_code, self.message, code=self.code, param=self.param)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers())

    def sse_event(self) -> str:
        """The error as a server-sent event, for failures after a stream began."""
        return f"data: {json.dumps(self.body())}\n\n"


def _internal_message(request_id: str) -> str:
    return f"internal error (request id {request_id})"


def internal_error(error: BaseException | None, request_id: str | None = None) -> APIError:
    """A 500 for an unexpected failure: the exception and its traceback go to
    the log under ``request_id``, the body names only the id."""
    request_id = request_id or new_request_id("err")
    logger.error("internal error %s", request_id, exc_info=error)
    return APIError(500, _internal_message(request_id), code="internal_error")


def error_body(status_code: int, message: str, *, code: str | None = None, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _STATUS_TO_TYPE.get(status_code, "invalid_request_error" if status_code < 500 else "internal_error"),
            "code": code,
            "param": param,
        }
    }


def _describe_validation(error: RequestValidationError) -> tuple[int, str, str | None]:
    problems = error.errors()
    if any(p.get("type") == "json_invalid" for p in problems):
        return 400, "request body is not valid JSON", None
    first = problems[0] if problems else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    details = "; ".join(
        f"{'.'.join(str(x) for x in p.get('loc', ()) if x != 'body') or 'body'}: {p.get('msg', 'invalid')}"
        for p in problems[:5]
    )
    return 422, f"invalid request: {details}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        status, message, param = _describe_validation(error)
        return JSONResponse(error_body(status, message, param=param), status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(error.status_code, str(error.detail)), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        return internal_error(error, getattr(request.state, "request_id", None)).response()
