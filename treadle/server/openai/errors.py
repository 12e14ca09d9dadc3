"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}.

Every failure a client can cause ends here as a 4xx with `param` naming the offending field:
pydantic's validation errors (wrong types, invalid JSON, a body that is not an object), the
`InvalidField`s of every layer (SamplingParams, admission, validation, the engine: the field is
the error's, never read out of its text), unknown routes and models.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from treadle.errors import InvalidField


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


def invalid_request(error: ValueError) -> APIError:
    """A 400 for a request the client got wrong, naming its field when the error does."""
    return APIError(400, str(error), param=error.param if isinstance(error, InvalidField)
                    else None)


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

    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    async def invalid_field(_: Request, exc: InvalidField) -> JSONResponse:
        return invalid_request(exc).response()

    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    async def server_error(_: Request, __: Exception) -> JSONResponse:
        # Starlette re-raises the exception after this answer, so the server logs it.
        return APIError(500, "internal server error").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(InvalidField, invalid_field)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
