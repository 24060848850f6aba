"""A real DNS server for tests: UDP on 127.0.0.1 (a free port), answering A and AAAA queries
from `records`, which a test changes while the gateway runs; every other name is NXDOMAIN.
Wire format through dnspython, the library the gateway resolves with."""

from __future__ import annotations

import ipaddress
import socket
import threading

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset

TTL_S = 1


class DnsServer:
    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        # While set, every query is answered SERVFAIL (a broken DNS, not an empty name).
        self.failing = False
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def address(self) -> str:
        """`127.0.0.1:PORT`, as DETGATE_DNS_NAMESERVERS takes it."""
        host, port = self._sock.getsockname()
        return f"{host}:{port}"

    def set(self, name: str, addresses: list[str]) -> None:
        with self._lock:
            self.records[name.rstrip(".").lower()] = list(addresses)

    def remove(self, name: str) -> None:
        with self._lock:
            self.records.pop(name.rstrip(".").lower(), None)

    def start(self) -> DnsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                wire, client = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            try:
                query = dns.message.from_wire(wire)
            except dns.exception.DNSException:
                continue
            self._sock.sendto(self._answer(query).to_wire(), client)

    def _answer(self, query: dns.message.Message) -> dns.message.Message:
        reply = dns.message.make_response(query)
        reply.flags |= dns.flags.AA
        if self.failing:
            reply.set_rcode(dns.rcode.SERVFAIL)
            return reply
        question = query.question[0]
        name = question.name.to_text(omit_final_dot=True).lower()
        with self._lock:
            addresses = self.records.get(name)
        if addresses is None:
            reply.set_rcode(dns.rcode.NXDOMAIN)
            return reply
        version = {dns.rdatatype.A: 4, dns.rdatatype.AAAA: 6}.get(question.rdtype)
        matching = [a for a in addresses if ipaddress.ip_address(a).version == version]
        if matching:
            reply.answer.append(dns.rrset.from_text_list(
                question.name, TTL_S, "IN", dns.rdatatype.to_text(question.rdtype), matching))
        return reply
