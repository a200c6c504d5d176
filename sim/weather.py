"""The network's "weather" for the simulator: slow or failing identity services on 127.0.0.1.

* :class:`Delay` – a delay distribution: ``Delay.fixed(s)`` or ``Delay.tail(p50, p99)`` (a
  log-normal through both quantiles, capped at ``cap``); ``sample(rng)`` draws one delay.
* :class:`HandleWeather` – per-handle behaviour of a handle's domain: a delay before each answer
  and whether the answer is a failure. Consulted by :class:`SimDNS` (TXT ``_atproto.<handle>``
  and address lookups) and by ``SimPLC``'s ``resolveHandle``.
* :class:`SimDNS` – a DNS server on 127.0.0.1 (UDP) answering TXT ``_atproto.<handle>`` with
  ``did=<did>`` for every handle of ``handles`` (shared with the PLC directory), NXDOMAIN for
  anything else, each answer after the handle's delay; a failing handle gets NXDOMAIN (or no
  answer at all, ``fail="silent"``). A relay uses it with ``RELAY_DNS_SERVERS=127.0.0.1:<port>``.
  ``SimDNS.resolve_address`` is an ``relay.ssrf.Resolver`` (name → addresses) with the same
  weather: a test's in-process relay uses it as its address resolver, so the HTTPS fallback of a
  handle check (``https://<handle>/.well-known/atproto-did``) waits the handle's delay, then
  reaches 127.0.0.1:443, where nothing listens (the check fails fast).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Final, cast

import dns.exception
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset

from relay.ssrf import SSRFError

#: how a failing handle's DNS query is answered: ``nxdomain`` (an answer saying "no such name")
#: or ``silent`` (no answer at all: the client's own timeout ends the lookup)
HANDLE_FAILURES: Final = ("nxdomain", "silent")


@dataclass(frozen=True)
class Delay:
    """A delay distribution (seconds). ``fixed``: always ``p50``. ``tail``: log-normal with median
    ``p50`` and 99th percentile ``p99``, never above ``cap``."""

    p50: float
    p99: float
    cap: float

    @classmethod
    def fixed(cls, seconds: float) -> Delay:
        return cls(seconds, seconds, seconds)

    @classmethod
    def tail(cls, p50: float, p99: float, cap: float | None = None) -> Delay:
        if not 0 < p50 <= p99:
            raise ValueError("tail delay needs 0 < p50 <= p99")
        return cls(p50, p99, cap if cap is not None else 3 * p99)

    @classmethod
    def parse(cls, spec: str) -> Delay:
        """``"2"`` (fixed) or ``"p50/p99"`` (tail), seconds, e.g. ``"0.05/3"``."""
        a, sep, b = spec.partition("/")
        return cls.tail(float(a), float(b)) if sep else cls.fixed(float(a))

    def sample(self, rng: random.Random) -> float:
        if self.p99 == self.p50:
            return self.p50
        sigma = math.log(self.p99 / self.p50) / 2.3263478740408408  # z of the 99th percentile
        return min(self.cap, self.p50 * math.exp(rng.gauss(0.0, sigma)))


@dataclass
class HandleWeather:
    """What a handle's domain does: answers after ``delay`` (None: at once); ``fail`` (one of
    :data:`HANDLE_FAILURES`) makes the answer a failure."""

    delay: Delay | None = None
    fail: str | None = None

    def __post_init__(self) -> None:
        if self.fail is not None and self.fail not in HANDLE_FAILURES:
            raise ValueError(f"unknown handle failure {self.fail!r}; known: {', '.join(HANDLE_FAILURES)}")


@dataclass
class HandleDomains:
    """Handle → DID (what a correct check finds) and per-handle weather; one table shared by the
    PLC directory's ``resolveHandle`` and :class:`SimDNS`."""

    dids: dict[str, str] = field(default_factory=dict)
    weather: dict[str, HandleWeather] = field(default_factory=dict)
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    #: answers given, by handle
    checks: Counter[str] = field(default_factory=Counter)

    def delay_of(self, handle: str) -> float:
        w = self.weather.get(handle)
        return w.delay.sample(self.rng) if w is not None and w.delay is not None else 0.0

    def answer(self, handle: str) -> str | None:
        """The DID this handle's domain names now: None when it fails or is unknown."""
        self.checks[handle] += 1
        w = self.weather.get(handle)
        if w is not None and w.fail is not None:
            return None
        return self.dids.get(handle)


class SimDNS(asyncio.DatagramProtocol):
    """A DNS server on 127.0.0.1 for the simulated handles (see the module docstring)."""

    def __init__(self, domains: HandleDomains) -> None:
        self.domains = domains
        self.queries: list[str] = []
        self.port = 0
        self._transport: asyncio.DatagramTransport | None = None
        self._later: set[asyncio.TimerHandle] = set()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: self, local_addr=(host, port))
        self.port = transport.get_extra_info("sockname")[1]

    @property
    def address(self) -> str:
        """``ip:port``, the form ``RELAY_DNS_SERVERS`` takes."""
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        for handle in self._later:
            handle.cancel()
        self._later.clear()
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.DatagramTransport, transport)  # uvloop's is not a subclass

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        try:
            query = dns.message.from_wire(data)
            question = query.question[0]
        except (dns.exception.DNSException, IndexError):
            return
        name = question.name.to_text(omit_final_dot=True).lower()
        self.queries.append(name)
        handle = name.removeprefix("_atproto.")
        weather = self.domains.weather.get(handle)
        if weather is not None and weather.fail == "silent":
            self.domains.checks[handle] += 1
            return
        response = dns.message.make_response(query)
        did = self.domains.answer(handle) if name.startswith("_atproto.") else None
        if did is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == dns.rdatatype.TXT:
            response.answer.append(dns.rrset.from_text(question.name, 60, "IN", "TXT", f'"did={did}"'))
        wire = response.to_wire()
        delay = self.domains.delay_of(handle)
        if delay <= 0:
            self._send(wire, addr)
            return
        timer: asyncio.TimerHandle | None = None

        def fire() -> None:
            if timer is not None:
                self._later.discard(timer)
            self._send(wire, addr)

        timer = asyncio.get_running_loop().call_later(delay, fire)
        self._later.add(timer)

    def _send(self, wire: bytes, addr: tuple[str | int, ...]) -> None:
        if self._transport is not None:
            self._transport.sendto(wire, addr)

    async def resolve_address(self, host: str) -> list[str]:
        """An address resolver (``relay.ssrf.Resolver``): every simulated handle (and any name
        under ``.sim.test``) is 127.0.0.1, after the handle's delay; a failing handle's name
        does not resolve; other names raise ``SSRFError("dns_failure")``."""
        host = host.lower()
        await asyncio.sleep(self.domains.delay_of(host))
        weather = self.domains.weather.get(host)
        if (weather is not None and weather.fail is not None) or not (
                host in self.domains.dids or host.endswith(".sim.test")):
            raise SSRFError("dns_failure", f"cannot resolve {host}")
        return ["127.0.0.1"]
