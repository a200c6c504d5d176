"""Typed errors of the repository core.

Every error carries ``reason``: a short snake_case string from a fixed enumeration, safe to use
as a metric label, plus an optional free-text ``message`` for logs. Never put free text in
``reason``.

:class:`ReasonError` is that shape for the whole code base (this is the lowest layer, so every
package derives its reason-carrying exceptions from it instead of repeating the ``__init__``).
"""

from __future__ import annotations

from typing import ClassVar


class ReasonError(Exception):
    """An exception with a fixed snake_case ``reason`` (a metric label) and a free-text ``message``.

    ``reason`` is stored as a plain ``str`` (a ``StrEnum`` member such as ``firehose.reasons.Reason``
    becomes its value). ``str(exc)`` is ``"reason: message"`` (``"reason"`` without a message); a
    subclass whose message is already a complete sentence for people sets ``show_reason = False``,
    and ``str(exc)`` is then the message alone (still ``"reason"`` without one).
    """

    show_reason: ClassVar[bool] = True
    reason: str
    message: str

    def __init__(self, reason: str, message: str = "") -> None:
        reason = str(reason)
        if not message:
            text = reason
        elif self.show_reason:
            text = f"{reason}: {message}"
        else:
            text = message
        super().__init__(text)
        self.reason = reason
        self.message = message


class RepoError(ReasonError):
    """Base of every error raised by ``mst``: ``reason`` is a fixed snake_case code."""


class CBORError(RepoError):
    """Bytes are not strict DAG-CBOR (or an object cannot be encoded as DAG-CBOR)."""


class CIDError(RepoError):
    """A CID is malformed or not of the blessed atproto form (CIDv1, dag-cbor/raw, sha-256)."""


class CARError(RepoError):
    """A CAR file is malformed, exceeds a limit, or a block does not match its CID."""


class MSTError(RepoError):
    """An MST node or tree is malformed or non-canonical, or an MST key is invalid."""


class MissingBlockError(MSTError):
    """A block needed to complete an operation is not in the block set."""

    def __init__(self, cid: object, message: str = "") -> None:
        super().__init__("missing_block", message or f"block {cid} not available")
        self.cid = cid


class InversionError(MSTError):
    """Operations cannot be inverted against the tree (the op list does not match the tree)."""


class CommitError(RepoError):
    """A commit object is malformed or does not verify."""


class KeyFormatError(RepoError):
    """A public key, private key or did:key string is malformed or of an unsupported curve."""


class InvalidIdentifier(RepoError):
    """An identifier (DID, handle, NSID, TID, record key, AT-URI, datetime) has invalid syntax."""


class DataModelError(RepoError):
    """A value is outside the atproto data model (JSON or CBOR form)."""
