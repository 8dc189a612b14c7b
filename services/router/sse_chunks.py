"""A stream's plain content events, rendered without building a chunk object per event.

Most events of a stream carry only a text delta (not the first, with its role; not the last,
with its finish reason; no log-probabilities). Their JSON differs only in that text, so the
bytes before and after it are rendered once per request from ``openai_api.chunk_body`` and
each event costs one JSON string encode. Each event parses to ``chunk_body(...)`` of its text.
"""

import msgspec

from services.router import openai_api
from services.router.openai_api import ParsedRequest

_MARK = "\x00pdd-delta\x00"
"""A text no request id, model name or fingerprint holds (JSON escapes it to ``\\u0000``)."""


_encode = msgspec.json.Encoder().encode


class ContentEvents:
    """``data: <chunk>\\n\\n`` of a content chunk of one request's stream."""

    def __init__(self, req: ParsedRequest, request_id: str):
        head, tail = _encode(openai_api.chunk_body(req, request_id, _MARK)).split(_encode(_MARK))
        self._head, self._tail = b"data: " + head, tail + b"\n\n"

    def event(self, delta_text: str) -> bytes:
        """The event carrying ``delta_text`` (non-empty)."""
        return self._head + _encode(delta_text) + self._tail
