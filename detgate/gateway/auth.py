"""API keys: `tenant:key` pairs from DETGATE_API_KEYS, kept and logged only as SHA-256 hashes.

A presented key is hashed and compared against every known hash with `hmac.compare_digest`,
so neither the comparison nor the loop's length depends on which key (if any) matched.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

from detgate.gateway.errors import Unauthorized

OPEN_TENANT = "default"
_TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def key_hash(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class Authenticator:
    """`hashes` pairs each key's hash with its tenant; empty means open mode."""

    hashes: tuple[tuple[bytes, str], ...]

    @classmethod
    def from_pairs(cls, pairs: list[str]) -> Authenticator:
        hashes: list[tuple[bytes, str]] = []
        for pair in pairs:
            tenant, sep, key = pair.partition(":")
            n = len(hashes) + 1
            # The pair itself may hold a secret: say which position, never the text.
            if not sep or not _TENANT.match(tenant):
                raise ValueError(f"DETGATE_API_KEYS entry {n} is not tenant:key "
                                 "with a tenant of letters, digits, '_', '.', '-'")
            if not key.strip() or key != key.strip():
                raise ValueError(f"DETGATE_API_KEYS entry {n} has an empty key or one with "
                                 "spaces around it")
            digest = key_hash(key)
            same = next((i + 1 for i, (d, _) in enumerate(hashes) if d == digest), None)
            if same is not None:
                # One key for two tenants would make the tenant depend on the entry order.
                raise ValueError(f"DETGATE_API_KEYS entries {same} and {n} have the same key")
            hashes.append((digest, tenant))
        return cls(tuple(hashes))

    @property
    def open_mode(self) -> bool:
        return not self.hashes

    def tenant(self, authorization: str | None) -> str:
        if self.open_mode:
            return OPEN_TENANT
        # The scheme is case-insensitive (RFC 9110 section 11.1): "bearer", "BEARER" too.
        scheme, _, credentials = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        presented = key_hash(credentials.strip())
        found = None
        for digest, tenant in self.hashes:
            if hmac.compare_digest(digest, presented):
                found = tenant
        if found is None:
            raise Unauthorized("invalid API key")
        return found
