"""Identifier syntax validators (atproto specs: DID, handle, NSID, TID, record key, AT-URI,
datetime, plus the lexicon string formats at-identifier, cid, uri and language).

``is_valid_*(s) -> bool`` never raises; ``ensure_valid_*(s)`` raises
:class:`mst.errors.InvalidIdentifier` with a fixed reason (``invalid_did``, ``invalid_handle``,
``invalid_nsid``, ``invalid_tid``, ``invalid_record_key``, ``invalid_at_uri``,
``invalid_datetime``, ``invalid_repo_path``). Whitespace is never trimmed.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

from mst.errors import InvalidIdentifier

__all__ = [
    "ensure_valid_at_uri",
    "ensure_valid_datetime",
    "ensure_valid_did",
    "ensure_valid_handle",
    "ensure_valid_nsid",
    "ensure_valid_record_key",
    "ensure_valid_repo_path",
    "ensure_valid_tid",
    "is_valid_at_identifier",
    "is_valid_at_uri",
    "is_valid_cid_string",
    "is_valid_datetime",
    "is_valid_did",
    "is_valid_handle",
    "is_valid_language",
    "is_valid_nsid",
    "is_valid_record_key",
    "is_valid_repo_path",
    "is_valid_tid",
    "is_valid_uri",
]

_DID_RE = re.compile(r"did:[a-z]+:[a-zA-Z0-9._:%-]*[a-zA-Z0-9._-]")
_HANDLE_RE = re.compile(
    r"([a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?\.)+[a-zA-Z]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
)
_NSID_RE = re.compile(
    r"[a-zA-Z]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
    r"(\.[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?)+"
    r"\.[a-zA-Z][a-zA-Z0-9]{0,62}"
)
_TID_RE = re.compile(r"[234567abcdefghij][234567abcdefghijklmnopqrstuvwxyz]{12}")
_RKEY_RE = re.compile(r"[a-zA-Z0-9_~.:-]{1,512}")
_AT_URI_RE = re.compile(
    r"at://(?P<authority>[a-zA-Z0-9._:%-]+)"
    r"(/(?P<collection>[a-zA-Z0-9.-]+)(/(?P<rkey>[a-zA-Z0-9._~:@!$&%')(*+,;=-]+))?)?"
    r"(#(?P<fragment>/[a-zA-Z0-9._~:@!$&%')(*+,;=\-\[\]/\\]*))?"
)
_DATETIME_RE = re.compile(
    r"[0-9]{4}-[01][0-9]-[0-3][0-9]T[0-2][0-9]:[0-6][0-9]:[0-6][0-9](\.[0-9]{1,20})?"
    r"(Z|([+-][0-2][0-9]:[0-5][0-9]))"
)
_URI_RE = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*:(//)?[^\s/][^\s]*")
_CID_STR_RE = re.compile(r"[a-zA-Z0-9+=]{8,256}")
_LANG_RE = re.compile(
    r"(i-[a-zA-Z0-9]+(-[a-zA-Z0-9]+)*)"  # grandfathered irregular
    r"|(sgn-BE-FR|sgn-BE-NL|sgn-CH-DE|en-GB-oed)"  # grandfathered irregular
    r"|([xX](-[a-zA-Z0-9]{1,8})+)"  # private use only
    r"|([a-z]{2,3}(-[a-zA-Z]{3}){0,3}"  # language + extlang
    r"(-[a-zA-Z]{4})?"  # script
    r"(-([a-zA-Z]{2}|[0-9]{3}))?"  # region
    r"(-([a-zA-Z0-9]{5,8}|[0-9][a-zA-Z0-9]{3}))*"  # variants
    r"(-[0-9a-wyzA-WYZ](-[a-zA-Z0-9]{2,8})+)*"  # extensions
    r"(-[xX](-[a-zA-Z0-9]{1,8})+)?)"  # private use
)


def is_valid_did(s: str) -> bool:
    """DID syntax (method lowercase, identifier charset, no trailing ':' or '%', <= 2048 chars)."""
    return isinstance(s, str) and len(s) <= 2048 and _DID_RE.fullmatch(s) is not None


def is_valid_handle(s: str) -> bool:
    """Handle syntax (DNS name, >= 2 labels, TLD starts with a letter, <= 253 chars)."""
    return isinstance(s, str) and len(s) <= 253 and _HANDLE_RE.fullmatch(s) is not None


def is_valid_nsid(s: str) -> bool:
    """NSID syntax: >= 3 segments, domain authority, name segment letters/digits, <= 317 chars."""
    return isinstance(s, str) and len(s) <= 317 and _NSID_RE.fullmatch(s) is not None


def is_valid_tid(s: str) -> bool:
    """TID: 13 chars base32-sortable, first char limits the top bit to 0."""
    return isinstance(s, str) and len(s) == 13 and _TID_RE.fullmatch(s) is not None


def is_valid_record_key(s: str) -> bool:
    """Record key: 1-512 chars of ``[A-Za-z0-9_~.:-]``, not ``.`` or ``..``."""
    return isinstance(s, str) and s not in (".", "..") and _RKEY_RE.fullmatch(s) is not None


def is_valid_repo_path(s: str) -> bool:
    """Repo path ``<nsid>/<record-key>``."""
    if not isinstance(s, str):
        return False
    coll, sep, rkey = s.partition("/")
    return bool(sep) and is_valid_nsid(coll) and is_valid_record_key(rkey)


def is_valid_at_identifier(s: str) -> bool:
    """A DID or a handle."""
    return is_valid_did(s) or is_valid_handle(s)


def is_valid_at_uri(s: str) -> bool:
    """Strict AT-URI: ``at://<did|handle>[/<nsid>[/<rkey>]][#/<fragment>]``, <= 8 KB."""
    if not isinstance(s, str) or len(s) > 8 * 1024:
        return False
    m = _AT_URI_RE.fullmatch(s)
    if m is None or not is_valid_at_identifier(m.group("authority")):
        return False
    coll = m.group("collection")
    if coll is not None and not is_valid_nsid(coll):
        return False
    rkey = m.group("rkey")
    return rkey is None or is_valid_record_key(rkey)


def is_valid_datetime(s: str) -> bool:
    """RFC 3339 datetime with required timezone (``Z`` or ``±hh:mm``, not ``-00:00``) that
    parses to a real instant; whitespace or lowercase ``t``/``z`` are invalid."""
    if not isinstance(s, str) or len(s) > 64 or _DATETIME_RE.fullmatch(s) is None:
        return False
    if s.endswith("-00:00"):
        return False
    body = s[:-1] + "+00:00" if s.endswith("Z") else s
    year0 = body.startswith("0000")
    if year0:  # datetime has no year 0; year 400 has the same (leap) calendar
        body = "0400" + body[4:]
    main, _, rest = body.partition(".")
    if rest:  # drop fractional digits beyond microseconds for parsing
        frac = rest[:-6]
        body = f"{main}.{(frac + '000000')[:6]}{rest[-6:]}"
    try:
        dt = datetime.fromisoformat(body)
    except ValueError:
        return False
    # datetime enforces month/day/hour/minute/second ranges; the instant must be >= year 0
    if year0:
        try:
            return dt.astimezone(UTC).year >= 400
        except (OverflowError, ValueError):
            return False
    try:
        dt.astimezone(UTC)
    except (OverflowError, ValueError):
        return False
    return True


def is_valid_uri(s: str) -> bool:
    """Lexicon ``uri`` format: ``scheme:`` then no whitespace, <= 8 KB."""
    return isinstance(s, str) and len(s) <= 8192 and _URI_RE.fullmatch(s) is not None


def is_valid_cid_string(s: str) -> bool:
    """Lexicon ``cid`` format (loose: any multibase CID string shape; CIDv0 ``Qm…`` rejected)."""
    return isinstance(s, str) and not s.startswith("Qm") and _CID_STR_RE.fullmatch(s) is not None


def is_valid_language(s: str) -> bool:
    """BCP-47 language tag: syntax, plus no repeated variant or extension singleton."""
    if not isinstance(s, str) or len(s) > 128 or _LANG_RE.fullmatch(s) is None:
        return False
    seen_variants: set[str] = set()
    seen_singletons: set[str] = set()
    in_extension = False
    for i, sub in enumerate(s.lower().split("-")):
        if i == 0:
            continue
        if sub == "x":
            break
        if len(sub) == 1:
            if sub in seen_singletons:
                return False
            seen_singletons.add(sub)
            in_extension = True
        elif not in_extension and (len(sub) >= 5 or (len(sub) == 4 and sub[0].isdigit())):
            if sub in seen_variants:
                return False
            seen_variants.add(sub)
    return True


def _ensure(ok: bool, reason: str, s: object) -> None:
    if not ok:
        raise InvalidIdentifier(reason, repr(s)[:100])


def ensure_valid_did(s: str) -> None:
    _ensure(is_valid_did(s), "invalid_did", s)


def ensure_valid_handle(s: str) -> None:
    _ensure(is_valid_handle(s), "invalid_handle", s)


def ensure_valid_nsid(s: str) -> None:
    _ensure(is_valid_nsid(s), "invalid_nsid", s)


def ensure_valid_tid(s: str) -> None:
    _ensure(is_valid_tid(s), "invalid_tid", s)


def ensure_valid_record_key(s: str) -> None:
    _ensure(is_valid_record_key(s), "invalid_record_key", s)


def ensure_valid_repo_path(s: str) -> None:
    _ensure(is_valid_repo_path(s), "invalid_repo_path", s)


def ensure_valid_at_uri(s: str) -> None:
    _ensure(is_valid_at_uri(s), "invalid_at_uri", s)


def ensure_valid_datetime(s: str) -> None:
    _ensure(is_valid_datetime(s), "invalid_datetime", s)
