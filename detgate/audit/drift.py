"""`detgate drift`: ask a gateway for drift reports (`POST /v1/drift`, once per API key: each
tenant's records, replayed under that tenant's limits), merge them into one fleet report with
the contract's drift arithmetic, and show it (drift_report.py)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import httpx
from rich.console import Console

from detgate.audit import drift_report
from detgate.audit.client import api_root
from detgate.contract import drift

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class DriftRequest:
    from_fingerprint: str
    to_fingerprint: str
    sample: int | None
    endpoint: str | None
    seed: int
    concurrency: int

    def body(self) -> dict:
        out = {"from_fingerprint": self.from_fingerprint, "to_fingerprint": self.to_fingerprint,
               "seed": self.seed, "concurrency": self.concurrency}
        if self.sample is not None:
            out["sample"] = self.sample
        if self.endpoint is not None:
            out["endpoint"] = ENDPOINTS[self.endpoint]
        return out


class DriftError(Exception):
    pass


def fetch(base_url: str, api_key: str | None, request: DriftRequest, timeout_s: float) -> dict:
    """One tenant's report (the key's), as the gateway answered it."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.post(api_root(base_url) + "/v1/drift", json=request.body(), headers=headers,
                       timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise DriftError(f"{base_url}: {type(exc).__name__}: {exc}") from None
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        raise DriftError(f"POST /v1/drift answered {r.status_code}: {message}")
    return r.json()


def merge(reports: list[dict]) -> dict:
    """Several tenants' reports as one: rows concatenated, summaries computed again."""
    rows = [row for rep in reports for row in rep["records"]]
    first = reports[0]
    return {
        "object": "drift.fleet", "from_fingerprint": first["from_fingerprint"],
        "to_fingerprint": first["to_fingerprint"],
        "reports": [{k: rep[k] for k in ("id", "tenant", "created", "examined", "matched",
                                         "selected", "duration_s")} for rep in reports],
        "matched": sum(rep["matched"] for rep in reports),
        "selected": sum(rep["selected"] for rep in reports),
        "duration_s": round(sum(rep["duration_s"] for rep in reports), 3),
        **drift.summaries(rows), "records": rows,
    }


def main(args) -> int:
    console = Console(stderr=False)
    keys = args.api_key or [os.environ.get("OPENAI_API_KEY")]
    request = DriftRequest(args.from_fingerprint, args.to_fingerprint, args.sample,
                           args.endpoint, args.seed, args.concurrency)
    reports = []
    try:
        for key in keys:
            with console.status(f"replaying records of {request.from_fingerprint} on "
                                f"{request.to_fingerprint} ({len(reports) + 1} of {len(keys)})"):
                reports.append(fetch(args.base_url, key, request, args.timeout))
    except DriftError as exc:
        print(f"detgate drift: {exc}", file=sys.stderr)
        return 1
    fleet = merge(reports)
    drift_report.render_terminal(fleet, console)
    if args.json:
        drift_report.write_json(fleet, args.json)
    if args.png:
        drift_report.write_png(fleet, args.png)
    return 0
