"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}.

Every failure a client can cause ends here as a 4xx with `param` naming the offending field:
pydantic's validation errors (wrong types, invalid JSON, a body that is not an object), the
`ValueError`s of SamplingParams and of the engine, unknown routes and models.
"""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException


class APIError(Exception):
    """An error to send the client as is."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, error_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = error_type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_value_error(error: ValueError, params: dict[str, str]) -> APIError:
    """A 400 for a client's ValueError. SamplingParams and the engine word theirs "<field> must
    be ...": `params` maps that leading name to the request field it came from, if any."""
    message = str(error)
    match = re.match(r"[a-z_]+", message)
    return APIError(400, message, param=params.get(match.group()) if match else None)


def validation_error(error: RequestValidationError) -> APIError:
    """The first of pydantic's errors, with its location as `param` (e.g. messages[0].role)."""
    first = error.errors()[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"invalid JSON body: {first.get('ctx', {}).get('error', '')}")
    param = ""
    for part in first["loc"][1:]:  # loc[0] is "body"
        param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else part
    message = first["msg"]
    if not param and first["type"] == "model_attributes_type":
        return APIError(400, "the request body must be a JSON object")
    if first["type"] == "value_error":  # our own validators: "Value error, <message>"
        message = str(first["ctx"]["error"])
    return APIError(400, f"{param or 'body'}: {message}", param=param or None)


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    async def server_error(_: Request, __: Exception) -> JSONResponse:
        # Starlette re-raises the exception after this answer, so the server logs it.
        return APIError(500, "internal server error").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
