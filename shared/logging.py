"""structlog set-up: JSON events on stderr, bound context (request id) carried by contextvars."""

import logging
import sys

import structlog


def configure_logging(level: str = "info", *, json: bool = True):
    """Route structlog (and stdlib logging) to stderr as one JSON object per event.

    Args:
        level: Minimum level name (``debug``, ``info``, ``warning``, ``error``).
        json: JSON lines when True, a human console renderer otherwise.
    """
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"log level must be debug, info, warning or error, got {level!r}")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    shared = [structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True)]
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, *shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # Libraries' stdlib records (asyncio, aiohttp, nats, transformers) become the same JSON events.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[
                structlog.contextvars.merge_contextvars,
                structlog.stdlib.add_logger_name,
                *shared,
                structlog.processors.format_exc_info,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
