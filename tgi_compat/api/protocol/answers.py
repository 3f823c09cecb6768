"""What a service hands back to its route: a JSON body or an SSE stream, each with its headers.

Services (tgi_compat/api/serving/*_service.py) build answers without touching the HTTP layer; a
route only calls `answer.response()`. An error answer is a JSON answer with TGI's error body.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, Response

from tgi_compat.api.protocol.errors import TgiError
from tgi_compat.api.protocol.sse import event_stream


@dataclass(frozen=True, slots=True)
class JsonAnswer:
    body: Any  # JSON-ready: dicts, lists, str, numbers
    headers: Mapping[str, str] | None = None
    status: int = 200

    @classmethod
    def error(cls, error: TgiError) -> JsonAnswer:
        """TGI's `{"error", "error_type"}` body with the error's status."""
        return cls(error.body(), status=error.status)

    def response(self) -> Response:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


@dataclass(frozen=True, slots=True)
class StreamAnswer:
    events: AsyncIterator[bytes]  # each item is one or more complete SSE events
    headers: Mapping[str, str]

    def response(self) -> Response:
        return event_stream(self.events, self.headers)


Answer = JsonAnswer | StreamAnswer
