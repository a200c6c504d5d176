"""Typed errors of the repository core.

Every error carries ``reason``: a short snake_case string from a fixed enumeration, safe to use
as a metric label, plus an optional free-text ``message`` for logs. Never put free text in
``reason``.
"""

from __future__ import annotations


class RepoError(Exception):
    """Base of every error raised by ``mst``: ``reason`` is a fixed snake_case code."""

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason = reason
        self.message = message


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
