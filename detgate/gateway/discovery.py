"""Workers found through DNS: a `dns+http://NAME:PORT` entry of DETGATE_WORKERS stands for
every address NAME's A and AAAA records hold (a Kubernetes headless Service's ready pods),
each served at `http://ADDRESS:PORT`.

The names are resolved again every `DETGATE_DNS_REFRESH_S`: an address that appears joins the
router (health-checked, its models and fingerprint learned, before it takes traffic), one
that is gone is drained (no new requests; those in flight finish). An answer that the name
has no records (NXDOMAIN, or no A / AAAA) drains every worker of that name; a lookup that
fails (timeout, SERVFAIL, no server) keeps the last set, so a DNS hiccup cannot empty the
fleet. Resolution runs beside the hot path: choosing a worker never waits on DNS.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver

from detgate.gateway.interrupts import stopping
from detgate.gateway.metrics import Metrics
from detgate.gateway.router import Router, worker_name

log = logging.getLogger("detgate.gateway")

SCHEME_PREFIX = "dns+"
RECORD_TYPES = ("A", "AAAA")
DEFAULT_DNS_PORT = 53


def is_dns_source(entry: str) -> bool:
    return entry.startswith(SCHEME_PREFIX)


@dataclass(frozen=True)
class DnsSource:
    """One `dns+SCHEME://[USER:PASSWORD@]NAME:PORT` entry."""

    spec: str  # as configured: the key of DETGATE_WORKER_LABELS for its workers
    scheme: str
    userinfo: str
    host: str
    port: int

    @classmethod
    def parse(cls, spec: str) -> DnsSource:
        parts = urlsplit(spec.removeprefix(SCHEME_PREFIX))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"a DNS worker entry is dns+http://NAME:PORT, not {worker_name(spec)}")
        if parts.path.strip("/") or parts.query or parts.fragment:
            raise ValueError(f"a DNS worker entry has no path: {worker_name(spec)}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise ValueError(f"bad port in {worker_name(spec)}") from None
        return cls(spec, parts.scheme, parts.netloc.rpartition("@")[0], parts.hostname, port)

    @property
    def name(self) -> str:
        """The entry without user-info: what logs show."""
        return worker_name(self.spec)

    def url(self, address: str) -> str:
        host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
        auth = f"{self.userinfo}@" if self.userinfo else ""
        return f"{self.scheme}://{auth}{host}:{self.port}"


def parse_nameserver(entry: str) -> dns.nameserver.Do53Nameserver:
    """`ADDRESS`, `ADDRESS:PORT` or `[IPV6]:PORT`."""
    host, port = entry, DEFAULT_DNS_PORT
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        port = int(rest.removeprefix(":") or DEFAULT_DNS_PORT)
    elif entry.count(":") == 1:
        host, _, raw = entry.partition(":")
        port = int(raw)
    ipaddress.ip_address(host)  # a name here would need DNS to find DNS
    return dns.nameserver.Do53Nameserver(host, port)


def make_resolver(nameservers: list[str], timeout_s: float) -> dns.asyncresolver.Resolver:
    """The system's resolver (/etc/resolv.conf: servers, search domains, ndots), or the given
    servers; `timeout_s` bounds one whole lookup."""
    resolver = dns.asyncresolver.Resolver(configure=not nameservers)
    if nameservers:
        resolver.nameservers = [parse_nameserver(n) for n in nameservers]
    resolver.lifetime = timeout_s
    resolver.timeout = timeout_s
    return resolver


class Discovery:
    def __init__(self, sources: list[DnsSource], router: Router, metrics: Metrics,
                 resolver: dns.asyncresolver.Resolver, *, refresh_s: float) -> None:
        self.sources = sources
        self.router = router
        self.metrics = metrics
        self.resolver = resolver
        self.refresh_s = refresh_s

    async def watch(self) -> None:
        """Background task: resolve every name now, then every `refresh_s`."""
        while not stopping():
            await self.refresh()
            await asyncio.sleep(self.refresh_s)

    async def refresh(self) -> None:
        found = await asyncio.gather(*(self.addresses(s) for s in self.sources))
        joined = []
        for source, addresses in zip(self.sources, found, strict=True):
            if addresses is not None:
                joined += self.router.update(source.spec, {source.url(a) for a in addresses})
        # Introduced at once rather than at the next health tick.
        await asyncio.gather(*(self.router.check(w) for w in joined))
        self.router.sweep()

    async def addresses(self, source: DnsSource) -> set[str] | None:
        """The name's addresses; None when the lookup failed (the last set stays)."""
        found: set[str] = set()
        for rdtype in RECORD_TYPES:
            try:
                answer = await self.resolver.resolve(source.host, rdtype, search=True,
                                                     raise_on_no_answer=False)
            except dns.resolver.NXDOMAIN:
                continue  # the name does not exist (a headless Service without ready pods)
            except dns.exception.DNSException as exc:
                self.metrics.dns_lookups.labels("failed").inc()
                log.warning("DNS lookup of %s (%s) failed: %s; its workers stay as they were",
                            source.name, rdtype, type(exc).__name__)
                return None
            found.update(r.address for r in answer.rrset or ())
        self.metrics.dns_lookups.labels("ok" if found else "empty").inc()
        return found
