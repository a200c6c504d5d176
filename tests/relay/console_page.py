"""Driving the operator console (``/dashboard``) in Debian's Chromium: shared by the console tests.

Every wait is on the page's DOM (a poll rendered, a row present, a value shown), never on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import struct
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import websockets
from playwright.async_api import Dialog, Page, async_playwright
from playwright.async_api import TimeoutError as PlaywrightTimeout

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("RELAY_TEST_ARTIFACTS", ROOT / "test-artifacts"))
WAIT_MS = 30_000


def chromium() -> str:
    """Debian's Chromium (``./run`` installs it); Playwright downloads no browser of its own."""
    path = os.environ.get("RELAY_TEST_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "chromium is not installed (./run test installs Debian's chromium package)"
    return path


@contextlib.asynccontextmanager
async def console(url: str, dialogs: list[str] | None = None) -> AsyncIterator[Page]:
    """A Chromium page on ``url + "/dashboard?interval=300"``, its first poll rendered; every
    confirmation dialog is accepted and its text appended to ``dialogs``."""
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            page = await browser.new_page(viewport={"width": 1500, "height": 1000})
            seen = dialogs if dialogs is not None else []

            def on_dialog(dialog: Dialog) -> None:
                seen.append(dialog.message)
                asyncio.ensure_future(dialog.accept())

            page.on("dialog", on_dialog)
            await page.goto(url + "/dashboard?interval=300")
            await polled(page, 1)
            yield page
        finally:
            await browser.close()


async def polled(page: Page, n: int = 1) -> None:
    """Wait until the page has rendered ``n`` more polls than it had when called."""
    now = await page.evaluate("Number(document.body.dataset.polls || 0)")
    await page.wait_for_function(f"Number(document.body.dataset.polls || 0) >= {now + n}", timeout=WAIT_MS)


async def login(page: Page, token: str) -> None:
    await page.fill("#token", token)
    await page.click("#token-set")
    await page.wait_for_selector("#accounts", state="visible", timeout=WAIT_MS)


async def flashed(page: Page, contains: str) -> str:
    """Wait for the action's result line to report success and contain ``contains``; return it."""
    try:
        await page.wait_for_function(
            "([want]) => { const f = document.getElementById('flash');"
            " return f.dataset.result === 'ok' && f.textContent.includes(want); }", arg=[contains], timeout=WAIT_MS)
    except PlaywrightTimeout:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(ARTIFACTS / "console-failed.png"), full_page=True)
        raise AssertionError(f"no {contains!r}; the page says {await page.locator('#flash').inner_text()!r}") from None
    return await page.locator("#flash").inner_text()


async def shown(page: Page, selector: str, value: str) -> None:
    """Wait until ``selector`` exists and its text is ``value``."""
    await page.wait_for_function(
        "([sel, want]) => { const el = document.querySelector(sel); return el && el.textContent.trim() === want; }",
        arg=[selector, value], timeout=WAIT_MS)


async def valued(page: Page, selector: str, value: float) -> None:
    """Wait until ``selector`` exists and its ``data-value`` is ``value``."""
    await page.wait_for_function(
        "([sel, want]) => { const el = document.querySelector(sel); return el && Number(el.dataset.value) === want; }",
        arg=[selector, value], timeout=WAIT_MS)


def png_pixels(path: Path) -> tuple[int, int, bytes]:
    """Width, height and the decompressed (still filtered) scanlines of a PNG file."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    return width, height, zlib.decompress(idat)


async def screenshot(page: Page, name: str, texts: list[str]) -> Path:
    """A full-page screenshot in ``ARTIFACTS``, checked: a real image (a page's width, many
    distinct byte values: not blank) of a page whose visible text holds each of ``texts``."""
    body = await page.locator("body").inner_text()
    for want in texts:
        assert want in body, f"{want!r} is not on the page"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    await page.screenshot(path=str(path), full_page=True)
    width, height, raw = png_pixels(path)
    assert width == 1500 and height >= 1000, (width, height)
    assert len(set(raw)) > 64, "the screenshot is (nearly) blank"
    return path


class WireCounter:
    """A WebSocket client that reads ``url`` until closed, counting the payload bytes received
    (binary frames as they are, text frames as UTF-8): what a consumer was actually sent."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.bytes = 0
        self.messages = 0
        self._task: asyncio.Task[None] | None = None
        self._ws: websockets.ClientConnection | None = None

    async def __aenter__(self) -> WireCounter:
        self._ws = await websockets.connect(self.url, max_size=None, compression=None)
        self._task = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self._ws is not None
        with contextlib.suppress(websockets.ConnectionClosed):
            async for message in self._ws:
                self.bytes += len(message) if isinstance(message, bytes) else len(message.encode())
                self.messages += 1

    async def __aexit__(self, *exc: object) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._task is not None:
            await asyncio.wait_for(self._task, 5)
