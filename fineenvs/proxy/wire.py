"""Small HTTP helpers shared by the proxy's modules."""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from starlette.responses import Response


def json_response(body: object, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, headers=headers, media_type="application/json")


def bearer(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return None
