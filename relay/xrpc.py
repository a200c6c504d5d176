"""XRPC plumbing: typed errors rendered as ``{error, message}`` and parameter parsing.

Handlers raise ``XrpcError(status, error, message)``; ``error`` is either a generic XRPC name
(``InvalidRequest``, ``MethodNotImplemented``, ``AuthRequired`` …) or a Lexicon error name
(``RepoNotFound``, ``HostBanned`` …).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse


class XrpcError(Exception):
    """An error response: HTTP ``status`` with body ``{"error": error, "message": message}``."""

    def __init__(self, status: int, error: str, message: str = "") -> None:
        super().__init__(f"{error}: {message}")
        self.status = status
        self.error = error
        self.message = message or error

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.error, "message": self.message}, status_code=self.status)


def invalid(message: str) -> XrpcError:
    return XrpcError(400, "InvalidRequest", message)


def param(request: Request, name: str, *, required: bool = False) -> str | None:
    value = request.query_params.get(name)
    if value is None or value == "":
        if required:
            raise invalid(f"missing required parameter {name!r}")
        return None
    return value


def int_param(request: Request, name: str, *, default: int, minimum: int, maximum: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise invalid(f"parameter {name!r} must be an integer") from None
    if not minimum <= value <= maximum:
        raise invalid(f"parameter {name!r} must be between {minimum} and {maximum}")
    return value


def did_param(request: Request) -> str:
    from mst.syntax import is_valid_did

    did = param(request, "did", required=True)
    assert did is not None
    if not is_valid_did(did):
        raise invalid("parameter 'did' is not a valid DID")
    return did


async def json_object(request: Request) -> dict[str, Any]:
    """The request body as a JSON object (``{}`` when empty). Malformed JSON, nesting too deep for
    the parser, a body that is not an object and any string holding a NUL character are ``400
    InvalidRequest`` (the body's size is bounded before this by ``relay.request_guard``)."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise invalid("request body is not JSON") from None
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    if _has_nul(body):
        raise invalid("NUL characters are not allowed in a request")
    return body


def _has_nul(value: object) -> bool:
    """Whether any string (key or value) in a parsed JSON document holds a NUL character.
    Iterative: the parser already bounded the depth, and so must this walk."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
