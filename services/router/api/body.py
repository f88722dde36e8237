"""Reading a request body with bounds: the declared size is checked before a byte is read,
a chunked body is capped as it arrives, and the whole body must arrive in time."""

from __future__ import annotations

import asyncio

from fastapi import Request
from starlette.requests import ClientDisconnect

from ..core.errors import APIError


def _bad(message: str, status: int) -> APIError:
    return APIError(message, status, "invalid_request_error")


def _check_declared_size(request: Request, max_bytes: int) -> None:
    length = request.headers.get("content-length")
    if length is None:
        if "chunked" not in request.headers.get("transfer-encoding", "").lower():
            raise _bad("a request body needs a Content-Length (or chunked transfer encoding)", 411)
        return
    if not length.isdigit():  # (the HTTP server turns most bad values away before us)
        raise _bad("Content-Length is not a number", 400)
    if int(length) > max_bytes:
        raise _bad(f"request body over {max_bytes} bytes", 413)


async def _capped(request: Request, max_bytes: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _bad(f"request body over {max_bytes} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    _check_declared_size(request, max_bytes)
    try:
        async with asyncio.timeout(timeout_s):
            return await _capped(request, max_bytes)
    except TimeoutError:
        raise _bad(f"the request body did not arrive within {timeout_s:g} s", 408) from None
    except ClientDisconnect:
        raise _bad("the client went away while sending the body", 400) from None
