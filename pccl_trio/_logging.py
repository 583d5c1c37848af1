"""Log output for the command line: text lines, or one JSON object per line.

Theory of operation
-------------------
The library logs through the standard ``logging`` module and configures nothing;
``pccl-trio master`` (and anyone who wants the same) calls ``configure``. Run events
(``_core.report.RunEvent``) ride on their log records (``record.run_event``): the text
format prints their sentence like any message, and ``JsonFormatter`` adds their kind
and fields, so a log collector gets ``{"event": "kicked", "peer": 4, "cause":
"liveness", ...}`` without parsing sentences.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from ._core.report import RunEvent

__all__ = ["FORMATS", "JsonFormatter", "configure"]

#: The ``--log-format`` choices.
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _plain(value: Any) -> Any:
    """A JSON-ready form of a run event's field."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, tuple | list | frozenset | set):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (Unix seconds), ``level``, ``logger``,
    ``message``; for a run event also ``event`` (its kind) and its fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        event = getattr(record, "run_event", None)
        if isinstance(event, RunEvent):
            line["event"] = event.kind.value
            for key, value in event.fields.items():
                line.setdefault(key, _plain(value))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, separators=(",", ":"), default=str)


def configure(level: str, log_format: str, stream: TextIO = sys.stderr) -> None:
    """Log at ``level`` to ``stream`` in ``log_format`` (one of ``FORMATS``)."""
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
