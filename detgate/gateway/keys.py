"""Every Redis key the gateway writes, in one place (never a KEYS scan: tenants have indexes).

Keys carry the tenant, so another tenant's id is not just refused but absent: the lookup
misses exactly as an unknown id does.

The tenant is each key's hash tag (`{tenant}`): all of a tenant's keys (records, replays,
index, storage account, rate buckets, refusal ring, drift report) hash to one slot, so every
script and every batch of commands the gateway sends touches one slot, which in a Redis
Cluster is one node, and a record's write, index entry, byte count and token charge stay one
atomic script. A cluster spreads tenants over its masters; one tenant's records live on the
master that serves its slot.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str

    def __post_init__(self) -> None:
        if "{" in self.prefix or "}" in self.prefix:
            raise ValueError("the key prefix may not contain '{' or '}' (the tenant is the "
                             "keys' hash tag)")

    def record(self, tenant: str, record_id: str) -> str:
        """String: the record JSON."""
        return f"{self.prefix}:rec:{{{tenant}}}:{record_id}"

    def replays(self, tenant: str, record_id: str) -> str:
        """List: comparison JSON per replay, oldest first; expires with its record."""
        return f"{self.prefix}:rpl:{{{tenant}}}:{record_id}"

    def index(self, tenant: str) -> str:
        """Sorted set: record ids scored by creation time, for listing newest first."""
        return f"{self.prefix}:idx:{{{tenant}}}"

    def stored(self, tenant: str) -> str:
        """String: the bytes of the tenant's live records (the storage budget's total)."""
        return f"{self.prefix}:sto:{{{tenant}}}"

    def expiries(self, tenant: str) -> str:
        """Sorted set: `<record id>:<bytes>` scored by the record's expiry time, so that the
        total can be lowered exactly as records expire."""
        return f"{self.prefix}:exp:{{{tenant}}}"

    def rates(self, tenant: str) -> str:
        """Hash: when the tenant's requests/s (`r`) and tokens/s (`t`) buckets are full again
        (gateway/rates.py); expires when both are."""
        return f"{self.prefix}:lim:{{{tenant}}}"

    def drift(self, tenant: str) -> str:
        """String: the tenant's last drift report (JSON); replaced by the next one."""
        return f"{self.prefix}:drf:{{{tenant}}}"

    def refusals(self, tenant: str) -> str:
        """List: `<record id>:<bytes>` of the tenant's stored refusals, newest first; the
        oldest beyond the ring's size are deleted as new ones come."""
        return f"{self.prefix}:ref:{{{tenant}}}"
