"""structlog set-up shared by every process: readable lines on a terminal, JSON lines otherwise."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(process: str, level: str | None = None) -> structlog.stdlib.BoundLogger:
    """Configure structlog for this process and return a logger bound to ``process``.

    ``PAGEDSERVE_LOG_FORMAT`` (``console`` or ``json``) overrides the terminal detection and
    ``PAGEDSERVE_LOG_LEVEL`` the level (default ``info``).
    """
    level_name = (level or os.environ.get("PAGEDSERVE_LOG_LEVEL", "info")).upper()
    fmt = os.environ.get("PAGEDSERVE_LOG_FORMAT") or ("console" if sys.stderr.isatty() else "json")
    renderer = (
        structlog.dev.ConsoleRenderer(colors=False)
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger().bind(process=process, pid=os.getpid())
