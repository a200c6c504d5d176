"""Request generator for fuzzing the relay's HTTP surface: XRPC methods described by the Lexicons in
``../shared/lexicons/com/atproto/sync`` and every admin route.

Seeded (``random.Random``), so a failing request is reproduced by its index. Values mix what the
schema asks for (valid DIDs, handles, in-range integers, known hostnames and DIDs from the store)
with hostile input: NUL and other control characters, huge and malformed integers, very long
strings, deeply nested or wrongly typed JSON, bodies that are not JSON at all.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from tests.conftest import SHARED

LEXICON_DIR = SHARED / "lexicons" / "com" / "atproto" / "sync"

HOSTILE_STRINGS = [
    "", " ", "\x00", "a\x00b", "did:plc:\x00", "\x01\x7f", "%00", "'; DROP TABLE hosts; --", "\\", "\"",
    "🦋", "\u202e", "\ufffd", "ä" * 300, "x" * 5000, "did:plc:" + "a" * 3000, "did:web:[::1]", "../../etc/passwd",
    "null", "true", "-1", "1e309", "NaN", "0x10", "١٢٣", "9" * 50, "-" + "9" * 30, "\t5", "5 ", "1_000",
]
HOSTILE_INTS = [0, -1, 1, 1000, 1001, 2**31, 2**53, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]
JSON_VALUES: list[Any] = [None, True, False, 0, -1, 1.5, 2**63, 10**40, 1e308, "", "\x00", "a\x00",
                          "x" * 2000, [], {}, [1, "a"], {"a": {"b": None}}]
ADMIN_FIELDS = ["hostname", "account_limit", "trusted", "rate_limit_per_second", "rate_limit_per_hour",
                "rate_limit_per_day", "cursor", "domain", "enabled"]


@dataclass
class Method:
    nsid: str
    kind: str  # query | procedure
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    required: list[str] = field(default_factory=list)
    body: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class FuzzRequest:
    method: str
    path: str  # already percent-encoded
    headers: dict[str, str]
    content: bytes | None = None

    def describe(self) -> str:
        body = "" if self.content is None else f" body={self.content[:200]!r}{'…' if len(self.content) > 200 else ''}"
        return f"{self.method} {self.path[:300]}{body}"


def load_methods(directory: Path = LEXICON_DIR) -> list[Method]:
    """Every query/procedure Lexicon in ``directory`` (subscriptions are WebSockets: skipped)."""
    out = []
    for path in sorted(directory.glob("*.json")):
        doc = json.loads(path.read_text())
        main = doc.get("defs", {}).get("main", {})
        if main.get("type") not in ("query", "procedure"):
            continue
        params = main.get("parameters", {})
        schema = (main.get("input") or {}).get("schema") or {}
        out.append(Method(doc["id"], main["type"], params.get("properties", {}), params.get("required", []),
                          schema.get("properties", {})))
    return out


class Generator:
    """Makes requests for the XRPC methods and admin routes; ``dids``/``hostnames`` are known to the store."""

    def __init__(self, seed: int, methods: list[Method], admin_routes: list[tuple[str, str]], *,
                 token: str, dids: list[str], hostnames: list[str]) -> None:
        self.rng = random.Random(seed)
        self.methods = methods
        self.admin_routes = admin_routes
        self.token = token
        self.dids = dids
        self.hostnames = hostnames

    # -- values
    def string(self, fmt: str | None = None, known: list[str] | None = None) -> str:
        r = self.rng
        roll = r.random()
        if roll < 0.35:
            return r.choice(HOSTILE_STRINGS)
        if fmt == "did" or (roll < 0.55 and fmt is None):
            return r.choice(self.dids + ["did:plc:" + "".join(r.choices("abcdefghijklmnopqrstuvwxyz234567", k=24)),
                                         "did:web:example.com", "did:key:zQ3sh", "did:plc:UPPER"])
        if fmt == "handle":
            return r.choice(["alice.example.com", "a..b", "-bad-.com", "x" * 300 + ".com"])
        if fmt == "cid":
            return r.choice(["bafyreie5737gdxlw5i64vzichcalba3z2v5n6icifvx5xytvske7mr3hpm", "bafy", "Qm" + "1" * 44])
        if known or roll < 0.75:
            return r.choice((known or []) + self.hostnames + ["pds.example.com", "localhost", "127.0.0.1:1"])
        return "".join(chr(r.randrange(1, 0x2FFF)) for _ in range(r.randrange(1, 40))).replace("\ud800", "")

    def integer_text(self, spec: dict[str, Any]) -> str:
        r = self.rng
        lo, hi = spec.get("minimum", 0), spec.get("maximum", 10**6)
        roll = r.random()
        if roll < 0.4:
            return str(r.randint(lo, hi))
        if roll < 0.7:
            return str(r.choice(HOSTILE_INTS + [lo - 1, hi + 1]))
        return r.choice(HOSTILE_STRINGS)

    def json_value(self, spec: dict[str, Any] | None = None) -> Any:
        r = self.rng
        if spec is not None and r.random() < 0.5:
            kind = spec.get("type")
            if kind == "string":
                return self.string(spec.get("format"), self.hostnames)
            if kind == "integer":
                return r.choice(HOSTILE_INTS)
            if kind == "boolean":
                return r.choice([True, False])
        value = r.choice(JSON_VALUES)
        return json.loads(json.dumps(value)) if not isinstance(value, float) else value

    def body(self, fields: dict[str, dict[str, Any]]) -> tuple[bytes, str]:
        """A request body and its content type."""
        r = self.rng
        roll = r.random()
        if roll < 0.08:
            depth = r.choice([50, 1000, 20_000])
            return (b"[" * depth + b"]" * depth) if r.random() < 0.5 else (b'{"a":' * depth + b"1" + b"}" * depth), \
                "application/json"
        if roll < 0.14:
            return r.choice([b"", b"{", b"not json", b"\xff\xfe\x00", b"[1,2]", b'"str"', b"null", b"1e999999",
                             b'{"hostname": "a\\u0000b"}', b'{"\\u0000": 1}']), r.choice(["application/json", "text/plain"])
        if roll < 0.17:
            return b'{"hostname": "' + b"a" * (70 * 1024) + b'"}', "application/json"  # over the 64 KiB limit
        doc: dict[str, Any] = {}
        for name, spec in fields.items():
            if r.random() < 0.8:
                doc[name] = self.json_value(spec)
        for name in r.sample(ADMIN_FIELDS, r.randrange(0, 3)):
            doc[name] = self.json_value()
        return json.dumps(doc).encode(), "application/json"

    def query(self, method: Method) -> str:
        r = self.rng
        pairs: list[tuple[str, str]] = []
        for name, spec in method.params.items():
            if name not in method.required and r.random() < 0.3:
                continue
            for _ in range(2 if r.random() < 0.05 else 1):
                kind = spec.get("type")
                if kind == "integer":
                    pairs.append((name, self.integer_text(spec)))
                elif kind == "boolean":
                    pairs.append((name, r.choice(["true", "false", "1", "yes", "\x00"])))
                elif kind == "array":
                    pairs.extend((name, self.string()) for _ in range(r.randrange(0, 4)))
                else:
                    pairs.append((name, self.string(spec.get("format"))))
        if r.random() < 0.1:
            pairs.append((r.choice(["x", "cursor", "\x00", "limit"]), self.string()))
        return "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in pairs)

    # -- requests
    def xrpc(self) -> FuzzRequest:
        r = self.rng
        method = r.choice(self.methods)
        verb = ("GET" if method.kind == "query" else "POST") if r.random() < 0.9 else r.choice(["GET", "POST", "PUT", "DELETE"])
        query = self.query(method)
        path = f"/xrpc/{method.nsid}" + (f"?{query}" if query else "")
        headers: dict[str, str] = {}
        content = None
        if verb in ("POST", "PUT"):
            content, headers["content-type"] = self.body(method.body)
        return FuzzRequest(verb, path, headers, content)

    def admin(self) -> FuzzRequest:
        r = self.rng
        verb, template = r.choice(self.admin_routes)
        path = template
        while "{" in path:
            start, end = path.index("{"), path.index("}")
            name = path[start + 1:end].split(":")[0]
            value = self.string("did" if name == "did" else None, self.hostnames)
            path = path[:start] + quote(value, safe="") + path[end + 1:]
        if r.random() < 0.3:
            path += "?" + f"cursor={quote(self.string(), safe='')}&limit={quote(self.integer_text({'minimum': 1, 'maximum': 1000}), safe='')}"
        roll = r.random()
        headers = {"authorization": f"Bearer {self.token}"} if roll < 0.85 else \
            r.choice([{}, {"authorization": "Bearer wrong"}, {"authorization": "Basic x"}, {"authorization": "Bearer"}])
        content = None
        if verb in ("POST", "DELETE") and r.random() < 0.9:
            content, headers["content-type"] = self.body({})
        return FuzzRequest(verb, path, headers, content)

    def next(self) -> FuzzRequest:
        return self.xrpc() if self.rng.random() < 0.6 else self.admin()
