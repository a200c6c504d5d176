"""Request bodies are bounded: a refused body is never held, whatever its size or framing."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from tests.relay.process import relay_child

MB = 1024 * 1024
BODY = 256 * MB
CHUNK = b"x" * MB  # the only body bytes this test allocates: sent 256 times per request


async def _post_huge(url: str, path: str, *, chunked: bool) -> int:
    """POST a 256 MB body (chunked, or with its Content-Length) while reading the answer; stop
    sending once the relay answered or closed. Returns the HTTP status."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    framing = b"transfer-encoding: chunked\r\n" if chunked else f"content-length: {BODY}\r\n".encode()
    writer.write(f"POST {path} HTTP/1.1\r\nhost: {parts.netloc}\r\ncontent-type: application/json\r\n"
                 f"authorization: Bearer tok\r\n".encode() + framing + b"\r\n")
    status_line = asyncio.ensure_future(reader.readline())
    chunk_head = f"{len(CHUNK):x}\r\n".encode()
    try:
        with contextlib.suppress(ConnectionError):
            for _ in range(BODY // MB):
                if status_line.done():
                    break
                writer.write(chunk_head + CHUNK + b"\r\n" if chunked else CHUNK)
                await writer.drain()
            else:
                if chunked:
                    writer.write(b"0\r\n\r\n")
                    await writer.drain()
        line = await asyncio.wait_for(status_line, 60)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return int(line.split()[1])


async def test_four_parallel_256mb_bodies_leave_rss_flat(tmp_path: Path) -> None:
    async with relay_child(tmp_path, admin_token="tok", validation_workers="0") as relay:
        async with httpx.AsyncClient(base_url=relay.url) as http:  # warm every handler once
            for path in ("/xrpc/com.atproto.sync.requestCrawl", "/admin/hosts", "/admin/domain-bans"):
                r = await http.post(path, content=b"{}", headers={"authorization": "Bearer tok"})
                assert r.status_code == 400, r.text
        base = relay.status("VmRSS")
        relay.reset_peak_rss()
        statuses = await asyncio.gather(
            _post_huge(relay.url, "/xrpc/com.atproto.sync.requestCrawl", chunked=True),
            _post_huge(relay.url, "/admin/hosts", chunked=True),
            _post_huge(relay.url, "/admin/domain-bans", chunked=True),
            _post_huge(relay.url, "/xrpc/com.atproto.sync.requestCrawl", chunked=False),
        )
        peak = relay.status("VmHWM")
        assert peak - base < 50 * MB, f"RSS rose by {(peak - base) / MB:.1f} MB"
        assert statuses == [413, 413, 413, 413]
        async with httpx.AsyncClient(base_url=relay.url) as http:
            r = await http.post("/xrpc/com.atproto.sync.requestCrawl", content=b"x" * (64 * 1024 + 1))
            assert r.status_code == 413 and r.json()["error"] == "PayloadTooLarge"
            assert (await http.get("/_health")).status_code == 200
