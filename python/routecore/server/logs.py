"""Structured logs: one JSON object a line on the ``routecore.server`` logger.

Nothing here ever receives an API key: callers log the tenant's name.
"""

from __future__ import annotations

import json
import logging

logger = logging.getLogger("routecore.server")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 6), "level": record.levelname.lower()}
        entry["event"] = record.getMessage()
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup(level: int = logging.INFO) -> None:
    """Sends ``routecore.server`` logs to stderr as JSON lines (the Rust data
    plane writes the same lines, at the level this logger has when it starts)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False


def log(level: int, event: str, exc_info: bool = False, **fields) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, event, exc_info=exc_info, extra={"fields": fields})
