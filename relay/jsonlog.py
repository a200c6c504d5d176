"""JSON logging: one JSON object per line on stderr.

``setup_logging(level)`` installs the formatter on the root logger. Structured fields appear at
the top level of the line, however they were passed: ``log.info("msg", extra={"host": h})`` (the
standard way, used by the lower layers, which cannot import this module) or
``log.info("msg", extra=fields(host=h))`` (``{"fields": {...}}``, which may also carry names that
``logging`` refuses in ``extra`` because ``LogRecord`` has them, such as ``name`` or ``module``).
The core keys ``ts``, ``level``, ``logger``, ``msg`` (and ``exc``) are never overwritten by a field.
"""

from __future__ import annotations

import json
import logging
import sys
import time

#: Attributes every ``LogRecord`` has (plus those ``Formatter.format`` adds): anything else on a
#: record came from ``extra=``.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}
#: ``extra`` keys that are not fields: our ``fields()`` envelope, and uvicorn's ANSI-coloured copy of
#: the message.
_NOT_FIELDS = frozenset({"fields", "color_message"})


class JsonFormatter(logging.Formatter):
    """Formats a record as ``{"ts", "level", "logger", "msg", ...fields}``: the ``fields()``
    envelope's keys, then every other ``extra=`` key (first one wins on a repeated key)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for key, value in fields.items():
                out.setdefault(key, value)
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and key not in _NOT_FIELDS:
                out.setdefault(key, value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "info") -> None:
    """Route all logging (ours, uvicorn's) through one JSON handler on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    logging.getLogger("uvicorn.access").setLevel("WARNING")
    for noisy in ("httpx", "httpcore", "websockets.client", "websockets.server"):
        logging.getLogger(noisy).setLevel("WARNING")  # one line per request/connection otherwise


def fields(**kv: object) -> dict[str, dict[str, object]]:
    """Shorthand: ``log.info("x", extra=fields(host=h))``."""
    return {"fields": kv}
