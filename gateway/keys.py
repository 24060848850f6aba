"""Every Redis key the gateway writes, in one place (never a KEYS scan: tenants have indexes).

Keys carry the tenant, so another tenant's id is not just refused but absent: the lookup
misses exactly as an unknown id does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str

    def record(self, tenant: str, record_id: str) -> str:
        """String: the record JSON."""
        return f"{self.prefix}:rec:{tenant}:{record_id}"

    def replays(self, tenant: str, record_id: str) -> str:
        """List: comparison JSON per replay, oldest first; expires with its record."""
        return f"{self.prefix}:rpl:{tenant}:{record_id}"

    def index(self, tenant: str) -> str:
        """Sorted set: record ids scored by creation time, for listing newest first."""
        return f"{self.prefix}:idx:{tenant}"

    def stored(self, tenant: str) -> str:
        """String: the bytes of the tenant's live records (the storage budget's total)."""
        return f"{self.prefix}:sto:{tenant}"

    def expiries(self, tenant: str) -> str:
        """Sorted set: `<record id>:<bytes>` scored by the record's expiry time, so that the
        total can be lowered exactly as records expire."""
        return f"{self.prefix}:exp:{tenant}"
