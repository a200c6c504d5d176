"""Record operations: the unit a commit's ``ops`` list is made of."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mst.cid import CID

__all__ = ["Action", "RepoOp"]

Action = Literal["create", "update", "delete"]


@dataclass(frozen=True, slots=True)
class RepoOp:
    """One record operation on repo ``path`` (``<collection>/<rkey>``).

    ``cid`` is the record CID after the op (``None`` for deletes); ``prev`` the CID before it
    (``None`` for creates). Sync 1.1 requires ``prev`` on updates and deletes for inversion.
    """

    action: Action
    path: str
    cid: CID | None
    prev: CID | None = None
