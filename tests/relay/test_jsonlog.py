"""relay.jsonlog: every ``extra=`` field reaches the JSON line, whichever way it was passed.

The lower layers (``firehose.subscriber``, ``firehose.workers``) cannot import ``relay.jsonlog``
and log with plain ``extra={...}``; their host/pid context must not be dropped."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from firehose.reasons import Reason
from firehose.subscriber import HostSubscriber
from relay.jsonlog import JsonFormatter, fields


@pytest.fixture
def json_lines() -> Iterator[io.StringIO]:
    """JSON-formatted output of the ``firehose`` and ``relay`` loggers."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    loggers = [logging.getLogger(name) for name in ("firehose", "relay")]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    try:
        yield stream
    finally:
        for lg, level in zip(loggers, saved, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)


def _lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


async def _noop(_frame: object) -> None:
    return None


async def test_subscriber_cursor_reset_keeps_host_context(json_lines: io.StringIO) -> None:
    sub = HostSubscriber("pds.example.com", _noop, cursor=42)
    await sub._reset(Reason.FUTURE_CURSOR)  # logs with extra={"host", "old_cursor", "reason"}
    [line] = _lines(json_lines)
    assert line["logger"] == "firehose.subscriber" and line["msg"] == "cursor reset"
    assert line["host"] == "pds.example.com"
    assert line["old_cursor"] == 42
    assert line["reason"] == "future_cursor"


def test_worker_style_extra_fields_appear(json_lines: io.StringIO) -> None:
    log = logging.getLogger("firehose.workers")
    log.warning("validation worker died; starting a new one", extra={"pid": 4242})
    log.warning("validation worker did not answer in time; killing it", extra={"pid": 4243, "timeout_s": 30.0})
    logging.getLogger("firehose.subscriber").info("upstream connection ended",
                                                  extra={"host": "pds.example.com", "error": "TimeoutError"})
    died, hung, ended = _lines(json_lines)
    assert died["pid"] == 4242 and died["level"] == "warning"
    assert (hung["pid"], hung["timeout_s"]) == (4243, 30.0)
    assert (ended["host"], ended["error"]) == ("pds.example.com", "TimeoutError")


def test_fields_helper_still_works_and_core_keys_win(json_lines: io.StringIO) -> None:
    log = logging.getLogger("relay.test")
    log.info("host added", extra=fields(hostname="pds.example.com", name="shadows LogRecord.name"))
    log.info("both ways", extra={"fields": {"a": 1}, "b": 2, "level": "not mine", "color_message": "\x1b[1m"})
    log.info("odd value", extra={"when": object.__new__(type("Opaque", (), {"__str__": lambda self: "opaque"}))})
    added, both, odd = _lines(json_lines)
    assert added["hostname"] == "pds.example.com" and added["name"] == "shadows LogRecord.name"
    assert (both["a"], both["b"], both["level"]) == (1, 2, "info")
    assert "color_message" not in both and "fields" not in both
    assert odd["when"] == "opaque"
    # nothing of the LogRecord's own bookkeeping leaks into the line
    assert set(added) == {"ts", "level", "logger", "msg", "hostname", "name"}
