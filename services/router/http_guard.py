"""What the router's HTTP server checks before a handler runs: API keys, content type and
body size; and how every error leaves it: as an OpenAI error object, never plain text.
"""

import hmac

import structlog
from aiohttp import web

from services.router.openai_api import ApiError

log = structlog.get_logger("pdd.router.http")
OPEN_PATHS = frozenset({"/health"})
"""Paths answered without an API key (liveness probes of orchestrators)."""
JSON_TYPES = ("application/json",)


def parse_api_keys(value: str) -> frozenset[str]:
    """Comma-separated keys (``--api-key`` / ``PDD_API_KEYS``); empty: no key needed."""
    return frozenset(k.strip() for k in value.split(",") if k.strip())


def openai_errors() -> web.middleware:
    """Turn aiohttp's own answers (404, 405, 413, …) and crashes into OpenAI error objects."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return web.json_response(_from_http(exc).body(), status=exc.status)
        except Exception:
            log.exception("http_handler_failed", path=request.path)
            return web.json_response(
                ApiError(500, "internal error", type="server_error", code="internal_error").body(), status=500
            )

    return middleware


def _from_http(exc: web.HTTPException) -> ApiError:
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return ApiError(413, exc.text or "request body too large", code="request_too_large")
    if isinstance(exc, web.HTTPNotFound):
        return ApiError(
            404,
            "no such path; this server offers /v1/chat/completions, /v1/completions, "
            "/v1/models, /tokenize, /detokenize, /version, /health and /metrics",
            code="not_found",
        )
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return ApiError(
            405, f"method not allowed; use {', '.join(sorted(exc.allowed_methods))}", code="method_not_allowed"
        )
    return ApiError(exc.status, exc.reason or "request refused")


def api_keys(keys: frozenset[str], metrics_keyed: bool = False) -> web.middleware:
    """Require ``Authorization: Bearer <key>`` on every path but ``/health`` when keys are set
    (and but ``/metrics`` when that asks for the metrics key instead)."""
    open_paths = OPEN_PATHS | ({"/metrics"} if metrics_keyed else set())

    @web.middleware
    async def middleware(request: web.Request, handler):
        if keys and request.path not in open_paths:
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            # Compare against every key so the time taken does not tell which one was close.
            matches = [hmac.compare_digest(given.strip().encode(), key.encode()) for key in keys]
            if scheme.lower() != "bearer" or not any(matches):
                raise ApiError(
                    401, "missing or incorrect API key (send Authorization: Bearer <key>)", code="invalid_api_key"
                )
        return await handler(request)

    return middleware


def json_content() -> web.middleware:
    """POST bodies must be JSON; a request without a Content-Type is read as JSON."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        content_type = request.headers.get("Content-Type")
        if (
            request.method == "POST"
            and content_type is not None
            and request.content_type not in JSON_TYPES
            and not request.content_type.endswith("+json")
        ):
            raise ApiError(
                415,
                f"Content-Type must be application/json, got {request.content_type!r}",
                code="unsupported_media_type",
            )
        return await handler(request)

    return middleware
