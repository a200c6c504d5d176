"""Event-stream frame codec (minimal seed; the firehose package owns and extends it)."""

from __future__ import annotations

import cbrrr


def encode_frame(t: str, body: dict) -> bytes:
    """Encode a message frame: DAG-CBOR header ``{op: 1, t}`` followed by the DAG-CBOR body."""
    return cbrrr.encode_dag_cbor({"op": 1, "t": t}) + cbrrr.encode_dag_cbor(body)
